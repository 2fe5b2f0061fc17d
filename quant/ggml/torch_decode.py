"""Dequantize GGUF tensors with torch: a ggml type's stored bytes -> float32, vectorised, on the bytes' device.

gguf-py's ``gguf.quants.dequantize`` decodes on the host with numpy; ``dequantize(raw, qtype, shape)`` decodes the
same bytes with torch ops wherever ``raw`` lives (an eval decodes a GGUF candidate's blocks on its GPU). Each type's
decoder reshapes the uint8 blocks into their fields, unpacks the bits with shifts and masks, and applies the float32
products and sums in gguf-py's order, one correctly rounded IEEE operation at a time (eager torch fuses no
multiply-add), so the values are gguf-py's bit for bit on CPU; CUDA runs the same operations (its tests hold it to
1e-6 relative of gguf-py).

Facts read, not restated: the block sizes (weights and bytes per block) are gguf-py's size table
``GGML_QUANT_SIZES``; `FIELDS` splits each block into its fields and is checked against that table at import; the
lattice grids of the i-quants are gguf-py's own (``gguf.quants.<TYPE>.grid``) and so is IQ1's delta; the IQ4 levels
are mixq's (:data:`numpy_iq4.IQ4_LEVELS`). `DECODERS` maps each type name to its decoder.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable

import numpy as np
import torch
from gguf import quants as gguf_quants

from mixq.errors import FormatError
from mixq.formats.gguf_layout import block_shape
from mixq.quant.ggml.i_quants.numpy_iq4 import IQ4_LEVELS

F32 = torch.float32
Fields = dict[str, torch.Tensor]


Q = block_shape("Q8_0")[0]   # the 32-weight block of the legacy types and IQ4_NL
K = block_shape("Q4_K")[0]   # the 256-weight super-block of the k-quants and i-quants (ggml's QK_K)

# each block's fields in file order: (name, bytes); "d", "dmin" and "m" are fp16 scales
FIELDS: dict[str, tuple[tuple[str, int], ...]] = {
    "F32": (("x", 4),),
    "F16": (("x", 2),),
    "BF16": (("x", 2),),
    "Q8_0": (("d", 2), ("qs", Q)),
    "Q4_0": (("d", 2), ("qs", Q // 2)),
    "Q4_1": (("d", 2), ("m", 2), ("qs", Q // 2)),
    "Q5_0": (("d", 2), ("qh", Q // 8), ("qs", Q // 2)),
    "Q5_1": (("d", 2), ("m", 2), ("qh", Q // 8), ("qs", Q // 2)),
    "Q2_K": (("scales", K // 16), ("qs", K // 4), ("d", 2), ("dmin", 2)),
    "Q3_K": (("hmask", K // 8), ("qs", K // 4), ("scales", 12), ("d", 2)),
    "Q4_K": (("d", 2), ("dmin", 2), ("scales", 12), ("qs", K // 2)),
    "Q5_K": (("d", 2), ("dmin", 2), ("scales", 12), ("qh", K // 8), ("qs", K // 2)),
    "Q6_K": (("ql", K // 2), ("qh", K // 4), ("scales", K // 16), ("d", 2)),
    "IQ4_NL": (("d", 2), ("qs", Q // 2)),
    "IQ4_XS": (("d", 2), ("scales_h", 2), ("scales_l", K // 64), ("qs", K // 2)),
    "IQ2_XXS": (("d", 2), ("qs", K // 4)),
    "IQ2_XS": (("d", 2), ("qs", K // 4), ("scales", K // 32)),
    "IQ2_S": (("d", 2), ("qs", K // 8), ("signs", K // 8), ("qh", K // 32), ("scales", K // 32)),
    "IQ3_XXS": (("d", 2), ("qs", K // 4), ("signs", K // 8)),
    "IQ3_S": (("d", 2), ("qs", K // 4), ("qh", K // 32), ("signs", K // 8), ("scales", K // 64)),
    "IQ1_S": (("d", 2), ("qs", K // 8), ("qh", K // 16)),
    "IQ1_M": (("qs", K // 8), ("qh", K // 16), ("scales", K // 32)),
}
for _name, _fields in FIELDS.items():
    if sum(b for _, b in _fields) != block_shape(_name)[1]:
        raise AssertionError(f"{_name}: FIELDS disagree with gguf-py's block size {block_shape(_name)}")

# weights decoded per step: bounds the intermediates (a few float32 copies of a step) on any device; the CPU's
# steps stay near its caches, an accelerator's are long enough to hide the kernel launches
CHUNK_WEIGHTS = {"cpu": 1 << 20, "other": 1 << 24}


# --- bit and byte helpers ------------------------------------------------------------------------------------------
def reinterpret(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of ``x`` (uint8, last dim) read as ``dtype``; copies where ``x`` is strided or misaligned."""
    x = x.contiguous()
    if x.storage_offset() % dtype.itemsize:
        x = x.clone()
    return x.view(dtype)


