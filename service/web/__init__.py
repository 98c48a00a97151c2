"""The dashboard: server-rendered pages (Jinja2) with server-side SVG charts, at / of the service.

``install(app)`` adds the pages, the static files at /static and an HTML 404
page for browsers; ``router`` and ``mount_static`` are the two parts alone.
"""

from kernelmill.service.web.pages import install, mount_static, router

__all__ = ["install", "mount_static", "router"]
