"""The level codes inside ggml blocks: write chosen codes into encoded blocks, read each element's grid back.

A ggml block stores scales (fp16 super-scales, packed sub-block scales/mins) and one level code per weight (or,
for the lattice i-quants, one codebook index per group of weights). A rounding method that keeps the scales an
encoder chose but picks its own codes needs exactly two things, given here per type:

- ``set_levels(blocks, qtype, codes)``: the same blocks with every weight's code replaced (scales untouched);
- ``level_grid(blocks, qtype)``: per weight, ``(step, base)`` such that code c decodes to ``step*value(c) + base``,
  where ``value(c) = c`` for the affine types and the fixed 16-level IQ4 table (:func:`level_values`) for IQ4_NL
  and IQ4_XS.

For the scalar types every decoded weight is affine in its own level value, so the grid is read through the torch
decoder (:mod:`torch_decode`, gguf-py's values bit for bit on the CPU; codes all at the low end, then all at the
high end) instead of a second copy of each decoding rule. The ``*_on`` forms decode and return on a given device, so
a rounding that runs on the GPU makes no host decode.
:func:`nearest_codes` and :func:`interpolated_values` give the rounding and a piecewise-linear relaxation on the
level values, the same for every scalar type (through :func:`table_nearest` / :func:`table_values` /
:func:`table_positions` on any ascending level table, which the IQ2 types' signed levels use too).
Bit layouts follow ggml's block definitions (docstrings of :mod:`k_quants.numpy_backend` name the byte ranges).
The IQ2 types (8-weight codebook groups: IQ2_S with free signs, IQ2_XS with an even count of negatives) have
their own table, ``IQ2_LAYOUTS``, and pair: ``set_iq2_groups`` / ``iq2_group_scales``; the IQ1 types (8-weight
ternary codebook groups with a ±delta) theirs: ``iq1_groups_on`` / ``set_iq1_groups_on``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from gguf import quants as gguf_quants

from mixq.errors import InputError
from mixq.formats.gguf_layout import block_shape
from mixq.quant.ggml import torch_decode
from mixq.quant.ggml.i_quants.numpy_iq4 import IQ4_LEVELS
from mixq.quant.ggml.k_quants import torch_backend as k_torch

# code range (lo, hi) per scalar type; Q8_0 stays off -128, whose magnitude some SIMD dot products cannot take
CODE_RANGE: dict[str, tuple[int, int]] = {
    "Q2_K": (0, 3), "Q3_K": (0, 7), "Q4_K": (0, 15), "Q5_K": (0, 31), "Q6_K": (0, 63),
    "Q4_0": (0, 15), "Q4_1": (0, 15), "Q5_0": (0, 31), "Q5_1": (0, 31), "Q8_0": (-127, 127),
    "IQ4_NL": (0, 15), "IQ4_XS": (0, 15),
}
SCALAR_TYPES = tuple(CODE_RANGE)
GRID_CHUNK_WEIGHTS = 1 << 24   # weights per pass of level_grid_on
# the level value of each code where it is not the code itself (value(c) = table[c - lo]; ascending)
LEVEL_TABLES: dict[str, np.ndarray] = {t: IQ4_LEVELS.astype(np.float32) for t in ("IQ4_NL", "IQ4_XS")}


def level_values(qtype: str) -> np.ndarray:
    """float32 (hi - lo + 1,): the level value of every code of a scalar type (the codes themselves when affine)."""
    lo, hi = CODE_RANGE[qtype]
    return LEVEL_TABLES[qtype] if qtype in LEVEL_TABLES else np.arange(lo, hi + 1, dtype=np.float32)


@lru_cache(maxsize=None)
def _table(qtype: str, device: torch.device) -> torch.Tensor:
    """The level table on `device`, copied there once (the rounding loops call this per column)."""
    return torch.from_numpy(LEVEL_TABLES[qtype]).to(device)


def table_nearest(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Position (float, 0-based) of the entry of an ascending level table nearest to each x (ties to the upper
    entry, as ggml's best_index_int8 does)."""
    mids = (table[1:] + table[:-1]) * 0.5
    return torch.bucketize(x.contiguous(), mids, right=True).to(x.dtype)