def half(x: torch.Tensor) -> torch.Tensor:
    """fp16 fields (n, 2) uint8 -> (n, 1) float32."""
    return reinterpret(x, torch.float16).to(F32)


def planes(x: torch.Tensor, width: int) -> torch.Tensor:
    """Bit fields of uint8 ``x`` (..., L) -> (..., 8 // width, L): plane p holds bits [p·width, (p+1)·width)."""
    mask = (1 << width) - 1
    return torch.stack([(x >> s) & mask for s in range(0, 8, width)], dim=-2)


def bits(x: torch.Tensor) -> torch.Tensor:
    """The 8 bits of uint8 ``x`` (...) -> (...,8) uint8, bit i at index i."""
    return planes(x.unsqueeze(-1), 1).squeeze(-1)


def le_int(x: torch.Tensor) -> torch.Tensor:
    """The little-endian unsigned integer of the bytes on ``x``'s last dim -> int32 (so: up to 3 bytes, or 4 with
    the last below 0x80)."""
    x = x.to(torch.int32)
    out = x[..., 0]
    for i in range(1, x.shape[-1]):
        out = out | (x[..., i] << (8 * i))
    return out


def half_of_bits(v: torch.Tensor) -> torch.Tensor:
    """fp16 bit patterns (...) in int32 -> float32 (..., 1)."""
    return half(torch.stack((v & 0xFF, v >> 8), dim=-1).to(torch.uint8))


def nibble_pairs(x: torch.Tensor) -> torch.Tensor:
    """(n, L) uint8 -> (n, 2L): byte i's low nibble at 2i, its high nibble at 2i+1 (packed 4-bit scales)."""
    return torch.stack((x & 0xF, x >> 4), dim=-1).reshape(x.shape[0], -1)


def flip(v: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """``v`` with the sign flipped where ``negative`` (the same as a product by ±1, without the product)."""
    return torch.where(negative.bool(), -v, v)


def parity_signs(s7: torch.Tensor) -> torch.Tensor:
    """7 stored sign bits (int32 ...) -> 8 sign bits (..., 8): the 8th makes the count of negatives even."""
    b = bits(s7.to(torch.uint8))
    b[..., 7] = b[..., :7].sum(-1) & 1
    return b


@lru_cache(maxsize=None)
def grid(qtype: str, device: torch.device) -> torch.Tensor:
    """gguf-py's lattice grid of an i-quant (entries, weights per entry) as float32 on ``device``."""
    cls = getattr(gguf_quants, qtype)
    cls.init_grid()
    return torch.from_numpy(np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape).copy()).to(device)


@lru_cache(maxsize=None)
def iq4_levels(device: torch.device) -> torch.Tensor:
    """The 16 IQ4 levels as float32 on ``device``."""
    return torch.as_tensor(IQ4_LEVELS, dtype=F32).to(device)


IQ1_DELTA = float(gguf_quants.IQ1_S.delta)  # the offset of IQ1 grid values, its sign stored per group


