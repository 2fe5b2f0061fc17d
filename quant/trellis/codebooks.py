"""EXL3 trellis codebooks and the per-tile bitstream layout.

Facts from ../shared/reference/exl3-format.md §2.2-2.5: a 16-bit trellis state maps to one fp16 weight through
one of three codebooks (3INST, MCG, MUL1); a 16×16 tile is a tail-biting ring of bits whose positions run in
tensor-core order; the ring is stored MSB-first in little-endian uint32 words (int16 pairs swapped).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from ...errors import InputError

CODEBOOKS = ("mul1", "3inst", "mcg")
MUL1_MULT = 0x83DCD12D
MCG_MULT = 0xCBAC1FED
# Marker tensors are int32 scalars holding the multiplier's bit pattern (reference §1.4).
MARKER_VALUES = {"mul1": MUL1_MULT - (1 << 32), "mcg": MCG_MULT - (1 << 32)}
CODEBOOK_STD = {"mul1": 1.000310, "3inst": 1.243711, "mcg": 1.244112}
HALF_RATES = (1.5, 2.5, 3.5)


def canonical_codebook(name: str) -> str:
    """Normalise a codebook name ('MUL1', '3INST', ...) or raise InputError."""
    key = str(name).lower()
    if key not in CODEBOOKS:
        raise InputError(f"unknown trellis codebook {name!r}; expected one of {CODEBOOKS}")
    return key


def check_bits(bits: float, codebook: str) -> float:
    """Validate a bitrate K (1..8, or 1.5/2.5/3.5 with mul1) and return it as float."""
    try:
        k = float(bits)
    except (TypeError, ValueError):
        raise InputError(f"trellis bits must be a number, got {bits!r}") from None
    if k in HALF_RATES:
        if codebook != "mul1":
            raise InputError(f"half bitrate {k} needs the mul1 codebook, not {codebook}")
        return k
    if k != int(k) or not 1 <= k <= 8:
        raise InputError(f"trellis bits must be 1..8 or 1.5/2.5/3.5, got {bits!r}")
    return k


@lru_cache(maxsize=None)
def _table_np(codebook: str) -> np.ndarray:
    s = np.arange(65536, dtype=np.uint64)
    mask32 = np.uint64(0xFFFFFFFF)
    if codebook == "mul1":
        x = (s * np.uint64(MUL1_MULT)) & mask32
        t = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
        h = (1024 + t).astype(np.float32)
        k_inv = np.array([0x1EEE], dtype=np.uint16).view(np.float16).astype(np.float32)[0]
        k_bias = np.array([0xC931], dtype=np.uint16).view(np.float16).astype(np.float32)[0]
        # h·k_inv + k_bias is exact in fp32 (22 significant bits), so one cast = the fma's single rounding.
        return (h * k_inv + k_bias).astype(np.float16)
    if codebook == "3inst":
        x = (s * np.uint64(89226354) + np.uint64(64248484)) & mask32
    else:
        x = (s * np.uint64(MCG_MULT)) & mask32
    x = (x & np.uint64(0x8FFF8FFF)) ^ np.uint64(0x3B603B60)
    lo = (x & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)
    hi = (x >> 16).astype(np.uint16).view(np.float16).astype(np.float32)
    return (lo + hi).astype(np.float16)  # fp32 add then one rounding == the fp16 add (§2.5)


def codebook_table(codebook: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """All 65536 decoded values (fp16-exact, returned as float32) of a codebook, indexed by state."""
    return _table_cached(canonical_codebook(codebook), str(torch.device(device)))


@lru_cache(maxsize=None)
def _table_cached(codebook: str, device: str) -> torch.Tensor:
    return torch.from_numpy(_table_np(codebook).astype(np.float32)).to(device)


def decode_states(states: torch.Tensor, codebook: str) -> torch.Tensor:
    """Map integer states (any shape, 0..65535) to float32 weights."""
    table = codebook_table(codebook, states.device)
    return table[states.long()]


# ---------------------------------------------------------------------------------------------------------------
# Tile layout

@lru_cache(maxsize=None)
def tensor_core_perm() -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each trellis position p in its 16×16 tile (reference §2.2); row = input direction."""
    p = torch.arange(256)
    lane, j = p >> 3, p & 7
    r = 2 * (lane % 4) + (j & 1) + 8 * ((j >> 1) & 1)
    c = (lane >> 2) + 8 * ((j >> 2) & 1)
    return r, c


