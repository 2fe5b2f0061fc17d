"""Checks on the paths a command writes, made before any work: never replace an input or another output, never
silently overwrite, fail in one line on an unwritable place or a full disk instead of after hours of work.

- `check_distinct(outputs, inputs)`: no output is the same file as another output or as an input.
- `check_outputs(outputs, inputs, overwrite=...)`: both of the above for every file a command writes.
- `check_output_file(path, ...)` / `check_output_dir(path)`: the place can be written (a probe file, so read-only
  mounts and permissions are caught as they really are), OUT is not a directory / its parent not a file, no part
  of its path is longer than the filesystem allows, and an existing file is refused unless `overwrite`.
- `check_free_space(path, need, what)`: the filesystem holding `path` has room for `need` bytes.
- `writing(*paths)`: turns the OSError of a full disk / read-only filesystem met while writing, or of the output's
  directory vanishing mid-run, into one InputError.
- `gguf_partials_lock(out)`: removes the `.NAME.partial-*` directories that killed GGUF runs left next to `out`,
  when no other mixq run is writing in that directory, and holds a shared lock there while this run writes.
"""
from __future__ import annotations

import errno
import glob
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

try:
    import fcntl
except ImportError:  # not POSIX: no cleanup, no lock
    fcntl = None

from mixq.errors import InputError
from mixq.formats.partials import is_partial_dir, partial_prefix

# errors that mean "this place cannot take the output", whatever file they were met on
WRITE_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                errno.EFBIG: "file too large for the filesystem", errno.EROFS: "read-only filesystem",
                errno.EACCES: "permission denied", errno.EPERM: "operation not permitted"}
MARGIN = 1.01  # free-space margin over the estimate (headers, the filesystem's own blocks)
# bytes the writers add to OUT's name for their temporary and split names (the longest:
# `.STEM.partial-hessian-XXXXXXXX`, 21 bytes over NAME.gguf), so that a name refused late is refused here
NAME_ROOM = 24


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


def check_outputs(outputs: Mapping[str, str | os.PathLike | None], inputs: Mapping[str, str | os.PathLike | None],
                  *, overwrite: bool = False) -> None:
    """The one check of the files a command writes (label -> path; None = not asked for): none is the same file
    as another output or as an input (a directory input counts with every file in it), each can be written,
    and an existing file is refused unless `overwrite`."""
    check_distinct(outputs, inputs)
    for label, p in outputs.items():
        if p is not None:
            check_output_file(p, overwrite=overwrite, label=label)


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


def _name_limits(p: Path) -> tuple[int, int]:
    """(longest file name, longest path) in bytes on the filesystem of `p`'s nearest existing ancestor."""
    for a in (p, *p.parents):
        try:
            return os.pathconf(a, "PC_NAME_MAX"), os.pathconf(a, "PC_PATH_MAX")
        except (OSError, ValueError):  # not there (yet), itself too long, or no such limit on this system
            continue
    return 255, 4096


def _check_name_length(p: Path, label: str) -> None:
    """InputError naming the output when a part of its path is longer than the filesystem allows (ENAMETOOLONG),
    OUT's own name with room for the temporary and split names written next to it."""
    name_max, path_max = _name_limits(p)
    parts = p.parts
    for i, part in enumerate(parts):
        room = NAME_ROOM if i == len(parts) - 1 else 0
        n = len(os.fsencode(part))
        if n + room > name_max:
            what = "its name" if room else f"the folder name {part[:32]}..."
            raise InputError(f"{label} {p}: {what} is {n} bytes long; this filesystem allows {name_max}"
                             + (f", less {room} for the temporary names written next to it" if room else ""))
    n = len(os.fsencode(str(p)))
    if n + NAME_ROOM > path_max:
        raise InputError(f"{label} {p}: the path is {n} bytes long; this filesystem allows {path_max}, less "
                         f"{NAME_ROOM} for the temporary names written next to it")


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
    _check_name_length(p, label)
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
    _check_name_length(p, label)
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


# a file or directory of the output gone mid-run (its folder or the temporary one deleted, a parent replaced)
_GONE_ERRNOS = {errno.ENOENT: "no such file or directory", errno.ENOTDIR: "not a directory"}


