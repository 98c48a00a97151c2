"""A fake ``nsys`` on PATH for tests without a GPU or Nsight Systems.

``install(bin_dir, mode, reports)`` writes an executable ``nsys`` (a Python script) that answers

* ``nsys --version`` with a version line;
* ``nsys stats --help-reports`` with the report names of the fixture folder ``reports`` (new or old names);
* ``nsys profile ... --output BASE ... PROGRAM ARGS``: by ``mode``,
  ``ok`` writes ``BASE.nsys-rep`` without running PROGRAM (the forward itself needs a GPU),
  ``not-utf8`` does the same and prints bytes that are not UTF-8,
  ``no-report`` prints what nsys prints when it writes nothing and exits 1,
  ``qdstrm`` leaves a raw ``BASE.qdstrm`` capture and no report (the nsys of Nsight Compute's folder),
  ``run-child`` runs PROGRAM (the real child) and writes no report;
* ``nsys stats --report A,B --format csv --output PREFIX ... REPORT``: copies ``reports/<name>.csv`` to
  ``PREFIX_<name>.csv`` for each name it has, and says SKIPPED for the others (as nsys does).

Every call is appended to ``bin_dir/calls.log`` (one JSON list per line).
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

REPORTS = Path(__file__).parent / "nsys_reports"

_SCRIPT = r"""#!{python}
import json, shutil, subprocess, sys
from pathlib import Path

MODE, REPORTS, LOG = {mode!r}, Path({reports!r}), Path({log!r})
args = sys.argv[1:]
with LOG.open("a") as log:
    log.write(json.dumps(args) + "\n")


def value(flag):
    for i, arg in enumerate(args):
        if arg == flag:
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


if args[:1] == ["--version"]:
    print("NVIDIA Nsight Systems version 2025.3.1.90-253135822126v0")
elif args[:2] == ["stats", "--help-reports"]:
    print("\nThe following built-in reports are available:\n")
    for path in sorted(REPORTS.glob("*.csv")):
        print(f"  {{path.stem}}[:base|:mangled] -- a report")
elif args[:1] == ["profile"]:
    base = value("--output")
    rest = args[1:]
    program = []
    i = 0
    while i < len(rest):
        if rest[i] == "--output":
            i += 2
        elif rest[i].startswith("-"):
            i += 1
        else:
            program = rest[i:]
            break
    if MODE in ("ok", "not-utf8"):
        Path(base + ".nsys-rep").write_bytes(b"fake nsys report")
        print("Generated:\n    " + base + ".nsys-rep", flush=True)
        if MODE == "not-utf8":  # what the child printed, in another encoding
            sys.stdout.buffer.write(b"caf\xe9 au lait\n")
    elif MODE == "no-report":
        print("Collecting data...", flush=True)
        print("Agent launcher failed.\nNo reports were generated", file=sys.stderr)
        sys.exit(1)
    elif MODE == "qdstrm":  # what the nsys bundled with Nsight Compute does on our GPU host
        Path(base + ".qdstrm").write_bytes(b"raw capture")
        print("Generating '" + base + ".qdstrm'")
        print("Failed to create '" + base + ".nsys-rep': QdstrmImporter not found", file=sys.stderr)
    elif MODE == "run-child":
        subprocess.run(program)
        print("No reports were generated", file=sys.stderr)
elif args[:1] == ["stats"]:
    names = value("--report").split(",")
    prefix = value("--output")
    for name in names:
        source = REPORTS / f"{{name}}.csv"
        if source.exists():
            shutil.copy(source, f"{{prefix}}_{{name}}.csv")
        else:
            print(f"SKIPPED: {{args[-1]}} does not contain {{name}} data.")
else:
    print("fake nsys: unknown command " + " ".join(args), file=sys.stderr)
    sys.exit(2)
"""


def install(bin_dir: Path, mode: str = "ok", reports: str | Path = "new") -> Path:
    """Writes ``bin_dir/nsys``; returns its path. ``reports``: "new", "old" or a folder of CSV tables.
    Put ``bin_dir`` first on PATH to use it."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "nsys"
    folder = reports if isinstance(reports, Path) else REPORTS / reports
    source = _SCRIPT.format(python=sys.executable, mode=mode, reports=str(folder), log=str(calls_log(bin_dir)))
    script.write_text(source)
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


def calls_log(bin_dir: Path) -> Path:
    return bin_dir / "calls.log"


def calls(bin_dir: Path) -> list[list[str]]:
    path = calls_log(bin_dir)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def on_path(monkeypatch, bin_dir: Path) -> None:
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")


def nowhere(monkeypatch, tmp_path: Path) -> None:
    """No nsys on PATH nor in the folders find_nsys looks in."""
    from kernelmill.runtime import profile

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.delenv("KERNELMILL_NSYS", raising=False)
    monkeypatch.setattr(profile, "NSYS_GLOBS", ())
