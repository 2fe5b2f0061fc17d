"""The files of a model directory stay inside it: a model directory is untrusted input.

An index entry such as ``../outside/x.safetensors`` or ``/etc/passwd``, or a symbolic link that points out of the
directory, would make mixq read (and convert, or print) a file the user never gave it. Every file mixq opens for a
model is named relative to the directory and must resolve, after symbolic links, inside the directory's trust
root: the directory itself, or for a Hugging Face hub snapshot (``models--org--name/snapshots/<rev>``) the repo's
cache folder, whose ``blobs/`` the snapshot's links point into.
"""
from __future__ import annotations

import os
from pathlib import Path

from mixq.errors import InputError


def trust_root(model_dir: str | os.PathLike) -> Path:
    """The resolved directory that every file of ``model_dir`` must resolve into."""
    d = Path(model_dir).resolve()
    if d.parent.name == "snapshots" and d.parent.parent.name.startswith(("models--", "datasets--")):
        return d.parent.parent  # a hub snapshot: its files are links into the repo's blobs/
    return d


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def model_file(model_dir: str | os.PathLike, name: object, what: str) -> Path:
    """``model_dir / name`` for a file the model names itself (an index entry, a config key). InputError naming
    ``what`` and the entry when ``name`` is not a non-empty relative path string or resolves outside the
    directory (``..`` components, an absolute path, a symbolic link that leaves it)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise InputError(f"{what}: entry {name!r} is not a file name")
    d = Path(model_dir)
    if Path(name).is_absolute():
        raise InputError(f"{what}: entry {name!r} is an absolute path; files of a model must be inside "
                         f"{d}")
    p = d / name
    if not _inside(p.resolve(), trust_root(d)):
        raise InputError(f"{what}: entry {name!r} resolves outside the model directory {d}")
    return p


def check_model_dir(model_dir: str | os.PathLike) -> Path:
    """InputError naming the entry when a file or folder directly in ``model_dir`` is a symbolic link that
    resolves outside the directory's trust root (then no later read of ``model_dir / NAME`` can leave it).
    Returns ``model_dir``."""
    d = Path(model_dir)
    root = trust_root(d)
    with os.scandir(d) as it:
        for entry in it:
            if entry.is_symlink() and not _inside(Path(entry.path).resolve(), root):
                raise InputError(f"{entry.path}: a symbolic link that points outside the model directory {d} "
                                 f"(to {os.path.realpath(entry.path)})")
    return d
