"""The ggml types of a GGUF file: names and ids, block layout, byte sizes, and which types need an importance matrix.

One place for what the planner (planning/gguf_mix), the writer and readers (formats/gguf_*), the encoders
(quant/ggml) and the converter (conversion/gguf) must agree on. Block layouts are gguf-py's size table (the same
numbers as ggml's type traits); the rest are facts of ../shared/reference/gguf-facts.md §1.1 (tensor size),
§3 (type ids, block layouts) and §3.14 (imatrix requirements).
"""
from __future__ import annotations

from typing import Sequence

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from mixq.errors import FormatError

# the float types: stored by a plain cast, never block-quantized
FLOAT_TYPES: tuple[str, ...] = ("F32", "F16", "BF16")
# every type that is not block-quantized: the floats and the plain numeric types (V:ggml/include/ggml.h:398-420)
PLAIN_TYPES: tuple[str, ...] = FLOAT_TYPES + ("F64", "I8", "I16", "I32", "I64")
# ggml's encoder asserts importance data for these, token_embd/output included (V:ggml/src/ggml.c:8059-8065,
# ggml_quantize_requires_imatrix)
GGML_REQUIRES_IMATRIX: tuple[str, ...] = ("IQ1_S", "IQ2_XXS", "IQ2_XS")
# llama-quantize refuses these target types for a tensor without importance data, token_embd/output excepted
# unless ggml itself requires it (V:src/llama-quant.cpp:856-875)
QUANTIZE_REQUIRES_IMATRIX: tuple[str, ...] = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS")


def ggml_type(name: str) -> GGMLQuantizationType:
    """gguf-py's enum for a ggml type name ("q4_k" -> Q4_K); FormatError for an unknown name."""
    try:
        return GGMLQuantizationType[str(name).upper()]
    except KeyError:
        raise FormatError(f"unknown GGML type {name!r}") from None


def type_id(name: str) -> int:
    """The ggml type id stored in a tensor info (F32 0, F16 1, Q4_K 12, BF16 30, ...)."""
    return int(ggml_type(name))


def type_name(type_id_: int) -> str:
    """The ggml type name of a stored type id; FormatError for an id ggml does not define."""
    try:
        return GGMLQuantizationType(int(type_id_)).name
    except ValueError:
        raise FormatError(f"unknown ggml type id {type_id_}") from None


def block_shape(name: str) -> tuple[int, int]:
    """(weights per block, bytes per block) of a ggml type (1 weight per "block" for the plain types)."""
    return GGML_QUANT_SIZES[ggml_type(name)]


def block_weights(name: str) -> int:
    """Weights per block: 32 for Q8_0/Q4_0/IQ4_NL, 256 for the K-quants and the 256-weight i-quants."""
    return block_shape(name)[0]


def block_bytes(name: str) -> int:
    """Bytes per block."""
    return block_shape(name)[1]


def bits_per_weight(name: str) -> float:
    """Storage bits per weight of a ggml type (Q4_K 4.5, Q8_0 8.5, F16 16)."""
    b, s = block_shape(name)
    return 8.0 * s / b


def is_quantized(name: str) -> bool:
    """Whether a ggml type is block-quantized (not a float or plain numeric type)."""
    return str(name).upper() not in PLAIN_TYPES


def row_bytes(name: str, n: int) -> int:
    """Bytes of one stored row of ``n`` weights; FormatError when ``n`` is not a multiple of the block."""
    b, s = block_shape(name)
    if int(n) % b:
        raise FormatError(f"row length {int(n)} is not a multiple of the {str(name).upper()} block size {b}")
    return int(n) // b * s


def tensor_bytes(name: str, shape: Sequence[int]) -> int:
    """Bytes of a tensor of numpy ``shape`` (outermost first; a row is ``shape[-1]`` = ne0) stored as ``name``:
    (ne0 / block) · block bytes · ne1 · ne2 · ne3 (gguf-facts.md §1.1)."""
    ne0 = int(shape[-1]) if len(shape) else 1
    rows = 1
    for d in shape[:-1]:
        rows *= int(d)
    return rows * row_bytes(name, ne0)
