"""The one hook through which the readers and writers report the bytes they move, for `--profile`.

The checkpoint reader calls `count_read` once per tensor it reads, the EXL3 shard compiler once per part tensor
it copies; `formats/atomic.py` calls `count_file_written` once per file it renames into place and the GGUF writer
once per file it publishes. Nothing is counted unless a recorder installed a sink (`set_sink`, done by
`runtime/profile.py`); without one each call is a single comparison with None.
"""
from __future__ import annotations

import os
from typing import Callable

Sink = Callable[[str, int], None]
_sink: Sink | None = None


def set_sink(sink: Sink | None) -> Sink | None:
    """Install `sink(kind, nbytes)` (kind "read" or "written"; None: count nothing); returns the previous one."""
    global _sink
    old, _sink = _sink, sink
    return old


def count_read(nbytes: int) -> None:
    """`nbytes` read from an input file."""
    s = _sink
    if s is not None:
        s("read", int(nbytes))


def count_written(nbytes: int) -> None:
    """`nbytes` written to a file."""
    s = _sink
    if s is not None:
        s("written", int(nbytes))


def count_file_written(path: str | os.PathLike) -> None:
    """A file written whole (its size on disk, read only when a sink listens)."""
    s = _sink
    if s is not None:
        s("written", os.path.getsize(path))
