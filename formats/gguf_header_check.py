"""Bounds check of a GGUF header before gguf-py's GGUFReader is handed the file, and the one checked opener.

gguf-py trusts every count in the header: an array KV claiming 2**62 items makes it loop (and allocate) for as
long as the claim says, and a tensor with a zero or negative dimension, an unknown type or data past the end of
the file comes back as a tensor or as an arbitrary exception. `check_gguf_header(path)` walks the header once in
pure Python and bounds every count, length, dimension and offset by the file's size, so that each of these ends
in one FormatError naming the file and the key or tensor; `open_gguf_reader(path)` runs it, then gguf-py.

Layout (../shared/reference/gguf-facts.md §1.1): magic, version (2 or 3; a whole file may be big endian),
tensor count u64, KV count u64; KVs (key string, value type u32, value; arrays: item type u32, count u64, items);
tensor infos (name string of at most 63 bytes, n_dims u32, n_dims × ne u64 with ne[0] first, ggml type u32, data
offset u64); zero padding to the alignment; the data section, where the tensors lie in the order of their infos,
contiguous: each offset is the sum of the sizes, padded to the alignment, of the tensors before it, and the file
holds the last one's padding too.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gguf import GGUF_DEFAULT_ALIGNMENT, GGUFReader, GGUFValueType

from mixq.errors import FormatError, InputError
from mixq.formats import gguf_layout

GGML_MAX_DIMS = 4
GGML_MAX_NAME = 63  # bytes of a tensor name (llama.cpp refuses 64 or more)
INT64_MAX = 2**63 - 1
_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # the versions gguf-py (and llama.cpp) read
_ALIGNMENT_KEY = "general.alignment"

# fixed byte size of every scalar value type
_SCALAR_SIZE: dict[int, int] = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}
_STRING_MIN = 8   # a string is at least its u64 length
_KV_MIN = 8 + 4 + 1  # key length, value type, the smallest value
_TENSOR_INFO_MIN = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset


@dataclass(frozen=True)
class GGUFHeaderSummary:
    """What the check established: the header's own sizes (for callers and tests)."""

    version: int
    big_endian: bool
    n_kv: int
    n_tensors: int
    alignment: int
    data_offset: int  # start of the data section (absolute)
    file_size: int


def _q(name: str, n: int = 80) -> str:
    """repr of a key or tensor name for a message, cut short (a hostile name may be megabytes long)."""
    r = repr(name)
    return r if len(r) <= n else r[:n] + "...'"


def _type_name(code: int) -> str:
    try:
        return GGUFValueType(code).name
    except ValueError:
        return str(code)


class _Scanner:
    """Reads the header fields of a memory-mapped file, each read bounded by the bytes left."""

    def __init__(self, path: Path, buf: bytes | mmap.mmap, size: int) -> None:
        self.path, self.buf, self.size = path, buf, size
        self.pos = 0
        self.order = "<"

    def fail(self, msg: str) -> FormatError:
        return FormatError(f"{self.path}: {msg}")

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.left():
            raise self.fail(f"{what} at byte {self.pos} needs {n} bytes, only {self.left()} left in the "
                            f"{self.size}-byte file (truncated or corrupt GGUF)")

    def unpack(self, fmt: str, what: str) -> int:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.unpack("I", what)

    def u64(self, what: str) -> int:
        return self.unpack("Q", what)

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n

    def string(self, what: str) -> str:
        """A GGUF string: u64 length, then that many UTF-8 bytes (gguf-py decodes them strictly later)."""
        n = self.u64(f"{what} length")
        if n > self.left():
            raise self.fail(f"{what}: string length {n} at byte {self.pos - 8} runs past the end of the "
                            f"{self.size}-byte file")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what}: string at byte {self.pos - n} is not UTF-8") from None


