"""Loading a script that is not part of the package (bench/*.py, another test file) as a module, by path."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_module(name: str, path: Path):
    """`path` executed as module `name` (registered in sys.modules); bench/ goes on sys.path first, since the
    bench scripts import each other by bare name."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
