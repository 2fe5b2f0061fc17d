"""Atomic output files: write under a temporary name next to the target, flush to disk, rename at the end.

A reader never sees a half-written file under the final name, and a failed write leaves no temporary behind.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator

from mixq.formats.io_counts import count_file_written


def temp_path(path: str | os.PathLike) -> Path:
    """The temporary name a file is written under before it is renamed to ``path``."""
    p = Path(path)
    return p.with_name(p.name + ".tmp")


def _remove_quietly(tmp: Path) -> None:
    """Remove a temporary file after a failed write; never raise over the error that ended the write (its folder
    may be gone or replaced by a file, the filesystem read-only)."""
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield the temporary path to write ``path`` through (any writer: numpy, matplotlib, a library); on success
    it is synced and renamed to ``path``, on an exception removed."""
    final = Path(path)
    tmp = temp_path(final)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        count_file_written(tmp)
        os.replace(tmp, final)
    except BaseException:
        _remove_quietly(tmp)
        raise


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", encoding: str | None = None) -> Iterator[IO]:
    """``open(path, mode)`` through a temporary name: renamed to ``path`` when the block ends without error."""
    if "w" not in mode:
        raise ValueError(f"atomic_open writes files; mode {mode!r}")
    with atomic_path(path) as tmp:
        with open(tmp, mode, encoding=encoding if "b" not in mode else None) as f:
            yield f
            f.flush()


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(text)


def json_bytes(obj: Any, *, indent: int | None = 2, newline: bool = True) -> bytes:
    """The bytes `write_json` writes for ``obj``: ``json.dumps(obj, indent=indent)``, a final newline, UTF-8 (so a
    file can be hashed before it is written)."""
    return (json.dumps(obj, indent=indent) + ("\n" if newline else "")).encode("utf-8")


def write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2, newline: bool = True) -> None:
    """Write ``obj`` as JSON (``json_bytes``) to ``path`` atomically."""
    write_bytes(path, json_bytes(obj, indent=indent, newline=newline))


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory next to ``path`` to fill; on success it is renamed to ``path`` (which may
    exist only as an empty directory), on an exception removed with its contents."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            final.rmdir()
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