def _scan_value(sc: _Scanner, vtype: int, key: str) -> int | str | None:
    """Skip one KV value of type `vtype`; returns a u32 value (for general.alignment) or None."""
    size = _SCALAR_SIZE.get(vtype)
    if size is not None:
        if vtype == GGUFValueType.UINT32:
            return sc.u32(f"key {_q(key)}: value")
        sc.skip(size, f"key {_q(key)}: {_type_name(vtype)} value")
        return None
    if vtype == GGUFValueType.STRING:
        sc.string(f"key {_q(key)}: value")
        return None
    if vtype == GGUFValueType.ARRAY:
        itype = sc.u32(f"key {_q(key)}: array item type")
        count = sc.u64(f"key {_q(key)}: array count")
        if itype == GGUFValueType.ARRAY:
            # llama.cpp reads no nested arrays, and gguf-py would recurse once per level
            raise sc.fail(f"key {_q(key)}: array of arrays (not a GGUF value llama.cpp reads)")
        isize = _SCALAR_SIZE.get(itype)
        if isize is None and itype != GGUFValueType.STRING:
            raise sc.fail(f"key {_q(key)}: unknown array item type {itype}")
        least = isize if isize is not None else _STRING_MIN
        if count > sc.left() // least:
            raise sc.fail(f"key {_q(key)}: array of {count} {_type_name(itype)} items cannot fit in the "
                          f"{sc.left()} bytes left of the {sc.size}-byte file")
        if isize is not None:
            sc.skip(count * isize, f"key {_q(key)}: array items")
        else:
            for i in range(count):
                sc.string(f"key {_q(key)}: item {i}")
        return None
    raise sc.fail(f"key {_q(key)}: unknown value type {vtype}")


def _scan_tensor_info(sc: _Scanner, index: int) -> tuple[str, int, int]:
    """One tensor info; returns (name, data bytes, offset relative to the data section)."""
    name = sc.string(f"tensor info {index}: name")
    label = f"tensor {_q(name)}"
    if len(name.encode("utf-8")) > GGML_MAX_NAME:
        raise sc.fail(f"{label}: name of {len(name.encode('utf-8'))} bytes (at most {GGML_MAX_NAME} allowed)")
    n_dims = sc.u32(f"{label}: n_dims")
    if not 1 <= n_dims <= GGML_MAX_DIMS:
        raise sc.fail(f"{label}: {n_dims} dimensions (1 to {GGML_MAX_DIMS} allowed)")
    dims = [sc.u64(f"{label}: dimension {d}") for d in range(n_dims)]
    for d, ne in enumerate(dims):
        if ne > INT64_MAX:
            raise sc.fail(f"{label}: dimension {d} is {ne - 2**64} (negative as int64)")
        if ne == 0:
            raise sc.fail(f"{label}: dimension {d} is 0 (empty tensors are refused)")
    n_elems = 1
    for ne in dims:
        n_elems *= ne
        if n_elems > INT64_MAX:
            raise sc.fail(f"{label}: shape {dims} has more than 2**63-1 elements (overflows int64)")
    raw_type = sc.u32(f"{label}: type")
    try:
        qtype = gguf_layout.type_name(raw_type)
        block = gguf_layout.block_weights(qtype)
    except (FormatError, KeyError):
        raise sc.fail(f"{label}: unknown ggml type id {raw_type}") from None
    if dims[0] % block:
        raise sc.fail(f"{label}: row length {dims[0]} is not a multiple of {qtype}'s block of {block}")
    n_bytes = gguf_layout.tensor_bytes(qtype, dims[::-1])
    offset = sc.u64(f"{label}: data offset")
    return name, n_bytes, offset


