"""Checks on the paths a command writes, made before any work: never replace an input or another output, never
silently overwrite, fail in one line on an unwritable place or a full disk instead of after hours of work.

- `check_distinct(outputs, inputs)`: no output is the same file as another output or as an input.
- `check_output_file(path, ...)` / `check_output_dir(path)`: the place can be written (a probe file, so read-only
  mounts and permissions are caught as they really are), OUT is not a directory / its parent not a file, and an
  existing file is refused unless `overwrite`.
- `check_free_space(path, need, what)`: the filesystem holding `path` has room for `need` bytes.
- `writing(*paths)`: turns the OSError of a full disk / read-only filesystem met while writing into one InputError.
- `gguf_partials_lock(out)`: removes the `.NAME.partial-*` directories that killed GGUF runs left next to `out`,
  when no other mixq run is writing in that directory, and holds a shared lock there while this run writes.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

from mixq.errors import InputError

# errors that mean "this place cannot take the output", whatever file they were met on
WRITE_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                errno.EFBIG: "file too large for the filesystem", errno.EROFS: "read-only filesystem",
                errno.EACCES: "permission denied", errno.EPERM: "operation not permitted"}
MARGIN = 1.01  # free-space margin over the estimate (headers, the filesystem's own blocks)


def _key(p: Path) -> tuple:
    """Identity of a path: (device, inode) when it exists, else its absolute normalised form."""
    try:
        st = p.stat()
        return ("inode", st.st_dev, st.st_ino)
    except OSError:
        return ("path", os.path.normcase(os.path.abspath(p)))


def check_distinct(outputs: Mapping[str, str | os.PathLike | None],
                   inputs: Mapping[str, str | os.PathLike | None]) -> None:
    """InputError when an output (label -> path) is the same file as another output or as an input file. A
    directory input (a model) counts with every file in it: an output may not replace one of its files."""
    seen: dict[tuple, str] = {}
    for label, p in inputs.items():
        if p is None:
            continue
        p = Path(p)
        seen.setdefault(_key(p), f"{label} {p}")
        if p.is_dir():
            for f in p.iterdir():
                if f.is_file():
                    seen.setdefault(_key(f), f"{label} file {f}")
    outs: dict[tuple, str] = {}
    for label, p in outputs.items():
        if p is None:
            continue
        k = _key(Path(p))
        if k in outs:
            raise InputError(f"{label} {p} is the same file as {outs[k]}; give each output its own path")
        if k in seen:
            raise InputError(f"{label} {p} is the same file as the input {seen[k]}; writing it would destroy "
                             "the input")
        outs[k] = f"{label} {p}"


def _existing_ancestor(p: Path) -> Path:
    """The nearest existing ancestor of `p` (InputError when a non-directory is in the way)."""
    a = p.parent
    while not a.exists():
        if a == a.parent:
            break
        a = a.parent
    if not a.is_dir():
        raise InputError(f"{p}: {a} is not a directory")
    return a


def _probe_writable(directory: Path, what: Path) -> None:
    """Create and remove a small file in `directory`: the real test of permissions and read-only mounts."""
    try:
        fd, name = tempfile.mkstemp(prefix=".mixq-probe-", dir=directory)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        why = WRITE_ERRNOS.get(e.errno, e.strerror or str(e))
        raise InputError(f"{what}: cannot write in {directory} ({why})") from None


def check_output_file(path: str | os.PathLike, *, overwrite: bool = False, label: str = "OUT",
                      suffix: str | None = None) -> Path:
    """A file output: not a directory, its parent a (creatable) directory that can be written, and no existing
    file unless `overwrite`. `suffix` (e.g. ".gguf") is required when given."""
    p = Path(path)
    if suffix and p.suffix != suffix:
        raise InputError(f"{label} {p}: must end in {suffix}")
    if p.is_dir():
        raise InputError(f"{label} {p} is a directory; give a file path")
    if p.exists() and not overwrite:
        raise InputError(f"{label} {p} already exists; pass --overwrite to replace it")
    _probe_writable(_existing_ancestor(p), p)
    return p


def check_output_dir(path: str | os.PathLike, *, label: str = "OUT") -> Path:
    """A directory output: not a file, and it (or the nearest ancestor it will be created in) can be written."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise InputError(f"{label} {p} exists and is not a directory")
    _probe_writable(p if p.is_dir() else _existing_ancestor(p), p)
    return p


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes of the filesystem that holds `path` (or would hold it, once created)."""
    p = Path(path)
    return shutil.disk_usage(p if p.is_dir() else _existing_ancestor(p)).free


def check_free_space(path: str | os.PathLike, need: int, what: str) -> None:
    """InputError when the filesystem that will hold `path` has less than `need` bytes (plus 1%) free."""
    free = free_bytes(path)
    if free < need * MARGIN:
        raise InputError(f"{path}: not enough disk space for {what}: need {need / 2**20:,.1f} MiB, "
                         f"{free / 2**20:,.1f} MiB free")


# met only when writing; the others (permissions, read-only) count only on a path inside an output's directory
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _inside(filename, paths) -> bool:
    f = os.path.abspath(filename)
    for p in paths:
        a = os.path.abspath(p)
        if f == a or f.startswith(os.path.dirname(a) + os.sep) or f.startswith(a + os.sep):
            return True
    return False


@contextmanager
def writing(*paths: str | os.PathLike, hint: str = "") -> Iterator[None]:
    """Turn an OSError of a full disk, a quota, a read-only filesystem or a permission met while writing
    `paths` into one InputError naming the first path (the writer removes its partial output)."""
    try:
        yield
    except OSError as e:
        if e.errno not in WRITE_ERRNOS:
            raise
        if e.errno not in _SPACE_ERRNOS and e.filename is not None and not _inside(e.filename, paths):
            raise  # e.g. an unreadable input met during the write loop: not an output problem
        target = paths[0] if paths else (e.filename or "output")
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(target) else ""
        raise InputError(f"{target}: {WRITE_ERRNOS[e.errno]} while writing{where}"
                         + (f"; {hint}" if hint else "")) from None


def _flock(fd: int, mode: int) -> bool:
    import fcntl

    try:
        fcntl.flock(fd, mode)
        return True
    except BlockingIOError:
        return False


@contextmanager
def gguf_partials_lock(*outs: str | os.PathLike | None) -> Iterator[list[Path]]:
    """Remove stale `.NAME.partial-*` directories of the GGUF outputs `outs` and hold a shared lock on their
    directories while the caller writes. Yields the removed paths.

    A run holds a shared flock on the output's directory while it writes there, so an exclusive flock that
    succeeds proves no mixq run is writing in it: the partials there are then leftovers of killed runs. The lock
    goes with the process (kill -9 included), so a dead run never blocks a later one."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no cleanup, no lock
        yield []
        return
    removed: list[Path] = []
    by_dir: dict[Path, list[Path]] = {}
    for out in (Path(o) for o in outs if o is not None):
        by_dir.setdefault(out.parent, []).append(out)
    fds: list[int] = []
    try:
        for d, names in by_dir.items():
            if not d.is_dir():
                continue
            fd = os.open(d, os.O_RDONLY)
            fds.append(fd)
            if _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB):  # nobody else writes here: the partials are stale
                for out in names:
                    for stale in d.glob(f".{out.stem}.partial-*"):
                        if stale.is_dir():
                            shutil.rmtree(stale, ignore_errors=True)
                            removed.append(stale)
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield removed
    finally:
        for fd in fds:
            os.close(fd)  # releases the lock
