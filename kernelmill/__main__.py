"""The ``kernelmill`` command.

Importing the CLI reads the settings and imports the operator's plugins (``KERNELMILL_PLUGINS``), so a bad
``KERNELMILL_*`` value is reported here, in one line with exit code 2, before any command runs.
"""

from __future__ import annotations

import sys


def main() -> None:
    from kernelmill.settings import SettingsError

    try:
        from kernelmill.cli import app
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    app(prog_name="kernelmill")  # as `python -m kernelmill` too: its usage lines named "python -m kernelmill"


if __name__ == "__main__":
    main()
