"""The EXL3 storage layout of exllamav3 1.6.5: constants and pure shape / byte arithmetic (no mixq imports).

One place for what the planner (planning/allocator), the unit table (formats/exl3_names), the writers, the trellis
decoder and verify must agree on. Facts: ../shared/reference/exl3-format.md §1.1 (shard names), §1.4 (the tensors
of a quantized Linear), §1.6 (padding), §4.1 (rates).
"""
from __future__ import annotations

PAD = 128                # Linear(pad_to=128): both dims of a quantized Linear rounded up to multiples of this
TILE = 16                # the trellis encodes 16x16 tiles
RATES: tuple[float, ...] = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0)  # bits per weight K
MUL1_MULTIPLIER = 0x83DCD12D
MCG_MULTIPLIER = 0xCBAC1FED
# the int32 scalar stored as `<key>.mul1` / `<key>.mcg`: the multiplier's bit pattern
MUL1_MARKER = MUL1_MULTIPLIER - (1 << 32)
MCG_MARKER = MCG_MULTIPLIER - (1 << 32)
MARKERS = {"mul1": MUL1_MARKER, "mcg": MCG_MARKER}
SHARD_SIZE = 8192 * 2**20  # default shard size (bytes) of an output directory


def pad_up(n: int, to: int = PAD) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-int(n) // to) * to


def trellis_words(bits: float) -> int:
    """int16 words per 16x16 tile at ``bits`` per weight: 16·K (half rates: 16·⌊K⌋ + 8)."""
    return int(round(TILE * bits))


def trellis_shape(k: int, n: int, bits: float) -> tuple[int, int, int]:
    """Shape of ``<key>.trellis`` for a padded Linear of ``k`` inputs and ``n`` outputs."""
    return (k // TILE, n // TILE, trellis_words(bits))


def linear_tensors(key: str, k: int, n: int, bits: float, *, bias: bool = False,
                   marker: str | None = "mul1") -> dict[str, tuple[tuple[int, ...], str]]:
    """Every stored tensor of a quantized Linear (padded ``k`` x ``n``): name -> (shape, dtype name)."""
    d = {f"{key}.trellis": (trellis_shape(k, n, bits), "int16"),
         f"{key}.suh": ((k,), "float16"), f"{key}.svh": ((n,), "float16")}
    if marker:
        d[f"{key}.{marker}"] = ((), "int32")
    if bias:
        d[f"{key}.bias"] = ((n,), "float16")
    return d


def shard_count(total_bytes: int, shard_size: int = SHARD_SIZE) -> int:
    """Shards an output of ``total_bytes`` tensor data needs (at least one)."""
    return max(1, -(-int(total_bytes) // int(shard_size)))


def shard_names(n: int) -> list[str]:
    """``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` for several shards."""
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
