"""CLI helpers shared by the test modules (tests/ is on pytest's pythonpath: `from cli_helpers import ...`)."""
from __future__ import annotations

import shutil
from pathlib import Path

from click.testing import CliRunner

from mixq.cli import main


def run_cli(*args):
    """`mixq ARGS...` in this process (click's runner); arguments may be paths."""
    return CliRunner().invoke(main, [str(a) for a in args])


def error_line(r) -> str:
    """The single `mixq: error:` line of a run that must exit 2 (no traceback)."""
    assert r.exit_code == 2, r.output[-2000:]
    assert "Traceback" not in r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("mixq: error")]
    assert len(lines) == 1, r.stderr[-2000:]
    return lines[0]


def copy_model(src: Path, dst: Path) -> Path:
    """A writable copy of a model directory (the shared fixtures are read-only) to corrupt or edit."""
    shutil.copytree(src, dst)
    for p in [dst, *dst.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dst
