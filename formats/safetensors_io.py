"""safetensors files through the safetensors library: tensor lists, tensors, metadata, atomic writes.

Every refusal of the library becomes one FormatError naming the file and, when its header lets one be named, the
tensor at fault (the library's own messages name neither). ``ST_DTYPES`` is mixq's one table of safetensors dtype
tags; the EXL3 shard compile (formats/exl3_writer), which streams tensor bytes into its own files, uses it too.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import safetensors  # safe_open and torch.save_file looked up per call (tests wrap them)
import safetensors.torch
import torch

from mixq.errors import FormatError, InputError
from mixq.formats.atomic import atomic_path

# safetensors dtype tag -> torch dtype (the tags mixq reads and writes)
ST_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_TAG_OF = {v: k for k, v in ST_DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


def dtype_tag(dtype: torch.dtype) -> str:
    """The safetensors tag of a torch dtype ("BF16", "I16", ...)."""
    return _TAG_OF[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """torch's spelling without the module: "bfloat16", "int16", ..."""
    return str(dtype).removeprefix("torch.")


def _short(x: Any, n: int = 80) -> str:
    """repr of a header value, cut short (a hostile header can hold megabytes in one entry)."""
    r = repr(x)
    return r if len(r) <= n else r[:n] + "..."


def _is_count(x: Any) -> bool:
    """A JSON non-negative integer (JSON true/false are bools in Python, not counts)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _entry_problem(name: str, meta: Any, data_len: int) -> str | None:
    """What is wrong with one tensor entry of a header whose data section holds ``data_len`` bytes."""
    if not isinstance(meta, dict):
        return f"tensor {_short(name)}: header entry is a {type(meta).__name__}, not an object"
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ST_DTYPES:
        return f"tensor {_short(name)}: unsupported dtype {_short(dtype)}"
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        return f"tensor {_short(name)}: shape {_short(shape)} is not a list of non-negative integers"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(x) for x in offsets)):
        return f"tensor {_short(name)}: data_offsets {_short(offsets)} is not a pair of non-negative integers"
    b, e = offsets
    want = 0 if 0 in shape else ST_DTYPES[dtype].itemsize
    for d in shape if want else ():
        want *= d
        if want > data_len:  # stop before a hostile shape grows a huge integer: it cannot fit anyway
            return (f"tensor {_short(name)}: shape {_short(shape)} needs more than the "
                    f"{data_len}-byte data section")
    if e < b or e - b != want:
        return (f"tensor {_short(name)}: header says {dtype}{_short(shape)} = {want} bytes but data_offsets [{b}, {e}] "
                f"span {e - b}")
    if e > data_len:
        return (f"tensor {_short(name)}: data ends at byte {e} of a {data_len}-byte data section (past the end of the "
                "file: truncated shard)")
    return None


def _header_problem(path: Path) -> str:
    """Why the library refused ``path``, naming the tensor when the header shows one (for the error message)."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return f"not a safetensors file ({size} bytes, no header)"
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            return f"header length {n} exceeds the file size {size} (truncated or not safetensors)"
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: hostile JSON nesting
        return f"corrupt safetensors header ({type(e).__name__}: {str(e)[:200]})"
    if not isinstance(header, dict):
        return f"corrupt safetensors header (a JSON {type(header).__name__}, not an object)"
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        return "__metadata__ is not an object of strings"
    data_len = size - 8 - n
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        why = _entry_problem(name, entry, data_len)
        if why:
            return why
        spans.append((entry["data_offsets"][0], entry["data_offsets"][1], name))
    # the library wants the tensors to tile the data section exactly: no gap, no overlap, nothing after
    at = 0
    for b, e, name in sorted(spans):
        if b != at:
            return f"tensor {_short(name)}: data_offsets start at {b}, expected {at} (a gap or an overlap)"
        at = e
    if at != data_len:
        return f"tensors cover {at} bytes of a {data_len}-byte data section"
    return "the safetensors library refuses it"


@contextmanager
def open_safetensors(path: str | os.PathLike) -> Iterator[Any]:
    """The library's ``safe_open`` handle of ``path``; InputError when it cannot be read, FormatError when the
    library refuses its contents."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: no such safetensors file")
    try:
        handle = safetensors.safe_open(str(p), framework="pt")
    except PermissionError as e:
        raise InputError(f"{p}: cannot read ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - SafetensorError, or OSError for a file shorter than its header says
        try:
            why = _header_problem(p)
        except OSError as err:
            raise InputError(f"{p}: cannot read ({err.strerror or err})") from None
        raise FormatError(f"{p}: {why}") from e
    with handle as h:
        yield h


def tensor_entries(path: str | os.PathLike) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype tag, shape) of every tensor of a safetensors file, in data order."""
    out = []
    with open_safetensors(path) as h:
        for name in h.offset_keys():
            sl = h.get_slice(name)
            tag = sl.get_dtype()
            if tag not in ST_DTYPES:
                raise FormatError(f"{path}: tensor {name!r}: unsupported dtype {tag}")
            out.append((name, tag, tuple(int(d) for d in sl.get_shape())))
    return out


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file ({} when it has none)."""
    with open_safetensors(path) as h:
        return dict(h.metadata() or {})


def load_tensors(path: str | os.PathLike, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file (all, or ``names``), in data order."""
    with open_safetensors(path) as h:
        keys = h.offset_keys() if names is None else names
        missing = [n for n in keys if n not in set(h.offset_keys())]
        if missing:
            raise FormatError(f"{path}: tensor {missing[0]!r} missing")
        return {n: h.get_tensor(n) for n in keys}


def _own_storage(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors that each own their storage (the library refuses tensors sharing memory)."""
    out, seen = {}, set()
    for n, t in tensors.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and (ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        out[n] = t
    return out


def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> str:
    """Write ``tensors`` with the library (temporary name, fsync, rename); returns the file's sha256."""
    with atomic_path(path) as tmp:
        safetensors.torch.save_file(_own_storage(tensors), str(tmp),
                                    metadata={k: str(v) for k, v in (metadata or {}).items()})
    return sha256_file(path)


def sha256_file(path: str | os.PathLike, bufsize: int = 1 << 22) -> str:
    """sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def read_header(path: str | os.PathLike) -> tuple[int, dict]:
    """(0, {name: {"dtype": tag, "shape": [...]}, "__metadata__": {...}}) of a safetensors file: the header as
    the library reports it (the first element is kept for callers that unpack a data offset; it is not one)."""
    header: dict = {n: {"dtype": tag, "shape": list(shape)} for n, tag, shape in tensor_entries(path)}
    meta = read_metadata(path)
    if meta:
        header["__metadata__"] = meta
    return 0, header


def load_tensor(path: str | os.PathLike, name: str, *_unused) -> torch.Tensor:
    """One tensor of a safetensors file."""
    return load_tensors(path, [name])[name]