@lru_cache(maxsize=None)
def _tile_order(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major index of each tile position, and its inverse, on ``device`` (built once: the LDLQ loop
    converts every strip, and a host-to-device copy per call would stall it)."""
    r, c = tensor_core_perm()
    flat = r * 16 + c
    inv = torch.empty(256, dtype=torch.long)
    inv[flat] = torch.arange(256)
    return flat.to(device), inv.to(device)


def tiles_from_matrix(w: torch.Tensor) -> torch.Tensor:
    """(..., k, n) matrix → (..., k/16, n/16, 256) tiles, each in tensor-core position order."""
    *lead, k, n = w.shape
    t = w.reshape(*lead, k // 16, 16, n // 16, 16).transpose(-3, -2)  # (..., a, c, r, col)
    flat, _ = _tile_order(str(w.device))
    return t.reshape(*lead, k // 16, n // 16, 256)[..., flat]


def matrix_from_tiles(t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`tiles_from_matrix`: (..., a, c, 256) → (..., 16a, 16c)."""
    *lead, ta, tc, _ = t.shape
    _, inv = _tile_order(str(t.device))
    rowmajor = t[..., inv].reshape(*lead, ta, tc, 16, 16)
    return rowmajor.transpose(-3, -2).reshape(*lead, ta * 16, tc * 16)


@lru_cache(maxsize=None)
def step_bits(bits: float) -> tuple[int, ...]:
    """D(p): new bits per position; half rates give the odd positions one extra bit (§2.4)."""
    ka = int(bits)
    if bits == ka:
        return (ka,) * 256
    return tuple(ka + (p & 1) for p in range(256))


def words_per_tile(bits: float) -> int:
    """int16 words stored per tile: 16·K (16·⌊K⌋+8 for half rates)."""
    return int(round(16 * bits))


@lru_cache(maxsize=None)
def _ring_index(bits: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index tables: per position the ring window start; per ring bit its position and shift."""
    d = torch.tensor(step_bits(bits))
    ends = torch.cumsum(d, 0)  # E(p)
    ring = int(ends[-1])
    start = (ends - 16) % ring
    pos_of_bit = torch.repeat_interleave(torch.arange(256), d)
    # bit j (0 = first, most significant) of position p's D(p) new bits holds state bit D(p)-1-j
    first = ends - d
    shift = d[pos_of_bit] - 1 - (torch.arange(ring) - first[pos_of_bit])
    return start, pos_of_bit, shift, torch.tensor(ring)


def pack_states(states: torch.Tensor, bits: float) -> torch.Tensor:
    """(..., 256) consistent ring states → (..., 16K) int16 words in the EXL3 storage order."""
    start, pos_of_bit, shift, ring = _ring_index(bits)
    dev = states.device
    s = states.to(torch.int64)
    ringbits = (s[..., pos_of_bit.to(dev)] >> shift.to(dev)) & 1  # (..., R)
    nwords = int(ring) // 32
    wbits = ringbits.reshape(*s.shape[:-1], nwords, 32)
    weights = (1 << torch.arange(31, -1, -1, device=dev, dtype=torch.int64))
    u32 = (wbits * weights).sum(-1)  # MSB-first uint32 words
    lo, hi = u32 & 0xFFFF, u32 >> 16
    u16 = torch.stack([lo, hi], -1).reshape(*s.shape[:-1], 2 * nwords)  # little-endian halves
    return torch.where(u16 >= 32768, u16 - 65536, u16).to(torch.int16)


def unpack_states(words: torch.Tensor, bits: float) -> torch.Tensor:
    """(..., 16K) int16 words → (..., 256) int64 states read off the ring (§2.6 step 2)."""
    start, _, _, ring = _ring_index(bits)
    dev = words.device
    u16 = words.to(torch.int64) & 0xFFFF
    u32 = u16[..., 0::2] | (u16[..., 1::2] << 16)
    nwords = u32.shape[-1]
    st = start.to(dev)
    w = st // 32
    off = st % 32
    pair = (u32[..., w] << 32) | u32[..., (w + 1) % nwords]  # 64-bit window, never crosses 2 words
    return (pair >> (48 - off)) & 0xFFFF


def shift_register_states(symbols: torch.Tensor, bits: float) -> torch.Tensor:
    """Reference recursion s_p = ((s_{p-1} << D(p)) | v_p) & 0xFFFF around the ring (test helper)."""
    d = step_bits(bits)
    v = symbols.to(torch.int64)
    s = torch.zeros(v.shape[:-1], dtype=torch.int64, device=v.device)
    for _ in range(2):  # second lap makes the wrap-around state exact (16 bits ≤ one lap)
        out = []
        for p in range(256):
            s = ((s << d[p]) | v[..., p]) & 0xFFFF
            out.append(s)
    return torch.stack(out, -1)