def check_gguf_header(path: str | os.PathLike) -> GGUFHeaderSummary:
    """Walk the header of the GGUF at `path` and bound everything in it by the file's size: FormatError naming
    the file and the key or tensor at fault; InputError when the file cannot be read."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 4 + 4 + 8 + 8:
                raise FormatError(f"{p}: not a GGUF file ({size} bytes, shorter than a GGUF header)")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _check(p, buf, size)
    except OSError as e:
        raise InputError(f"{p}: cannot read ({e.strerror or e})") from None


def _check(p: Path, buf: mmap.mmap, size: int) -> GGUFHeaderSummary:
    sc = _Scanner(p, buf, size)
    if bytes(buf[0:4]) != _MAGIC:
        raise sc.fail(f"not a GGUF file (magic {bytes(buf[0:4])!r}, expected {_MAGIC!r})")
    sc.pos = 4
    version = sc.u32("version")
    if version & 0xFFFF == 0:  # as gguf-py decides: a version with empty low bytes means a big-endian file
        sc.order = ">"
        version = struct.unpack("<I", struct.pack(">I", version))[0]
    if version not in _VERSIONS:
        raise sc.fail(f"GGUF version {version} (readable: {', '.join(map(str, _VERSIONS))})")
    n_tensors = sc.u64("tensor count")
    n_kv = sc.u64("KV count")
    if n_kv > sc.left() // _KV_MIN:
        raise sc.fail(f"KV count {n_kv} cannot fit in the {sc.left()} bytes left of the {size}-byte file")
    if n_tensors > sc.left() // _TENSOR_INFO_MIN:
        raise sc.fail(f"tensor count {n_tensors} cannot fit in the {sc.left()} bytes left of the {size}-byte file")
    alignment = GGUF_DEFAULT_ALIGNMENT
    keys: set[str] = set()
    for i in range(n_kv):
        key = sc.string(f"KV {i}: key")
        if key in keys:
            raise sc.fail(f"key {_q(key)} appears twice")
        keys.add(key)
        vtype = sc.u32(f"key {_q(key)}: value type")
        value = _scan_value(sc, vtype, key)
        if key == _ALIGNMENT_KEY:
            if vtype != GGUFValueType.UINT32:
                raise sc.fail(f"key {_q(key)}: type {_type_name(vtype)}, must be UINT32")
            value = int(value or 0)
            if value == 0 or value & (value - 1):
                raise sc.fail(f"key {_q(key)}: {value} is not a power of two")
            alignment = value
    if n_tensors > sc.left() // _TENSOR_INFO_MIN:
        raise sc.fail(f"tensor count {n_tensors} cannot fit in the {sc.left()} bytes left after the KVs")
    infos: list[tuple[str, int, int]] = []
    names: set[str] = set()
    for i in range(n_tensors):
        info = _scan_tensor_info(sc, i)
        if info[0] in names:
            raise sc.fail(f"tensor {_q(info[0])} appears twice")
        names.add(info[0])
        infos.append(info)
    data_offset = -(-sc.pos // alignment) * alignment
    sc.need(data_offset - sc.pos, "padding before the data section")
    if any(bytes(buf[sc.pos:data_offset])):
        raise sc.fail(f"padding [{sc.pos}, {data_offset}) before the data section is not zero (a tensor count "
                      "or the header's end is wrong)")
    expected = 0  # the tensors lie in the order of their infos, each padded to the alignment
    for name, n_bytes, offset in infos:
        if offset != expected:
            raise sc.fail(f"tensor {_q(name)}: data offset {offset}, expected {expected} (the tensors before it "
                          f"end there, padded to the alignment {alignment})")
        # Python integers do not wrap: a size near 2**64 is caught here, not folded back into the file
        start, expected = data_offset + offset, offset + -(-n_bytes // alignment) * alignment
        if data_offset + expected > size:
            raise sc.fail(f"tensor {_q(name)}: data [{start}, {start + n_bytes}) and its padding run past the end "
                          f"of the {size}-byte file (truncated or corrupt GGUF)")
    return GGUFHeaderSummary(version, sc.order == ">", n_kv, n_tensors, alignment, data_offset, size)


def open_gguf_reader(path: str | os.PathLike, mode: Literal["r", "r+", "c"] = "r") -> GGUFReader:
    """gguf-py's GGUFReader of `path` once `check_gguf_header` passed: InputError for a missing file,
    FormatError (one line naming the file) for anything gguf-py still refuses."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: no such GGUF file")
    check_gguf_header(p)
    try:
        return GGUFReader(p, mode)
    except Exception as e:  # noqa: BLE001 - any parse failure left means a malformed file
        raise FormatError(f"{p}: not a readable GGUF file ({type(e).__name__}: {e})") from e
