"""Partial output directories: the temporary folders a GGUF run fills next to its output, and how they are
published.

Each one is made by `make_partial_dir` and carries a mark file, so the cleanup of a killed run's leftovers
(`is_partial_dir`) removes only folders mixq made, never a user's folder that merely has a similar name.
`publish` moves finished files to their final names without replacing a file that appeared meanwhile (another
run writing the same OUT) unless the caller was told to overwrite.
"""
from __future__ import annotations

import errno
import os
import re
import tempfile
from pathlib import Path

from mixq.errors import InputError

MARK = ".mixq-partial"
MARK_TEXT = "a partial mixq output: removed when the run that made it ends, or by a later run of the same OUT\n"
_SUFFIX = re.compile(r"[A-Za-z0-9_]{8}")  # what tempfile.mkdtemp appends


def partial_prefix(out: str | os.PathLike, kind: str = "") -> str:
    """The name prefix of the partial directories of `out` (`.NAME.partial-` or `.NAME.partial-KIND-`)."""
    return f".{Path(out).stem}.partial-" + (f"{kind}-" if kind else "")


def make_partial_dir(out: str | os.PathLike, kind: str = "") -> Path:
    """A new, marked temporary directory next to `out` (its parent is created when missing)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix=partial_prefix(out, kind), dir=out.parent))
    (d / MARK).write_text(MARK_TEXT, encoding="utf-8")
    return d


def is_partial_dir(d: str | os.PathLike, out: str | os.PathLike) -> bool:
    """True when `d` is a partial directory mixq made for `out`: the name pattern and the mark file."""
    d = Path(d)
    prefix = partial_prefix(out)
    if not d.name.startswith(prefix) or d.is_symlink() or not d.is_dir():
        return False
    rest = d.name[len(prefix):]
    if not _SUFFIX.fullmatch(rest.rsplit("-", 1)[-1]):
        return False
    mark = d / MARK
    try:
        return not mark.is_symlink() and mark.read_text(encoding="utf-8") == MARK_TEXT
    except (OSError, UnicodeDecodeError):
        return False


def publish(pairs: list[tuple[Path, Path]], *, overwrite: bool) -> None:
    """Rename each finished (temporary, final) pair. Without `overwrite` a final name that exists now (another
    run published it meanwhile) is never replaced: InputError naming it, and the files this call already
    published are taken back."""
    if overwrite:
        for tmp, final in pairs:
            os.replace(tmp, final)
        return
    done: list[Path] = []
    try:
        for tmp, final in pairs:
            _link_new(tmp, final)
            done.append(final)
    except BaseException:
        for final in done:
            final.unlink(missing_ok=True)
        raise
    for tmp, _ in pairs:
        tmp.unlink(missing_ok=True)


def _link_new(tmp: Path, final: Path) -> None:
    """Give `tmp` the name `final` only if no file has it (a hard link is created atomically or not at all)."""
    try:
        os.link(tmp, final)
    except FileExistsError:
        raise InputError(f"OUT {final} was written by another run while this one worked; nothing was replaced "
                         "(pass --overwrite to replace it)") from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        if final.exists():  # a filesystem without hard links: the check and the rename are not one step
            raise InputError(f"OUT {final} was written by another run while this one worked; nothing was "
                             "replaced (pass --overwrite to replace it)") from None
        os.replace(tmp, final)
