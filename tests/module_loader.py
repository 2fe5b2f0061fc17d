"""Loading a script that is not part of the package (bench/*.py, another test file) as a module, by path."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_module(name: str, path: Path):
    """`path` executed as module `name` (registered in sys.modules); bench/ and the script's own folder go on
    sys.path first, since the bench scripts import bench/paths.py and their neighbours by bare name."""
    for folder in (BENCH, Path(path).resolve().parent):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