# --- decoders: fields of n blocks -> (n, weights per block) float32 ---------------------------------------------
def decode_f32(f: Fields) -> torch.Tensor:
    return reinterpret(f["x"], F32)


def decode_f16(f: Fields) -> torch.Tensor:
    return half(f["x"])


def decode_bf16(f: Fields) -> torch.Tensor:
    return reinterpret(f["x"], torch.bfloat16).to(F32)  # exact: bf16 is the top half of an f32


def decode_q8_0(f: Fields) -> torch.Tensor:
    return f["qs"].view(torch.int8).to(F32) * half(f["d"])


def low_high(qs: torch.Tensor) -> torch.Tensor:
    """A legacy block's 4-bit codes: the bytes' low nibbles are the first half of the block, high the second."""
    return planes(qs, 4).reshape(qs.shape[0], -1)


def fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 high bits: weight i's is bit i of the little-endian qh word -> (n, 32) uint8."""
    return planes(qh, 1).transpose(-1, -2).reshape(qh.shape[0], -1)


def decode_q4_0(f: Fields) -> torch.Tensor:
    return half(f["d"]) * (low_high(f["qs"]).to(F32) - 8)


def decode_q4_1(f: Fields) -> torch.Tensor:
    return half(f["d"]) * low_high(f["qs"]).to(F32) + half(f["m"])


def decode_q5_0(f: Fields) -> torch.Tensor:
    q = low_high(f["qs"]) | (fifth_bits(f["qh"]) << 4)
    return half(f["d"]) * (q.to(F32) - 16)


def decode_q5_1(f: Fields) -> torch.Tensor:
    q = low_high(f["qs"]) | (fifth_bits(f["qh"]) << 4)
    return half(f["d"]) * q.to(F32) + half(f["m"])


def decode_q2_k(f: Fields) -> torch.Tensor:
    n, sc = f["qs"].shape[0], f["scales"]
    dl = (half(f["d"]) * (sc & 0xF).to(F32)).unsqueeze(-1)     # 16 sub-blocks of 16: scale low nibble, min high
    ml = (half(f["dmin"]) * (sc >> 4).to(F32)).unsqueeze(-1)
    q = planes(f["qs"].reshape(n, 2, -1), 2).reshape(n, 16, -1).to(F32)  # each 128-half: 4 crumbs of 32 bytes
    return (dl * q - ml).reshape(n, -1)


def decode_q3_k(f: Fields) -> torch.Tensor:
    n, s = f["qs"].shape[0], f["scales"]
    low = planes(s[:, :8], 4).reshape(n, 16)                   # scale j's low 4 bits: byte j % 8, nibble j // 8
    high = planes(s[:, 8:], 2).reshape(n, 16)                  # its high 2 bits: byte 8 + j % 4, crumb j // 4
    scale = ((low | (high << 4)).to(torch.int16) - 32).to(F32)
    dl = (half(f["d"]) * scale).unsqueeze(-1)
    ql = planes(f["qs"].reshape(n, 2, -1), 2).reshape(n, 16, -1).to(torch.int16)
    hm = planes(f["hmask"], 1).reshape(n, 16, -1).to(torch.int16)   # weight 32k + l: bit k of hmask[l]
    q = (ql - ((hm ^ 1) << 2)).to(F32)                         # a clear mask bit subtracts 4
    return (dl * q).reshape(n, -1)


def k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes -> 8 six-bit scales and 8 six-bit mins (n, 8) uint8."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((a & 0x3F, (c & 0xF) | ((a >> 6) << 4)), dim=-1)
    mn = torch.cat((b & 0x3F, (c >> 4) | ((b >> 6) << 4)), dim=-1)
    return sc, mn


