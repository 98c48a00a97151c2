"""CUDA C++ Jinja2 templates, shipped as package data: ``<op>/<family>.cu.j2``."""

from importlib.resources import files
from pathlib import Path


def template_dir() -> Path:
    """Folder that holds the templates, in a source checkout or an installed wheel."""
    return Path(str(files(__name__)))
