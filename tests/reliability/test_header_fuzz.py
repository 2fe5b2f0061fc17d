"""Hostile GGUF and safetensors headers: adversarial and random counts, lengths, dims, types and offsets.

Every case must end, within a time bound, in a FormatError naming the file where the mutated file is invalid by
its spec, and in a clean read where it is still valid: never another exception, never a hang, never an allocation
the size of a claimed count. Which files are valid is decided here, by a reading of the specs written for these
tests (`gguf_spec_problem`, `safetensors_spec_problem`: ../shared/reference/gguf-facts.md §1.1 and §5.2, the
safetensors format), never by asking the readers under test; the mutations whose outcome follows from their kind
alone (a count of 2**62, a zero or negative dimension, ...) are checked against that reading too. The seeds are
fixed, so the default suite runs the same ~370 cases every time (about a second); set MIXQ_FUZZ_SCALE=10 for a
longer run with more random cases.
"""
from __future__ import annotations

import json
import math
import os
import random
import signal
import struct
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import gguf
import numpy as np
import pytest
import torch
from cli_helpers import error_line, run_cli
from safetensors.torch import save_file

from mixq.errors import FormatError
from mixq.formats.gguf_header_check import open_gguf_reader
from mixq.formats.gguf_inspect import inspect_gguf
from mixq.formats.gguf_reader import read_gguf, verify_gguf
from mixq.formats.imatrix_file import IMatrix, read_imatrix, write_imatrix
from mixq.formats.safetensors_io import load_tensors, read_header, read_metadata, tensor_entries

CASE_SECONDS = 5.0  # per case: ~1000x what a case takes, so only a loop over a claimed count can exceed it
SCALE = max(1, int(os.environ.get("MIXQ_FUZZ_SCALE", "1")))
U64 = (0, 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1)


@dataclass
class Case:
    name: str
    data: bytes
    must_fail: bool = False  # invalid by the mutation's kind alone (the spec reading must agree)
    names: str = ""          # a fragment the error line must contain (the key or tensor)


# --- the specs, read for these tests ----------------------------------------------------------------------------
# GGUF value types (gguf-facts §1.1): the fixed-size scalars and their byte widths; STRING and ARRAY
_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_UINT32, _GGUF_STRING, _GGUF_ARRAY, _GGUF_F32 = 4, 8, 9, 0
_GGUF_NAME_MAX = 63     # tensor names of 64 bytes or more are refused (GGML_MAX_NAME)
_INT64_MAX = 2**63 - 1


class _Bad(Exception):
    """A spec violation found by the spec readings below."""