# how Rust libraries (safetensors) word an I/O error: "... (os error 28) at path \"/x/.tmpAbc\""
_RUST_IO_ERROR = re.compile(r"\(os error (\d+)\)(?: at path \"([^\"]*)\")?")


# a write that stopped short without an errno: numpy's tofile / np.save ("52224 requested and 3136 written", from
# fwrite) and Rust's write_all ("failed to write whole buffer"); on a local disk that is a full filesystem
_SHORT_WRITE = re.compile(r"^(\d+) requested and (\d+) written$|failed to write whole buffer")


class ShortWrite(OSError):
    """ENOSPC standing for a write that stopped short without an errno; `detail` says how short."""

    def __init__(self, detail: str) -> None:
        super().__init__(errno.ENOSPC, "No space left on device")
        self.detail = detail


def short_write(e: BaseException) -> ShortWrite | None:
    """`e` as a ShortWrite when it reports a write that stopped short without an errno, else None."""
    if isinstance(e, ShortWrite):
        return e
    if isinstance(e, OSError) and e.errno:  # the OS said why: handled by its errno
        return None
    m = _SHORT_WRITE.search(str(e))
    if m is None:
        return None
    return ShortWrite(f"a write stopped short: {m.group(2)} of {m.group(1)} bytes written" if m.group(1)
                      else "a write stopped short")


def _as_os_error(e: Exception) -> OSError | None:
    """The OSError behind `e`: itself, the one a library reported in its own exception type's message, or a
    ShortWrite (ENOSPC) for a write that stopped short without saying why."""
    short = short_write(e)
    if short is not None:
        return short
    if isinstance(e, OSError):
        return e
    if isinstance(e, InputError):  # already one line of ours
        return None
    m = _RUST_IO_ERROR.search(str(e))
    if m is None:
        return None
    code = int(m.group(1))
    return OSError(code, os.strerror(code), m.group(2))


def _write_error(e: OSError, paths: tuple, hint: str) -> InputError | None:
    """The one-line InputError for an OSError met while writing `paths`; None when it is not an output problem."""
    gone = e.errno in _GONE_ERRNOS
    if e.errno not in WRITE_ERRNOS and not gone:
        return None
    if gone and e.filename is None:
        return None  # no path to name: not known to be the output's
    if e.errno not in _SPACE_ERRNOS and e.filename is not None and not _inside(e.filename, paths):
        return None  # e.g. an unreadable input met during the write loop: not an output problem
    target = paths[0] if paths else (e.filename or "output")
    where = f" ({e.filename})" if e.filename and str(e.filename) != str(target) else ""
    if gone:
        return InputError(f"{target}: {_GONE_ERRNOS[e.errno]} while writing{where}; was it or its directory "
                          "removed during the run?")
    where += f" ({e.detail})" if isinstance(e, ShortWrite) else ""
    return InputError(f"{target}: {WRITE_ERRNOS[e.errno]} while writing{where}" + (f"; {hint}" if hint else ""))


@contextmanager
def writing(*paths: str | os.PathLike, hint: str = "") -> Iterator[None]:
    """Turn an OSError of a full disk, a quota, a read-only filesystem or a permission met while writing
    `paths`, or of a file or directory of theirs that vanished mid-run, into one InputError naming the first
    path (the writer removes its partial output); also when a library reports the OSError in its own exception
    (safetensors). `hint` (what to do next) follows all but the vanished case."""
    try:
        yield
    except Exception as e:
        os_error = _as_os_error(e)
        err = None if os_error is None else _write_error(os_error, paths, hint)
        if err is None:
            raise
        raise err from None


def _flock(fd: int, mode: int) -> bool:
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
    if fcntl is None:  # not POSIX: no cleanup, no lock
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
                    for stale in d.glob(glob.escape(partial_prefix(out)) + "*"):
                        if is_partial_dir(stale, out):  # a folder mixq made, never a user's look-alike
                            shutil.rmtree(stale, ignore_errors=True)
                            removed.append(stale)
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield removed
    finally:
        for fd in fds:
            os.close(fd)  # releases the lock
