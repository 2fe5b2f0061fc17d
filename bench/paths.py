"""Where the bench scripts find their inputs, and how they record paths: relative to the repo root.

``SHARED``: the fixtures (``$MIXQ_SHARED``, else ``../shared`` next to the repo, else ``shared/`` inside it, as a
copy of the repo sent to a GPU machine holds them). ``WORK``: quantized files and reference logits, outside the repo
(``$MIXQ_BENCH_WORK``, else ``../bench-work``). ``VENDOR``: llama.cpp sources and tool builds (``$MIXQ_VENDOR``,
else ``../vendor``). Results written under bench/results go through ``repo_relative``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MIXQ_SHARED") or next(
    (p for p in (REPO.parent / "shared", REPO / "shared") if (p / "models").is_dir()), REPO.parent / "shared"))
WORK = Path(os.environ.get("MIXQ_BENCH_WORK") or REPO.parent / "bench-work")
VENDOR = Path(os.environ.get("MIXQ_VENDOR") or REPO.parent / "vendor")


def repo_relative(obj: Any) -> Any:
    """``obj`` (a JSON-like value) with every absolute path string rewritten relative to the repo root."""
    if isinstance(obj, dict):
        return {k: repo_relative(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [repo_relative(v) for v in obj]
    if isinstance(obj, Path) or (isinstance(obj, str) and os.path.isabs(obj) and "\n" not in obj):
        return os.path.relpath(obj, REPO) if os.path.isabs(obj) else str(obj)
    return obj