def table_values(u: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """An ascending level table linearly interpolated at real positions u (0-based, clamped to the table):
    differentiable in u, the table's entries at whole positions."""
    n = table.shape[0]
    uc = u.clamp(0, n - 1)
    f = torch.floor(uc.detach()).clamp_(0, n - 2)
    i = f.int()  # int32 indices: half the traffic of int64 over every weight
    return table[i] + (uc - f) * (table[1:] - table[:-1])[i]


def table_positions(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`table_values`: real 0-based positions of values x on an ascending table (past the
    ends, the end segments extended)."""
    i = (torch.bucketize(x.contiguous(), table, right=True) - 1).clamp_(0, table.shape[0] - 2)
    return i.to(x.dtype) + (x - table[i]) / (table[i + 1] - table[i])


def nearest_codes(x: torch.Tensor, qtype: str) -> torch.Tensor:
    """The code (float) whose level value is nearest to x (positions in level-value units, any shape).

    Affine types round half to even and clamp; a table type takes the nearest level (:func:`table_nearest`)."""
    lo, hi = CODE_RANGE[qtype]
    if qtype not in LEVEL_TABLES:
        return torch.round(x).clamp_(lo, hi)
    return table_nearest(x, _table(qtype, x.device)) + lo


def code_values(codes: torch.Tensor, qtype: str) -> torch.Tensor:
    """The level values of integer-valued codes (float tensor, in range): the codes themselves when affine."""
    if qtype not in LEVEL_TABLES:
        return codes
    lo = CODE_RANGE[qtype][0]
    return _table(qtype, codes.device)[(codes - lo).long()]


def interpolated_values(u: torch.Tensor, qtype: str) -> torch.Tensor:
    """The level values linearly interpolated at real positions u (clamped to the code range): differentiable in u,
    equal to :func:`code_values` at whole codes. Affine types give u clamped."""
    lo, hi = CODE_RANGE[qtype]
    if qtype not in LEVEL_TABLES:
        return u.clamp(lo, hi)
    return table_values(u - lo if lo else u, _table(qtype, u.device))


def code_positions(x: torch.Tensor, qtype: str) -> torch.Tensor:
    """The inverse of :func:`interpolated_values`: real code positions of level values x (past the ends, the end
    segments extended; the affine types give x itself)."""
    lo = CODE_RANGE[qtype][0]
    if qtype not in LEVEL_TABLES:
        return x
    return table_positions(x, _table(qtype, x.device)) + lo


def _nibbles_k(c: torch.Tensor) -> torch.Tensor:
    """(B, 256) 4-bit codes -> (B, 128): byte 32j+l = element 64j+l (low nibble) | 64j+32+l (high)."""
    q = c.reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _nibbles_32(c: torch.Tensor) -> torch.Tensor:
    """(B, 32) 4-bit codes -> (B, 16): byte l = element l (low nibble) | element 16+l (high)."""
    return c[:, :16] | (c[:, 16:] << 4)


def _bit_planes(bits: torch.Tensor) -> torch.Tensor:
    """(B, 8, 32) bits -> (B, 32): bit i of byte l is bits[:, i, l] (the planes are disjoint: a sum is their OR)."""
    return (bits << torch.arange(8, device=bits.device).view(1, 8, 1)).sum(1)


def _fifth_bits_32(c: torch.Tensor) -> torch.Tensor:
    """(B, 32) 5-bit codes -> (B, 4): the little-endian uint32 whose bit e is bit 4 of element e's code."""
    bits = ((c >> 4) & 1).reshape(-1, 4, 8)
    return (bits << torch.arange(8, device=c.device).view(1, 1, 8)).sum(2)


def _write(out: torch.Tensor, qtype: str, c: torch.Tensor) -> None:
    """Write codes c (B, block weights; int32, each in 0..255) into the level bits of uint8 blocks `out`
    (B, block bytes), in place."""
    u8 = lambda v: v.to(torch.uint8)  # noqa: E731 - every packed value below is in 0..255
    if qtype == "Q2_K":
        out[:, 16:80] = u8(k_torch.pack_2bit(c))
    elif qtype == "Q3_K":
        out[:, 0:32] = u8(_bit_planes((c >> 2).reshape(-1, 8, 32)))  # element 32i+l: bit i of hmask byte l
        out[:, 32:96] = u8(k_torch.pack_2bit(c & 3))
    elif qtype == "Q4_K":
        out[:, 16:144] = u8(_nibbles_k(c))
    elif qtype == "Q5_K":
        out[:, 16:48] = u8(_bit_planes((c >> 4).reshape(-1, 8, 32)))  # element 32i+l: bit i of qh byte l
        out[:, 48:176] = u8(_nibbles_k(c & 15))
    elif qtype == "Q6_K":
        lo = (c & 15).reshape(-1, 2, 2, 64)  # element 128h+64s+p: nibble s of ql byte 64h+p
        out[:, 0:128] = u8((lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128))
        hi = (c >> 4).reshape(-1, 2, 4, 32)  # element 128h+32k+l: bits 2k of qh byte 32h+l
        out[:, 128:192] = u8((hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6))
                             .reshape(-1, 64))
    elif qtype == "Q4_0":
        out[:, 2:18] = u8(_nibbles_32(c))
    elif qtype == "Q4_1":
        out[:, 4:20] = u8(_nibbles_32(c))
    elif qtype == "Q5_0":
        out[:, 2:6] = u8(_fifth_bits_32(c))
        out[:, 6:22] = u8(_nibbles_32(c & 15))
    elif qtype == "Q5_1":
        out[:, 4:8] = u8(_fifth_bits_32(c))
        out[:, 8:24] = u8(_nibbles_32(c & 15))
    elif qtype == "Q8_0":
        out[:, 2:34] = u8(c)
    elif qtype == "IQ4_NL":
        out[:, 2:18] = u8(_nibbles_32(c))
    elif qtype == "IQ4_XS":  # eight of IQ4_NL's 32-weight nibble layouts after d, scales_h and scales_l
        out[:, 8:136] = u8(_nibbles_32(c.reshape(-1, 32)).reshape(-1, 128))
    else:
        raise InputError(f"no level layout for ggml type {qtype!r}; supported: {', '.join(SCALAR_TYPES)}")


def set_levels_on(blocks: np.ndarray, qtype: str, codes: torch.Tensor) -> np.ndarray:
    """:func:`set_levels` computed on the device of `codes` (a tensor); the blocks come back as numpy."""
    if qtype not in CODE_RANGE:
        raise InputError(f"no level layout for ggml type {qtype!r}; supported: {', '.join(SCALAR_TYPES)}")
    bs, ts = block_shape(qtype)
    lo, hi = CODE_RANGE[qtype]
    dev = codes.device
    c = codes.reshape(-1, bs)
    if c.numel() and bool(((c < lo) | (c > hi)).any()):
        raise InputError(f"{qtype} level codes must lie in [{lo}, {hi}]")
    flat = torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.uint8)).to(dev).reshape(-1, ts).clone()
    _write(flat, qtype, c.to(torch.int32) & 0xFF)  # a negative code's byte is its two's complement (int8)
    return flat.cpu().numpy().reshape(np.shape(blocks))