def gguf_spec_problem(data: bytes, imatrix: bool = False) -> str | None:
    """Why `data` is not a GGUF file by gguf-facts §1.1 (with `imatrix`: nor an imatrix file by §5.2), or None.

    The ggml type table (block size and bytes per block) is gguf-py's GGML_QUANT_SIZES. One rule is stricter than
    llama.cpp: a dimension of 0 (an empty tensor) counts as invalid, as mixq refuses empty tensors."""
    pos = 0
    order = "<"

    def take(n: int) -> bytes:
        nonlocal pos
        if n > len(data) - pos:
            raise _Bad(f"{n} bytes wanted at {pos}, past the end")
        pos += n
        return data[pos - n:pos]

    def num(fmt: str) -> int:
        return struct.unpack(order + fmt, take(struct.calcsize(fmt)))[0]

    def text() -> str:
        try:
            return take(num("Q")).decode("utf-8")
        except UnicodeDecodeError:
            raise _Bad("a string is not UTF-8") from None

    try:
        if take(4) != b"GGUF":
            raise _Bad("magic")
        version = num("I")
        if version & 0xFFFF == 0:  # the whole file is big endian
            order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in (2, 3):
            raise _Bad(f"version {version}")
        n_tensors, n_kv = num("Q"), num("Q")
        if n_tensors > _INT64_MAX or n_kv > _INT64_MAX:
            raise _Bad("a count is negative as int64")
        kv: dict[str, tuple[int, object]] = {}
        alignment = 32
        for _ in range(n_kv):
            key = text()
            if key in kv:
                raise _Bad(f"key {key} twice")
            vtype = num("I")
            if vtype in _GGUF_SCALAR:
                raw = take(_GGUF_SCALAR[vtype])
                value: object = int.from_bytes(raw, "little" if order == "<" else "big")
            elif vtype == _GGUF_STRING:
                value = text()
            elif vtype == _GGUF_ARRAY:
                itype, count = num("I"), num("Q")
                if itype == _GGUF_ARRAY or (itype not in _GGUF_SCALAR and itype != _GGUF_STRING):
                    raise _Bad(f"array item type {itype}")
                if count > len(data):  # every item takes at least one byte
                    raise _Bad(f"array of {count}")
                if itype == _GGUF_STRING:
                    value = [text() for _ in range(count)]
                else:
                    take(count * _GGUF_SCALAR[itype])
                    value = None
                vtype = (_GGUF_ARRAY, itype)
            else:
                raise _Bad(f"value type {vtype}")
            kv[key] = (vtype, value)
            if key == "general.alignment":
                if vtype != _GGUF_UINT32 or value == 0 or value & (value - 1):
                    raise _Bad("alignment")
                alignment = value
        infos = []
        for _ in range(n_tensors):
            name = text()
            if len(name.encode()) > _GGUF_NAME_MAX or name in {i[0] for i in infos}:
                raise _Bad(f"tensor name {name[:70]!r}")
            n_dims = num("I")
            if not 1 <= n_dims <= 4:
                raise _Bad(f"n_dims {n_dims}")
            ne = [num("q") for _ in range(n_dims)]
            if any(d <= 0 for d in ne):
                raise _Bad(f"dims {ne}")
            n = math.prod(ne)
            if n > _INT64_MAX:
                raise _Bad("element count overflows int64")
            ttype = num("I")
            try:
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                raise _Bad(f"ggml type {ttype}") from None
            if ne[0] % block:
                raise _Bad("row length not a multiple of the block")
            infos.append((name, ttype, ne, n // block * type_size, num("Q")))
        start = -(-pos // alignment) * alignment
        if any(take(start - pos)):
            raise _Bad("padding before the data is not zero")
        at = 0  # the offsets are contiguous: each the padded sizes of the tensors before it
        for name, _t, _ne, nbytes, offset in infos:
            if offset != at:
                raise _Bad(f"{name}: offset {offset}, expected {at}")
            at += -(-nbytes // alignment) * alignment
        if start + at > len(data):
            raise _Bad("data past the end")
    except _Bad as e:
        return str(e)
    if imatrix:
        return _imatrix_problem(kv, infos)
    return None


def _imatrix_problem(kv: dict, infos: list) -> str | None:
    """gguf-facts §5.2 on a valid GGUF: u32 chunk count and size, a string-array dataset list when present, and
    per weight an F32 `.in_sum2` of ne [n_cols, n_mat...] and an F32 `.counts` of ne [1, n_mat...]."""
    for key in ("imatrix.chunk_count", "imatrix.chunk_size"):
        if kv.get(key, (None,))[0] != _GGUF_UINT32:
            return f"{key} missing or not u32"
    if "imatrix.datasets" in kv and kv["imatrix.datasets"][0] != (_GGUF_ARRAY, _GGUF_STRING):
        return "imatrix.datasets is not a string array"
    by_name = {i[0]: i for i in infos}
    for name, ttype, ne, _n, _o in infos:
        for own, other in ((".in_sum2", ".counts"), (".counts", ".in_sum2")):
            if name.endswith(own) and name[: -len(own)] + other not in by_name:
                return f"{name} has no {other}"
        if name.endswith((".in_sum2", ".counts")) and ttype != _GGUF_F32:
            return f"{name} is not F32"
        if name.endswith(".counts"):
            sums = by_name[name[: -len(".counts")] + ".in_sum2"][2]
            if ne[0] != 1 or math.prod(ne[1:]) != math.prod(sums[1:]):
                return f"{name}: ne {ne} for in_sum2 ne {sums}"
    return None


# safetensors dtype tags mixq reads, with their byte widths (the format knows a few more, which mixq refuses)
_ST_WIDTH = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
             "I8": 1, "U8": 1, "BOOL": 1}


def safetensors_spec_problem(data: bytes) -> str | None:
    """Why `data` is not a safetensors file, or None: u64 header length, a UTF-8 JSON object header (no key twice)
    within the file, string-to-string `__metadata__`, and tensor entries {dtype, shape, data_offsets} whose byte
    ranges have the size dtype x shape says and tile the data section exactly, in any order."""
    if len(data) < 8:
        return "no header length"
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        return "header past the end"

    def no_twice(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ValueError("a key twice")
        return dict(pairs)

    try:
        header = json.loads(data[8:8 + n].decode("utf-8"), object_pairs_hook=no_twice)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "header is not JSON"
    if not isinstance(header, dict):
        return "header is not an object"
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        return "__metadata__"
    spans = []
    for name, e in header.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            return f"{name}: entry"
        dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        ints = lambda v: isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)  # noqa: E731
        if dtype not in _ST_WIDTH or not ints(shape) or not ints(offsets) or len(offsets) != 2:
            return f"{name}: dtype, shape or offsets"
        b, end = offsets
        size = _ST_WIDTH[dtype]
        for d in shape:
            size *= d
            if size > len(data):  # cannot fit: stop before a hostile shape grows a huge number
                return f"{name}: {shape} does not fit"
        if end < b or end - b != size * (0 not in shape):
            return f"{name}: byte size"
        spans.append((b, end))
    at = 0
    for b, end in sorted(spans):
        if b != at:
            return "a gap or an overlap"
        at = end
    return None if at == len(data) - 8 - n else "the tensors do not end at the end of the file"


# --- base files ----------------------------------------------------------------------------------------------
def _write_base_gguf(path: Path) -> Path:
    """A small GGUF with every kind of header field: scalar, string and array KVs; F32, F16 and Q8_0 tensors."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "glm5-next")
    w.add_uint32("glm5-next.block_count", 1)
    w.add_float32("glm5-next.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_bool("glm5-next.expert_weights_norm", True)
    w.add_uint64("general.parameter_count", 12345)
    w.add_string("tokenizer.chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "<s>", "</s>"])
    w.add_array("glm5-next.attention.head_count_kv", [0, 0, 1])
    # a UINT8 array: with a claimed 2**62 items, gguf-py's item loop runs on past the end of the file forever
    w.add_key_value("general.tags.bytes", [1, 2, 3], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT8)
    w.add_tensor("token_embd.weight", rng.standard_normal((4, 32)).astype(np.float32))
    w.add_tensor("output_norm.weight", rng.standard_normal(32).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _write_base_imatrix(path: Path) -> Path:
    rng = np.random.default_rng(1)
    im = IMatrix(datasets=["calibration.txt"], chunk_count=3, chunk_size=64)
    im.add("blk.0.ffn_up_exps.weight", rng.random((2, 32)), [10, 4])
    im.add("blk.0.attn_q.weight", rng.random(32), 7)
    return write_imatrix(path, im)


def _write_base_safetensors(path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    save_file({"a.weight": torch.randn(4, 8, generator=g), "b.bias": torch.randn(16, generator=g).bfloat16(),
               "c.index": torch.arange(4, dtype=torch.int64).reshape(2, 2)}, str(path), metadata={"format": "pt"})
    return path


# --- GGUF mutations -------------------------------------------------------------------------------------------
def _gguf_fields(path: Path) -> list[tuple[str, str, int, int, int]]:
    """(label, role, byte offset, width, value) of every count / length / type / dim / offset of the header,
    found with gguf-py on the valid file."""
    r = gguf.GGUFReader(path)
    base = r.data.ctypes.data

    def at(part) -> int:
        return part.ctypes.data - base

    out = [("tensor_count", "count", 8, 8, len(r.tensors)), ("kv_count", "count", 16, 8, len(r.fields) - 3)]
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        out.append((name, "key_len", at(f.parts[0]), 8, int(f.parts[0][0])))
        out.append((name, "kv_type", at(f.parts[2]), 4, int(f.parts[2][0])))
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.STRING:
            out.append((name, "str_len", at(f.parts[3]), 8, int(f.parts[3][0])))
        elif vtype == gguf.GGUFValueType.ARRAY:
            out.append((name, "item_type", at(f.parts[3]), 4, int(f.parts[3][0])))
            out.append((name, "array_count", at(f.parts[4]), 8, int(f.parts[4][0])))
            if f.types[-1] == gguf.GGUFValueType.STRING:
                out.append((name, "str_len", at(f.parts[5]), 8, int(f.parts[5][0])))
    for t in r.tensors:
        name_len, _name, n_dims, dims, raw_type, offset = t.field.parts
        out.append((t.name, "name_len", at(name_len), 8, int(name_len[0])))
        out.append((t.name, "n_dims", at(n_dims), 4, int(n_dims[0])))
        for d in range(len(dims)):
            out.append((t.name, "dim", at(dims) + 8 * d, 8, int(dims[d])))
        out.append((t.name, "ggml_type", at(raw_type), 4, int(raw_type[0])))
        out.append((t.name, "offset", at(offset), 8, int(offset[0])))
    return out


def _values(role: str, width: int, orig: int, off: int, size: int) -> list[int]:
    """Adversarial values for one field: extremes, zero, negative-as-unsigned, off by one, just past EOF."""
    past_eof = size - off  # a length / count that reaches one byte past the end
    vals = {
        "count": {0, 1, orig + 1, 2**32, 2**62, 2**64 - 1},
        "key_len": {0, past_eof, 2**62, 2**64 - 1},
        "name_len": {0, orig + 1, past_eof, 2**63, 2**64 - 1},
        "str_len": {0, orig + 1, past_eof, past_eof + 1, 2**62, 2**64 - 1},
        "kv_type": {13, 9, 8 if orig != 8 else 0},  # unknown, ARRAY, STRING / UINT8 reinterpretations
        "item_type": {13, 9, 0, 8, 2**32 - 1},      # unknown, nested ARRAY, UINT8, STRING, -1
        "array_count": {0, orig + 1, past_eof, 2**32, 2**62, 2**63, 2**64 - 1},
        "n_dims": {0, 5, orig + 1, orig - 1, 2**32 - 1},
        "dim": {0, 2**63, 2**64 - 1, 2**62, orig + 1, orig * 2, 2**32 + orig},
        "ggml_type": {4, 1000, 2**32 - 1, 8 if orig != 8 else 0},  # removed id, out of range, another type
        "offset": {1, orig + 32, 2**64 - 32, 2**63, size, 2**64 - 1},
    }[role]
    vals.discard(orig)
    return sorted(v for v in vals if 0 <= v < 2 ** (8 * width))


def _gguf_cases(path: Path, seed: int, n_random: int, n_trunc: int) -> list[Case]:
    """Every header field of `path` set to each adversarial value, then random header byte flips, truncations."""
    raw = path.read_bytes()
    size = len(raw)
    cases = []
    for label, role, off, width, orig in _gguf_fields(path):
        for v in _values(role, width, orig, off, size):
            data = bytearray(raw)
            data[off:off + width] = v.to_bytes(width, "little")
            must = ((role in ("array_count", "count") and v >= 2**32)
                    or (role == "dim" and (v == 0 or v >= 2**63)) or (role == "n_dims" and (v == 0 or v > 4)))
            named = label if must and role != "count" else ""  # header counts belong to no key or tensor
            cases.append(Case(f"{label}.{role}={v:#x}", bytes(data), must, named))
    rng = random.Random(seed)
    header_end = gguf.GGUFReader(path).data_offset
    for i in range(n_random):
        data = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(4, header_end)] = rng.randrange(256)  # past the magic: reach the parser
        cases.append(Case(f"flip{i}", bytes(data)))
    for i in range(n_trunc):
        cases.append(Case(f"trunc{i}", raw[: rng.randrange(0, size)]))
    return cases


# --- safetensors mutations ------------------------------------------------------------------------------------
def _st_parts(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _st_file(header: dict | bytes, body: bytes, length: int | None = None) -> bytes:
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(hb) if length is None else length) + hb + body


def _st_cases(path: Path, seed: int, n_random: int, n_trunc: int) -> list[Case]:
    """Header length, header JSON and entry mutations of a safetensors file, random flips, truncations."""
    header, body = _st_parts(path)
    raw = path.read_bytes()
    n = len(raw) - 8 - len(body)
    size = len(raw)
    cases = [Case(f"header_len={v:#x}", _st_file(header, body, v), True)
             for v in (*U64, n + 1, size - 7, size, 100 * 2**20 + 1)]
    cases.append(Case("header_len=n-1", _st_file(header, body, n - 1), True))
    for label, hb in (("array", b"[]"), ("number", b"1"), ("null", b"null"), ("string", b'"x"'),
                      ("unclosed", b"{"), ("not-utf8", b"\xff\xfe{}"), ("nested", b'{"a":' * 50000 + b"1")):
        cases.append(Case(f"header={label}", _st_file(hb, body), True))
    name = "a.weight"
    edits = {
        "dtype": ["X9", 5, None, "F8_E8M0", ""],
        "shape": [[-1, 8], [2**62, 2**62], [2**64, 1], "48", [1.5, 8], [True, 8], [0, 8], [[4], 8], [], [4, 8, 1],
                  [2] * 100000],
        "data_offsets": [[0], [0, 2**64], [-8, 120], [128, 0], [0, 129], ["0", "128"], [2**63, 2**63 + 128],
                         [size, size + 128], None],
    }
    for field, vals in edits.items():
        for v in vals:
            h = json.loads(json.dumps(header))
            h[name][field] = v
            clean_ok = field == "shape" and v == [4, 8, 1]  # same byte count: a valid file
            cases.append(Case(f"{field}={str(v)[:30]}", _st_file(h, body), not clean_ok, "" if clean_ok else name))
    for label, mutate in (
            ("entry-not-object", lambda h: h.__setitem__(name, 5)),
            ("entry-no-dtype", lambda h: h[name].pop("dtype")),
            ("metadata-int", lambda h: h.__setitem__("__metadata__", {"format": 1})),
            ("metadata-list", lambda h: h.__setitem__("__metadata__", [])),
            ("overlap", lambda h: h["b.bias"].__setitem__("data_offsets", [0, 32])),
            ("extra-tensor", lambda h: h.__setitem__("z.extra", {"dtype": "F32", "shape": [1],
                                                                 "data_offsets": [len(body), len(body) + 4]}))):
        h = json.loads(json.dumps(header))
        mutate(h)
        cases.append(Case(f"header-{label}", _st_file(h, body), True))
    rng = random.Random(seed)
    for i in range(n_random):
        data = bytearray(raw)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(0, 8 + n)] = rng.randrange(256)
        cases.append(Case(f"flip{i}", bytes(data)))
    for i in range(n_trunc):
        cases.append(Case(f"trunc{i}", raw[: rng.randrange(0, size)]))
    return cases


# --- the readers under test -----------------------------------------------------------------------------------
def _read_gguf_everything(p: Path) -> None:
    g = read_gguf(p)
    for e in g.tensors.values():
        e.raw()
    inspect_gguf(p)
    verify_gguf(p)


def _read_safetensors_everything(p: Path) -> None:
    tensor_entries(p)
    read_metadata(p)
    read_header(p)
    load_tensors(p)


class _Hang(BaseException):
    """Raised by the watchdog; a BaseException so that no reader's `except Exception` turns it into an error."""


@contextmanager
def _watchdog(seconds: float) -> Iterator[None]:
    """Interrupt a case that runs past `seconds` (a loop over a claimed 2**62 items), so a regression fails the
    test instead of hanging the suite."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def fire(_sig, _frame):
        raise _Hang()

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _run_cases(tmp: Path, suffix: str, cases: list[Case], read: Callable[[Path], None],
               spec: Callable[[bytes], str | None]) -> list[str]:
    """Run every case; returns what went wrong (empty = all fine). `spec` says why a case's file is invalid (None
    where it is valid): an invalid file must end in a FormatError, a valid one must read cleanly."""
    bad = []
    for i, c in enumerate(cases):
        problem = spec(c.data)
        if c.must_fail and problem is None:
            bad.append(f"{c.name}: invalid by its kind, but the spec reading finds nothing wrong")
        p = tmp / f"case{i:04d}{suffix}"
        p.write_bytes(c.data)
        t0 = time.monotonic()
        outcome, msg = "clean", ""
        try:
            with _watchdog(4 * CASE_SECONDS):
                read(p)
        except _Hang:
            bad.append(f"{c.name}: still running after {4 * CASE_SECONDS:.0f} s (interrupted)")
            outcome = "hang"
        except FormatError as e:
            msg = str(e)
            outcome = "error"
            if str(p) not in msg or "\n" in msg:
                bad.append(f"{c.name}: message does not name the file on one line: {msg!r}")
            elif c.names and c.names not in msg:
                bad.append(f"{c.name}: message does not name {c.names!r}: {msg!r}")
        except Exception as e:  # noqa: BLE001 - any other exception type is the failure under test
            bad.append(f"{c.name}: {type(e).__name__}: {str(e)[:200]}")
            outcome = "other"
        dt = time.monotonic() - t0
        if dt > CASE_SECONDS:
            bad.append(f"{c.name}: took {dt:.1f} s")
        if problem is not None and outcome == "clean":
            bad.append(f"{c.name}: read cleanly, though invalid ({problem})")
        if problem is None and outcome == "error":
            bad.append(f"{c.name}: valid by the spec, but refused: {msg}")
        p.unlink()
    return bad


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("fuzz-bases")
    return {"gguf": _write_base_gguf(d / "base.gguf"), "imatrix": _write_base_imatrix(d / "imatrix.gguf"),
            "safetensors": _write_base_safetensors(d / "base.safetensors")}


def test_base_files_read_cleanly(bases):
    """The mutations start from files every reader takes and the spec readings find valid (so an error below is
    the mutation's)."""
    assert gguf_spec_problem(bases["gguf"].read_bytes()) is None
    assert gguf_spec_problem(bases["imatrix"].read_bytes(), imatrix=True) is None
    assert safetensors_spec_problem(bases["safetensors"].read_bytes()) is None
    _read_gguf_everything(bases["gguf"])
    assert verify_gguf(bases["gguf"])["tensors"] == 3
    assert read_imatrix(bases["imatrix"]).chunk_count == 3
    _read_safetensors_everything(bases["safetensors"])


def test_gguf_header_fuzz(bases, tmp_path):
    """~200 GGUF cases: every header count, length, type, dim and offset set to adversarial values, plus random
    byte flips in the header and truncations."""
    cases = _gguf_cases(bases["gguf"], seed=1, n_random=24 * SCALE, n_trunc=8 * SCALE)
    assert len(cases) >= 150
    t0 = time.monotonic()
    bad = _run_cases(tmp_path, ".gguf", cases, _read_gguf_everything, gguf_spec_problem)
    assert not bad, "\n".join(bad[:30])
    assert time.monotonic() - t0 < 60


def test_imatrix_header_fuzz(bases, tmp_path):
    """The imatrix reader takes its GGUF through the same checked opener: a sample of the same mutations."""
    cases = _gguf_cases(bases["imatrix"], seed=2, n_random=15 * SCALE, n_trunc=5 * SCALE)
    rng = random.Random(3)
    cases = rng.sample(cases, min(len(cases), 40 * SCALE))
    bad = _run_cases(tmp_path, ".gguf", cases, lambda p: read_imatrix(p).means(),
                     lambda data: gguf_spec_problem(data, imatrix=True))
    assert not bad, "\n".join(bad[:30])


def test_safetensors_header_fuzz(bases, tmp_path):
    """~80 safetensors cases: header length, non-JSON and non-object headers, bad dtype / shape / offsets,
    gaps and overlaps, random flips in the header and truncations."""
    cases = _st_cases(bases["safetensors"], seed=4, n_random=16 * SCALE, n_trunc=8 * SCALE)
    bad = _run_cases(tmp_path, ".safetensors", cases, _read_safetensors_everything, safetensors_spec_problem)
    assert not bad, "\n".join(bad[:30])


# --- the headline cases, through the CLI ----------------------------------------------------------------------
def _patched(base: Path, dst: Path, label: str, role: str, value: int) -> Path:
    """A copy of `base` with one header field (found by label and role) set to `value`."""
    raw = bytearray(base.read_bytes())
    for lab, r, off, width, _orig in _gguf_fields(base):
        if lab == label and r == role:
            raw[off:off + width] = value.to_bytes(width, "little")
            dst.write_bytes(bytes(raw))
            return dst
    raise AssertionError(f"no {role} field for {label}")


@pytest.fixture(scope="module")
def hostile(bases, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hostile")
    return {
        "array": _patched(bases["gguf"], d / "array62.gguf", "tokenizer.ggml.tokens", "array_count", 2**62),
        "intarray": _patched(bases["gguf"], d / "intarray62.gguf", "glm5-next.attention.head_count_kv",
                             "array_count", 2**62),
        "u8array": _patched(bases["gguf"], d / "u8array62.gguf", "general.tags.bytes", "array_count", 2**62),
        "zero_dim": _patched(bases["gguf"], d / "zerodim.gguf", "token_embd.weight", "dim", 0),
    }


def test_array_count_2_62_is_refused_at_once(hostile):
    for p in (hostile["array"], hostile["intarray"], hostile["u8array"]):
        t0 = time.monotonic()
        with pytest.raises(FormatError, match="array of 4611686018427387904"):
            open_gguf_reader(p)
        assert time.monotonic() - t0 < CASE_SECONDS


def test_zero_dim_tensor_is_refused(hostile):
    with pytest.raises(FormatError, match=r"tensor 'token_embd.weight': dimension 0 is 0"):
        read_gguf(hostile["zero_dim"])


@pytest.mark.parametrize("command", ["verify", "inspect"])
@pytest.mark.parametrize("kind,names", [("array", "tokenizer.ggml.tokens"),
                                        ("intarray", "glm5-next.attention.head_count_kv"),
                                        ("u8array", "general.tags.bytes"),
                                        ("zero_dim", "token_embd.weight")])
def test_cli_answers_hostile_gguf_with_one_error_line(command, kind, names, hostile):
    """`mixq verify` / `mixq inspect`: exit 2, one `mixq: error:` line naming the file and the key / tensor,
    no traceback, in well under the time a 2**62-item loop would take."""
    t0 = time.monotonic()
    line = error_line(run_cli(command, hostile[kind]))
    assert time.monotonic() - t0 < 60  # a 2**62-item loop takes hours; a busy machine takes seconds
    assert str(hostile[kind]) in line and names in line, line


def test_cli_inspect_names_the_shard_and_tensor_of_a_hostile_safetensors_header(tiny_model, tmp_path):
    """A checkpoint shard whose header claims a 2**62 x 2**62 tensor: one error line naming shard and tensor."""
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_model, d)
    f = d / "model.safetensors"
    f.chmod(0o644)
    header, body = _st_parts(f)
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [2**62, 2**62]
    f.write_bytes(_st_file(header, body))
    t0 = time.monotonic()
    line = error_line(run_cli("inspect", d))
    assert time.monotonic() - t0 < 60
    assert str(f) in line and name in line, line