def k4_codes(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's low 4 bits: sub-block 2c + h is nibble h of bytes 32c..32c+31 -> (n, 8, 32) uint8."""
    n = qs.shape[0]
    return planes(qs.reshape(n, -1, 32), 4).reshape(n, -1, 32)


def k4_affine(f: Fields, q: torch.Tensor) -> torch.Tensor:
    sc, mn = k4_scales(f["scales"])
    dl = (half(f["d"]) * sc.to(F32)).unsqueeze(-1)
    ml = (half(f["dmin"]) * mn.to(F32)).unsqueeze(-1)
    return (dl * q.to(F32) - ml).reshape(q.shape[0], -1)


def decode_q4_k(f: Fields) -> torch.Tensor:
    return k4_affine(f, k4_codes(f["qs"]))


def decode_q5_k(f: Fields) -> torch.Tensor:
    return k4_affine(f, k4_codes(f["qs"]) | (planes(f["qh"], 1) << 4))   # sub-block j: bit j of qh[l]


def decode_q6_k(f: Fields) -> torch.Tensor:
    n = f["ql"].shape[0]
    low = planes(f["ql"].reshape(n, 2, -1), 4).reshape(n, -1)   # each 128-half: 2 nibbles of 64 bytes
    high = planes(f["qh"].reshape(n, 2, -1), 2).reshape(n, -1)  # and 4 crumbs of 32 bytes
    q = ((low | (high << 4)).to(torch.int16) - 32).to(F32).reshape(n, 16, -1)
    dl = (half(f["d"]) * f["scales"].view(torch.int8).to(F32)).unsqueeze(-1)
    return (dl * q).reshape(n, -1)


def decode_iq4_nl(f: Fields) -> torch.Tensor:
    q = low_high(f["qs"])
    return half(f["d"]) * iq4_levels(q.device)[q.long()]


def decode_iq4_xs(f: Fields) -> torch.Tensor:
    n = f["qs"].shape[0]
    low = nibble_pairs(f["scales_l"])                                  # sub-block j: nibble j % 2 of byte j // 2
    high = planes(f["scales_h"], 2).transpose(-1, -2).reshape(n, -1)   # bits 2j, 2j+1 of the 16-bit word
    ls = ((low | (high << 4)).to(torch.int16) - 32).to(F32)
    dl = (half(f["d"]) * ls).unsqueeze(-1)
    q = planes(f["qs"].reshape(n, -1, 16), 4).reshape(n, -1, 32)      # per 32: 16 low nibbles, 16 high
    return (dl * iq4_levels(q.device)[q.long()]).reshape(n, -1)


def lattice(qtype: str, idx: torch.Tensor) -> torch.Tensor:
    """Grid entries of ``qtype`` at the int32 indices ``idx`` (...) -> (..., weights per entry) float32."""
    return grid(qtype, idx.device)[idx.long()]


def decode_iq2_xxs(f: Fields) -> torch.Tensor:
    n = f["qs"].shape[0]
    q = f["qs"].reshape(n, -1, 8)            # per 32 weights: 4 grid bytes, then a 32-bit word of signs and scale
    word = le_int(torch.cat((q[..., 4:7], q[..., 7:] & 0xF), dim=-1))   # the low 28 bits: 4 sign indices
    s7 = torch.stack([(word >> (7 * j)) & 0x7F for j in range(4)], dim=-1)
    db = half(f["d"]) * ((q[..., 7] >> 4).to(F32) + 0.5) * 0.25
    v = db[..., None, None] * lattice("IQ2_XXS", q[..., :4].to(torch.int32))
    return flip(v, parity_signs(s7)).reshape(n, -1)


def decode_iq2_xs(f: Fields) -> torch.Tensor:
    n = f["qs"].shape[0]
    word = le_int(f["qs"].reshape(n, -1, 2))             # per 8 weights: 9-bit grid index, 7 sign bits
    db = half(f["d"]) * (nibble_pairs(f["scales"]).to(F32) + 0.5) * 0.25   # one scale per 16 weights
    v = db[..., None, None] * lattice("IQ2_XS", word & 0x1FF).reshape(n, db.shape[1], 2, -1)
    return flip(v, parity_signs(word >> 9).reshape(v.shape)).reshape(n, -1)


def decode_iq2_s(f: Fields) -> torch.Tensor:
    n = f["qs"].shape[0]
    high = planes(f["qh"], 2).transpose(-1, -2).reshape(n, -1)   # group 4b + p: crumb p of qh[b]
    idx = f["qs"].to(torch.int32) | (high.to(torch.int32) << 8)
    db = half(f["d"]) * (nibble_pairs(f["scales"]).to(F32) + 0.5) * 0.25
    v = db[..., None, None] * lattice("IQ2_S", idx).reshape(n, db.shape[1], 2, -1)
    return flip(v, bits(f["signs"]).reshape(v.shape)).reshape(n, -1)


def decode_iq3_xxs(f: Fields) -> torch.Tensor:
    n = f["qs"].shape[0]
    w = f["signs"].reshape(n, -1, 4)          # per 32 weights: a 32-bit word, 4 sign indices and the scale
    word = le_int(torch.cat((w[..., :3], w[..., 3:] & 0xF), dim=-1))
    s7 = torch.stack([(word >> (7 * j)) & 0x7F for j in range(4)], dim=-1)
    db = half(f["d"]) * ((w[..., 3] >> 4).to(F32) + 0.5) * 0.5
    v = db[..., None, None] * lattice("IQ3_XXS", f["qs"].to(torch.int32)).reshape(n, db.shape[1], 4, -1)
    return flip(v, parity_signs(s7)).reshape(n, -1)


def decode_iq3_s(f: Fields) -> torch.Tensor:
    n = f["qs"].shape[0]
    high = planes(f["qh"], 1).transpose(-1, -2).reshape(n, -1)   # entry 8b + p: bit p of qh[b]
    idx = f["qs"].to(torch.int32) | (high.to(torch.int32) << 8)
    db = half(f["d"]) * (nibble_pairs(f["scales"]) * 2 + 1).to(F32)   # one scale per 32 weights
    v = db[..., None] * lattice("IQ3_S", idx).reshape(n, db.shape[1], -1)
    return flip(v, bits(f["signs"]).reshape(v.shape)).reshape(n, -1)


def iq1_values(dl: torch.Tensor, idx: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """dl · (grid entry + ±delta): dl (..., 1), idx and negative (...) -> (..., 8)."""
    delta = (1 - 2 * negative.to(torch.int32)).to(F32).unsqueeze(-1) * IQ1_DELTA
    return dl * (lattice("IQ1_S", idx) + delta)


def decode_iq1_s(f: Fields) -> torch.Tensor:
    n = f["qs"].shape[0]
    word = le_int(f["qh"].reshape(n, -1, 2))  # per 32 weights: 4 x 3 high index bits, 3-bit scale, delta sign
    idx = f["qs"].reshape(n, -1, 4).to(torch.int32) | torch.stack(
        [((word >> (3 * j)) & 7) << 8 for j in range(4)], dim=-1)
    dl = half(f["d"]) * (2 * ((word >> 12) & 7) + 1).to(F32)
    return iq1_values(dl[..., None, None], idx, (word >> 15).unsqueeze(-1).expand_as(idx)).reshape(n, -1)


def decode_iq1_m(f: Fields) -> torch.Tensor:
    n = f["qs"].shape[0]
    w = le_int(f["scales"].reshape(n, -1, 2))   # 4 words: 4 x 3-bit scales each; their top nibbles are d
    d = half_of_bits((w[:, 0] >> 12) | ((w[:, 1] >> 8) & 0xF0) | ((w[:, 2] >> 4) & 0xF00) | (w[:, 3] & 0xF000))
    sc = torch.stack([(w >> (3 * j)) & 7 for j in range(4)], dim=-1).reshape(n, -1)   # one per 16 weights
    dl = d * (2 * sc + 1).to(F32)
    nib = nibble_pairs(f["qh"]).to(torch.int32)   # per 8 weights: 3 high index bits, delta sign
    idx = f["qs"].to(torch.int32) | ((nib & 7) << 8)
    v = iq1_values(dl.repeat_interleave(2, dim=-1).unsqueeze(-1), idx, nib >> 3)
    return v.reshape(n, -1)


DECODERS: dict[str, Callable[[Fields], torch.Tensor]] = {
    "F32": decode_f32, "F16": decode_f16, "BF16": decode_bf16,
    "Q8_0": decode_q8_0, "Q4_0": decode_q4_0, "Q4_1": decode_q4_1, "Q5_0": decode_q5_0, "Q5_1": decode_q5_1,
    "Q2_K": decode_q2_k, "Q3_K": decode_q3_k, "Q4_K": decode_q4_k, "Q5_K": decode_q5_k, "Q6_K": decode_q6_k,
    "IQ4_NL": decode_iq4_nl, "IQ4_XS": decode_iq4_xs,
    "IQ2_XXS": decode_iq2_xxs, "IQ2_XS": decode_iq2_xs, "IQ2_S": decode_iq2_s,
    "IQ3_XXS": decode_iq3_xxs, "IQ3_S": decode_iq3_s, "IQ1_S": decode_iq1_s, "IQ1_M": decode_iq1_m,
}
assert DECODERS.keys() == FIELDS.keys()
DECODABLE: frozenset[str] = frozenset(DECODERS)


def can_decode(qtype: str) -> bool:
    """True when `dequantize` decodes ggml type ``qtype`` (a name such as "Q4_K")."""
    return qtype in DECODERS


def split_fields(blocks: torch.Tensor, qtype: str) -> Fields:
    """(n, block bytes) uint8 -> {field name: (n, field bytes) view} (`FIELDS`)."""
    out, at = {}, 0
    for name, size in FIELDS[qtype]:
        out[name] = blocks[:, at:at + size]
        at += size
    return out


def dequantize(raw: torch.Tensor, qtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A GGUF tensor's stored bytes ``raw`` (uint8, any shape, any device) of ggml type ``qtype`` -> float32 of
    ``shape`` (numpy order, as gguf-py's dequantize gives it), on ``raw``'s device, in new memory."""
    if qtype not in DECODERS:
        raise FormatError(f"no torch decoder for ggml type {qtype} (decodable: {', '.join(sorted(DECODABLE))})")
    if raw.dtype != torch.uint8:
        raise FormatError(f"{qtype}: the stored bytes must be uint8, not {raw.dtype}")
    per_block, nbytes = block_shape(qtype)
    n = math.prod(shape)
    if n % per_block or raw.numel() != n // per_block * nbytes:
        raise FormatError(f"{qtype} {tuple(shape)}: {raw.numel()} bytes stored, the shape needs "
                          f"{n // per_block * nbytes} (and a multiple of {per_block} weights)")
    blocks = raw.reshape(-1, nbytes)
    step = max(1, CHUNK_WEIGHTS["cpu" if raw.device.type == "cpu" else "other"] // per_block)
    decode = DECODERS[qtype]
    if blocks.shape[0] <= step:  # one step: its result is the output, unless it is a view of raw (F32)
        out = decode(split_fields(blocks, qtype))
        if out.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr():
            out = out.clone()
        return out.reshape(shape)
    out = torch.empty(blocks.shape[0], per_block, dtype=F32, device=raw.device)
    for a in range(0, blocks.shape[0], step):
        out[a:a + step] = decode(split_fields(blocks[a:a + step], qtype))
    return out.reshape(shape)


def stored_bytes(data: np.ndarray) -> torch.Tensor:
    """The bytes of a GGUF tensor's data as gguf-py's reader maps them (typed or uint8, read-only) -> a flat
    uint8 CPU tensor of its own (writable, so torch can hold it; the copy is the stored size, not the decoded)."""
    return torch.from_numpy(np.array(data).reshape(-1).view(np.uint8))