def set_levels(blocks: np.ndarray, qtype: str, codes: np.ndarray) -> np.ndarray:
    """Copy of `blocks` (..., bytes per row) with the level codes replaced by `codes` (..., weights per row).

    Codes must lie in ``CODE_RANGE[qtype]``; scales, mins and super-scales are kept byte for byte."""
    return set_levels_on(blocks, qtype, torch.as_tensor(np.asarray(codes)))


def decode_blocks(blocks: np.ndarray | torch.Tensor, qtype: str,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    """float32 weights (..., weights per row) of ggml blocks (..., bytes per row; numpy, or a uint8 tensor), decoded
    on `device` by the torch decoder (on the CPU gguf-py's values bit for bit)."""
    if isinstance(blocks, np.ndarray):
        blocks = torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.uint8))
    raw = blocks.to(device)
    bs, ts = block_shape(qtype)
    return torch_decode.dequantize(raw, qtype, tuple(raw.shape[:-1]) + (raw.shape[-1] // ts * bs,))


@lru_cache(maxsize=None)
def _constant_codes(qtype: str, code: int) -> tuple[np.ndarray, np.ndarray]:
    """(keep, fill) uint8 (block bytes,): a block with every code set to `code` is (block & keep) | fill. Read off
    :func:`set_levels` on an all-zero and an all-one block: the bits it writes are the ones equal in both."""
    bs, ts = block_shape(qtype)
    codes = np.full((1, bs), code)
    zero = set_levels(np.zeros((1, ts), np.uint8), qtype, codes)[0]
    one = set_levels(np.full((1, ts), 255, np.uint8), qtype, codes)[0]
    written = ~(zero ^ one)
    return ~written, zero & written


def _with_constant_codes(raw: torch.Tensor, qtype: str, code: int) -> torch.Tensor:
    """uint8 blocks (..., bytes per row) on any device -> the same blocks with every code set to `code`."""
    ts = block_shape(qtype)[1]
    keep, fill = (torch.from_numpy(a).to(raw.device) for a in _constant_codes(qtype, code))
    flat = raw.reshape(-1, raw.shape[-1] // ts, ts)
    return ((flat & keep) | fill).reshape(raw.shape)


def level_grid_on(blocks: np.ndarray, qtype: str, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`level_grid` computed and returned on `device` (float32 tensors), ``GRID_CHUNK_WEIGHTS`` weights at a
    time (its float64 temporaries are 40 bytes a weight: a group of routed experts at once would not fit beside
    the tuner's own)."""
    lo, hi = CODE_RANGE[qtype]
    values = level_values(qtype).astype(np.float64)
    span, first = float(values[-1] - values[0]), float(values[0])
    bs, ts = block_shape(qtype)
    flat = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, blocks.shape[-1])
    per_row = flat.shape[-1] // ts * bs
    step = torch.empty((flat.shape[0], per_row), dtype=torch.float32, device=device)
    base = torch.empty_like(step)
    rows = max(1, GRID_CHUNK_WEIGHTS // max(1, per_row))
    for r0 in range(0, flat.shape[0], rows):
        raw = torch.from_numpy(flat[r0:r0 + rows]).to(device)
        v_lo = decode_blocks(_with_constant_codes(raw, qtype, lo), qtype, device).double()
        v_hi = decode_blocks(_with_constant_codes(raw, qtype, hi), qtype, device).double()
        st = (v_hi - v_lo) / span
        step[r0:r0 + rows] = st
        base[r0:r0 + rows] = v_lo - st * first
    shape = tuple(blocks.shape[:-1]) + (per_row,)
    return step.reshape(shape), base.reshape(shape)


def level_grid(blocks: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Per weight, (step, base) float32 (..., weights per row) with decode(code c) = step*value(c) + base
    (``value`` = :func:`level_values`; the code itself for the affine types).

    Read through the decoder with every code at the low and at the high end of the range."""
    step, base = level_grid_on(blocks, qtype, "cpu")
    return step.numpy(), base.numpy()


# ---------------------------------------------------------------------------------------------- super-scales

# byte offsets of each block's fp16 super-scales: d, then dmin / m where the type has one (every decoded weight is
# linear in them: y = d·A + dmin·B with A, B fixed by the packed integer fields)
SUPER_SCALES: dict[str, tuple[int, ...]] = {
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ2_XS": (0,), "IQ2_S": (0,),
    "IQ4_NL": (0,), "IQ4_XS": (0,),
}


def _flat_blocks(blocks: np.ndarray, qtype: str) -> np.ndarray:
    if qtype not in SUPER_SCALES:
        raise InputError(f"no super-scale layout for ggml type {qtype!r}; supported: {', '.join(SUPER_SCALES)}")
    return np.asarray(blocks, dtype=np.uint8).reshape(-1, block_shape(qtype)[1])


def super_scales(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """float32 (..., blocks per row, k): the k fp16 super-scales of every block (d, and dmin / m)."""
    flat = _flat_blocks(blocks, qtype)
    vals = np.stack([flat[:, o:o + 2].copy().view("<f2")[:, 0] for o in SUPER_SCALES[qtype]], axis=-1)
    ts = flat.shape[1]
    return vals.astype(np.float32).reshape(blocks.shape[:-1] + (blocks.shape[-1] // ts, len(SUPER_SCALES[qtype])))


def set_super_scales(blocks: np.ndarray, qtype: str, values: np.ndarray) -> np.ndarray:
    """Copy of `blocks` with the super-scales replaced by `values` (..., blocks per row, k), rounded to fp16."""
    out = np.array(blocks, dtype=np.uint8, copy=True)
    flat = _flat_blocks(out, qtype)
    v = np.asarray(values, dtype=np.float32).reshape(flat.shape[0], -1)
    for i, o in enumerate(SUPER_SCALES[qtype]):
        flat[:, o:o + 2] = v[:, i].astype("<f2").view(np.uint8).reshape(-1, 2)
    return out


def super_scale_basis_on(blocks: np.ndarray, qtype: str, device: str | torch.device) -> torch.Tensor:
    """float32 (k, ..., weights per row) on `device`: the decoded weights with super-scale i set to 1 and the others
    to 0, so that decode = Σ_i scale_i · basis_i (read through the decoder, like :func:`level_grid`)."""
    flat = torch.from_numpy(_flat_blocks(blocks, qtype)).to(device)
    offsets = SUPER_SCALES[qtype]
    one, zero = (torch.from_numpy(np.array([v], "<f2").view(np.uint8)).to(device) for v in (1.0, 0.0))
    out = []
    for i in range(len(offsets)):
        unit = flat.clone()
        for j, o in enumerate(offsets):
            unit[:, o:o + 2] = one if i == j else zero
        out.append(decode_blocks(unit.reshape(blocks.shape), qtype, device))
    return torch.stack(out)


def super_scale_basis(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """:func:`super_scale_basis_on` on the CPU, as numpy."""
    return super_scale_basis_on(blocks, qtype, "cpu").numpy()


# ---------------------------------------------------------------------------------------------- sub-block scales

# sub-blocks: (weights per sub-block, scale range, min range or None); a decoded weight is affine in its
# sub-block's integer scale and min (K-quants: y = d·s·v − dmin·m with v fixed by the code; IQ2_XS / IQ2_S:
# y = d·(0.5 + s)/4 · grid value · sign; IQ4_XS: y = d·s·table value)
SUB_SCALES: dict[str, tuple[int, tuple[int, int], tuple[int, int] | None]] = {
    "Q2_K": (16, (0, 15), (0, 15)), "Q3_K": (16, (-32, 31), None), "Q4_K": (32, (0, 63), (0, 63)),
    "Q5_K": (32, (0, 63), (0, 63)), "Q6_K": (16, (-128, 127), None), "IQ2_XS": (16, (0, 15), None),
    "IQ2_S": (16, (0, 15), None), "IQ4_XS": (32, (-32, 31), None),
}


def _sub_layout(qtype: str) -> tuple[int, int]:
    if qtype not in SUB_SCALES:
        raise InputError(f"no sub-block scale layout for ggml type {qtype!r}; supported: {', '.join(SUB_SCALES)}")
    return block_shape(qtype)


def sub_scales(blocks: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(scales, mins) int64 (..., sub-blocks per row) of K-quant, IQ2 or IQ4_XS blocks; mins None but for Q2_K, Q4_K
    and Q5_K."""
    bs, ts = _sub_layout(qtype)
    b = np.asarray(blocks, dtype=np.uint8)
    flat = b.reshape(-1, ts)
    i64 = lambda a: a.astype(np.int64)  # widen only the scale bytes: the whole buffer in int64 took seconds
    mins = None
    if qtype == "Q2_K":
        q = i64(flat[:, 0:16])
        sc, mins = q & 15, q >> 4
    elif qtype == "Q3_K":
        q = i64(flat[:, 96:108])
        j = np.arange(16)
        low = np.where(j < 8, q[:, j % 8] & 15, q[:, j % 8] >> 4)
        high = (q[:, 8 + j % 4] >> (2 * (j // 4))) & 3
        sc = (low | (high << 4)) - 32
    elif qtype in ("Q4_K", "Q5_K"):
        q = i64(flat[:, 4:16])
        sc = np.concatenate([q[:, 0:4] & 63, (q[:, 8:12] & 15) | ((q[:, 0:4] >> 6) << 4)], axis=1)
        mins = np.concatenate([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)], axis=1)
    elif qtype in IQ2_LAYOUTS:
        q = i64(flat[:, IQ2_LAYOUTS[qtype].sub_scale_bytes])
        sc = np.stack([q & 15, q >> 4], axis=2).reshape(-1, 16)
    elif qtype == "IQ4_XS":  # 6 bits, offset 32: the low 4 in scales_l (two a byte), the high 2 in scales_h
        low = i64(flat[:, 4:8])
        high = i64(flat[:, 2:4]) @ np.array([1, 256])
        j = np.arange(8)
        sc = ((low[:, j // 2] >> (4 * (j % 2))) & 15 | (((high[:, None] >> (2 * j)) & 3) << 4)) - 32
    else:  # Q6_K
        sc = i64(np.ascontiguousarray(flat[:, 192:208]).view(np.int8))
    shape = b.shape[:-1] + (b.shape[-1] // ts * (bs // SUB_SCALES[qtype][0]),)
    return sc.reshape(shape), None if mins is None else mins.reshape(shape)


def set_sub_scales_on(blocks: np.ndarray | torch.Tensor, qtype: str, scales: torch.Tensor,
                     mins: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`set_sub_scales` computed on the device of `scales` (a tensor): uint8 blocks (..., bytes per row) there.
    `blocks` may be numpy or a uint8 tensor."""
    bs, ts = _sub_layout(qtype)
    _, (slo, shi), mrange = SUB_SCALES[qtype]
    nsub = bs // SUB_SCALES[qtype][0]
    dev = scales.device
    sc = scales.reshape(-1, nsub).long()
    if sc.numel() and bool(((sc < slo) | (sc > shi)).any()):
        raise InputError(f"{qtype} sub-block scales must lie in [{slo}, {shi}]")
    if mrange is not None:
        if mins is None:
            raise InputError(f"{qtype} needs the sub-block mins too")
        m = mins.reshape(-1, nsub).long().to(dev)
        if m.numel() and bool(((m < mrange[0]) | (m > mrange[1])).any()):
            raise InputError(f"{qtype} sub-block mins must lie in [{mrange[0]}, {mrange[1]}]")
    raw = blocks if isinstance(blocks, torch.Tensor) else \
        torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.uint8))
    flat = raw.to(dev).reshape(-1, ts).clone()
    u8 = lambda v: v.to(torch.uint8)  # noqa: E731
    if qtype == "Q2_K":
        flat[:, 0:16] = u8(sc | (m << 4))
    elif qtype == "Q3_K":
        flat[:, 96:108] = k_torch.pack_scales_q3_k(sc + 32)
    elif qtype in ("Q4_K", "Q5_K"):
        flat[:, 4:16] = k_torch.pack_scales_k4(sc.T, m.T)
    elif qtype in IQ2_LAYOUTS:
        flat[:, IQ2_LAYOUTS[qtype].sub_scale_bytes] = u8(sc[:, 0::2] | (sc[:, 1::2] << 4))
    elif qtype == "IQ4_XS":
        ls = sc + 32
        flat[:, 4:8] = u8((ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4))
        high = ((ls >> 4) << (2 * torch.arange(8, device=dev))).sum(-1)
        flat[:, 2:4] = u8(torch.stack([high & 255, high >> 8], dim=-1))
    else:  # Q6_K: int8 scales, stored as their two's complement
        flat[:, 192:208] = u8(sc & 0xFF)
    return flat.reshape(raw.shape)


def set_sub_scales(blocks: np.ndarray, qtype: str, scales: np.ndarray, mins: np.ndarray | None = None) -> np.ndarray:
    """Copy of K-quant, IQ2 or IQ4_XS `blocks` with the sub-block scales (and mins, for the types with mins) replaced;
    codes and super-scales kept. Values must lie in the type's ranges (``SUB_SCALES``)."""
    return set_sub_scales_on(blocks, qtype, torch.as_tensor(np.asarray(scales, dtype=np.int64)),
                             None if mins is None else torch.as_tensor(np.asarray(mins, dtype=np.int64))).numpy()


# ---------------------------------------------------------------------------------------------- IQ2 codebook groups

@dataclass(frozen=True)
class IQ2Layout:
    """Where an IQ2 type keeps its 8-weight codebook groups (a 256-weight block: fp16 d at bytes 0-1, 32 groups,
    one 4-bit scale per 16 weights; a group decodes to d·(0.5 + s)/4 · grid[index] · signs)."""
    entries: int          # codebook size: the index's range
    block_bytes: int
    parity: bool          # 7 stored sign bits; the 8th makes the count of negative weights even
    sub_scale_bytes: slice  # the 4-bit scales, two per byte (low nibble first)


IQ2_LAYOUTS: dict[str, IQ2Layout] = {
    "IQ2_XS": IQ2Layout(512, 74, True, slice(66, 74)),    # qs: uint16 per group, index | 7 sign bits << 9
    "IQ2_S": IQ2Layout(1024, 82, False, slice(74, 82)),   # 8 index bits, 8 sign bytes, then 2 high index bits
}
IQ2_TYPES = tuple(IQ2_LAYOUTS)


def _iq2_layout(qtype: str) -> IQ2Layout:
    if qtype not in IQ2_LAYOUTS:
        raise InputError(f"no codebook group layout for ggml type {qtype!r}; supported: {', '.join(IQ2_TYPES)}")
    return IQ2_LAYOUTS[qtype]


@lru_cache(maxsize=None)
def iq2_grid(qtype: str) -> np.ndarray:
    """(entries, 8) float32: the codebook magnitudes of an IQ2 type (gguf-py's table); decoded value =
    db · grid · sign."""
    cls = getattr(gguf_quants, qtype)
    cls.init_grid()
    return np.asarray(cls.grid, dtype=np.float32).reshape(_iq2_layout(qtype).entries, 8)


@lru_cache(maxsize=None)
def iq2_levels(qtype: str) -> np.ndarray:
    """float32 (6,), ascending: the values one weight of an IQ2 type takes before its group scale, the grid's
    magnitudes ({8, 25, 43}) with either sign: a coordinate's sign and magnitude as one position on one table."""
    mags = np.unique(iq2_grid(qtype))
    return np.concatenate([-mags[::-1], mags]).astype(np.float32)


@lru_cache(maxsize=None)
def _even_parity_table() -> np.ndarray:
    """(128,) int64: the sign byte of each 7-bit sign index, its top bit set where the low seven have odd parity."""
    i = np.arange(128)
    odd = np.array([bin(v).count("1") & 1 for v in i])
    return i | (odd << 7)


def even_sign_flip(neg: torch.Tensor, cost: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sign patterns made storable by IQ2_XS (an even count of negative weights): where a group's `neg` (..., 8)
    bool has an odd count, the weight of least `cost` (..., 8) flips. Returns (the new `neg`, the cost paid per
    group: 0 where nothing flipped)."""
    odd = (neg.sum(-1) % 2) == 1
    low = cost.min(-1, keepdim=True)
    flip = odd.unsqueeze(-1) & (torch.arange(8, device=neg.device) == low.indices)
    return neg ^ flip, torch.where(odd, low.values.squeeze(-1), torch.zeros_like(low.values.squeeze(-1)))


def _iq2_flat(blocks: np.ndarray, qtype: str, device: str | torch.device) -> torch.Tensor:
    ts = _iq2_layout(qtype).block_bytes
    return torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, ts)).to(device)


def _group_shape(blocks: np.ndarray, qtype: str) -> tuple[int, ...]:
    return tuple(blocks.shape[:-1]) + (blocks.shape[-1] // _iq2_layout(qtype).block_bytes * 32,)


def iq2_group_scales_on(blocks: np.ndarray, qtype: str, device: str | torch.device) -> torch.Tensor:
    """(..., bytes per row) blocks of an IQ2 type -> (..., groups per row) float32 scale db of each 8-weight group,
    on `device`."""
    layout = _iq2_layout(qtype)
    flat = _iq2_flat(blocks, qtype, device)
    o = SUPER_SCALES[qtype][0]
    d = flat[:, o:o + 2].contiguous().view(torch.float16).to(torch.float32)       # (blocks, 1)
    q = flat[:, layout.sub_scale_bytes]
    sub = torch.stack([q & 15, q >> 4], dim=2).reshape(-1, 16).to(torch.float32)  # one per 16 weights
    db = d.expand(-1, 16) * (0.5 + sub) * 0.25
    return db.repeat_interleave(2, dim=-1).reshape(_group_shape(blocks, qtype))


def iq2_group_scales(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """(..., bytes per row) blocks of an IQ2 type -> (..., groups per row) float32 scale db of each 8-weight
    group."""
    return iq2_group_scales_on(blocks, qtype, "cpu").numpy()


def iq2_groups_on(blocks: np.ndarray, qtype: str, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(codebook index (..., groups), sign byte (..., groups): bit i set where weight i is negative) of every
    8-weight group of IQ2 blocks, int64 on `device`."""
    flat = _iq2_flat(blocks, qtype, device)
    shape = _group_shape(blocks, qtype)
    if _iq2_layout(qtype).parity:  # one little-endian uint16 per group: index | 7 sign bits << 9
        word = flat[:, 2:66].contiguous().view(torch.int16).long() & 0xFFFF
        parity = torch.from_numpy(_even_parity_table()).to(flat.device)
        return (word & 511).reshape(shape), parity[word >> 9].reshape(shape)
    qh = flat[:, 66:74].long()
    high = torch.stack([(qh >> (2 * j)) & 3 for j in range(4)], dim=2).reshape(-1, 32)
    index = flat[:, 2:34].long() | (high << 8)
    return index.reshape(shape), flat[:, 34:66].long().reshape(shape)


def iq2_groups(blocks: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(codebook index (..., groups), sign byte (..., groups)) of every 8-weight group of IQ2 blocks."""
    index, signs = iq2_groups_on(blocks, qtype, "cpu")
    return index.numpy(), signs.numpy().astype(np.uint8)


def set_iq2_groups_on(blocks: np.ndarray, qtype: str, index: torch.Tensor, signs: torch.Tensor) -> np.ndarray:
    """:func:`set_iq2_groups` computed on the device of `index` (tensors); the blocks come back as numpy."""
    layout = _iq2_layout(qtype)
    dev = index.device
    flat = _iq2_flat(blocks, qtype, dev).clone()
    idx = index.long().reshape(-1, 32)
    sg = signs.reshape(-1, 32).to(dev).long() & 255
    if bool(((idx < 0) | (idx >= layout.entries)).any()):
        raise InputError(f"{qtype} codebook indices must lie in [0, {layout.entries - 1}]")
    if layout.parity:
        if bool((torch.from_numpy(_even_parity_table()).to(dev)[sg & 127] != sg).any()):
            raise InputError(f"{qtype} sign bytes must have an even number of negative weights")
        word = idx | ((sg & 127) << 9)
        flat[:, 2:66] = torch.stack([word & 255, word >> 8], dim=2).reshape(-1, 64).to(torch.uint8)
    else:
        flat[:, 2:34] = (idx & 255).to(torch.uint8)
        flat[:, 34:66] = sg.to(torch.uint8)
        h = (idx >> 8).reshape(-1, 8, 4)  # group 4k+j: bits 2j of qh byte k
        flat[:, 66:74] = (h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)).to(torch.uint8)
    return flat.cpu().numpy().reshape(np.shape(blocks))


def set_iq2_groups(blocks: np.ndarray, qtype: str, index: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """Copy of IQ2 `blocks` with each 8-weight group's codebook index and sign byte (bit i set: weight i negative;
    IQ2_XS: an even count) replaced; shapes (..., groups per row). Super-scale and 4-bit scales are kept."""
    return set_iq2_groups_on(blocks, qtype, torch.as_tensor(np.asarray(index, dtype=np.int64)),
                             torch.as_tensor(np.asarray(signs).astype(np.int64)))


# --- IQ1: 8-weight groups on the ternary codebook, each with a ±delta offset ------------------------------------
# a group decodes to db · (grid[index] + delta), grid values in {-1, 0, 1}; IQ1_S keeps one delta sign and one 3-bit
# scale per 32 weights under the fp16 d at bytes 0-1 (qs at 2-33, qh uint16 per sub-block at 34-49: 3 index bits per
# group at 3k, the scale at bit 12, the delta sign at bit 15); IQ1_M one 3-bit scale per 16 weights and one delta sign
# per group (qs at 0-31, qh byte per 16 weights at 32-47: index bits at 0 and 4, delta signs at bits 3 and 7; four
# uint16 scale words at 48-55 whose top nibbles hold the fp16 d, low nibble first)
IQ1_TYPES: tuple[str, ...] = ("IQ1_S", "IQ1_M")
IQ1_ENTRIES = 2048


@lru_cache(maxsize=None)
def iq1_grid() -> np.ndarray:
    """(2048, 8) float32: the ternary codebook of IQ1_S and IQ1_M (gguf-py's table)."""
    gguf_quants.IQ1_S.init_grid()
    return np.asarray(gguf_quants.IQ1_S.grid, dtype=np.float32).reshape(IQ1_ENTRIES, 8)


def _iq1_flat(blocks: np.ndarray, qtype: str, device: str | torch.device) -> torch.Tensor:
    if qtype not in IQ1_TYPES:
        raise InputError(f"no IQ1 group layout for ggml type {qtype!r}; supported: {', '.join(IQ1_TYPES)}")
    ts = block_shape(qtype)[1]
    return torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, ts)).to(device)


def _u16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian uint16 words of byte pairs (..., 2k) -> (..., k) int64."""
    b = b.long()
    return b[..., 0::2] | (b[..., 1::2] << 8)


def iq1_groups_on(blocks: np.ndarray, qtype: str, device: str | torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codebook index int64, scale db float32, delta float32 ±0.125), each (..., groups per row), of every 8-weight
    group of IQ1 blocks, on `device`."""
    flat = _iq1_flat(blocks, qtype, device)
    shape = tuple(blocks.shape[:-1]) + (blocks.shape[-1] // block_shape(qtype)[1] * 32,)
    delta = float(gguf_quants.IQ1_S.delta)
    if qtype == "IQ1_S":
        d = flat[:, 0:2].contiguous().view(torch.float16).to(torch.float32)        # (blocks, 1)
        qh = _u16(flat[:, 34:50])                                                   # (blocks, 8)
        hi = torch.stack([(qh >> (3 * k)) & 7 for k in range(4)], dim=2).reshape(-1, 32)
        index = flat[:, 2:34].long() | (hi << 8)
        db = (d * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)).repeat_interleave(4, dim=1)
        sign = torch.where((qh & 0x8000) != 0, -delta, delta).repeat_interleave(4, dim=1)
    else:
        qh = flat[:, 32:48].long()                                                  # (blocks, 16)
        sc = _u16(flat[:, 48:56])                                                   # (blocks, 4)
        bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000)
        d = bits.to(torch.int16).view(torch.float16).to(torch.float32)[:, None]    # (blocks, 1)
        ls = torch.stack([(sc >> (3 * j)) & 7 for j in range(4)], dim=2).reshape(-1, 16)
        hi = torch.stack([qh & 7, (qh >> 4) & 7], dim=2).reshape(-1, 32)
        index = flat[:, 0:32].long() | (hi << 8)
        db = (d * (2 * ls + 1).to(torch.float32)).repeat_interleave(2, dim=1)
        neg = torch.stack([(qh & 0x08) != 0, (qh & 0x80) != 0], dim=2).reshape(-1, 32)
        sign = torch.where(neg, -delta, delta)
    return index.reshape(shape), db.reshape(shape), sign.to(torch.float32).reshape(shape)


def set_iq1_groups_on(blocks: np.ndarray, qtype: str, index: torch.Tensor) -> np.ndarray:
    """Copy of IQ1 `blocks` with each 8-weight group's codebook index replaced (index (..., groups per row), on any
    device); scales and delta signs are kept. The blocks come back as numpy."""
    dev = index.device
    flat = _iq1_flat(blocks, qtype, dev).clone()
    idx = index.long().reshape(-1, 32)
    if bool(((idx < 0) | (idx >= IQ1_ENTRIES)).any()):
        raise InputError(f"{qtype} codebook indices must lie in [0, {IQ1_ENTRIES - 1}]")
    hi = idx >> 8
    if qtype == "IQ1_S":
        flat[:, 2:34] = (idx & 255).to(torch.uint8)
        qh = _u16(flat[:, 34:50]) & 0xF000
        h = hi.reshape(-1, 8, 4)
        qh = qh | h[:, :, 0] | (h[:, :, 1] << 3) | (h[:, :, 2] << 6) | (h[:, :, 3] << 9)
        flat[:, 34:50] = torch.stack([qh & 255, qh >> 8], dim=2).reshape(-1, 16).to(torch.uint8)
    else:
        flat[:, 0:32] = (idx & 255).to(torch.uint8)
        h = hi.reshape(-1, 16, 2)
        qh = (flat[:, 32:48].long() & 0x88) | h[:, :, 0] | (h[:, :, 1] << 4)
        flat[:, 32:48] = qh.to(torch.uint8)
    return flat.cpu().numpy().reshape(np.shape(blocks))
