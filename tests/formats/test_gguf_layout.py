"""formats/gguf_layout: the ggml types' sizes and lists agree with gguf-py, ggml's facts and the encoder registry."""
from __future__ import annotations

import pytest

from mixq.errors import FormatError
from mixq.formats import gguf_layout as gl
from mixq.quant.ggml.registry import REGISTRY, REQUIRES_IMATRIX


def test_sizes():
    assert gl.block_shape("Q4_K") == (256, 144) and gl.block_shape("q8_0") == (32, 34)
    assert gl.bits_per_weight("Q4_K") == 4.5 and gl.bits_per_weight("BF16") == 16
    assert gl.row_bytes("Q6_K", 512) == 420
    assert gl.tensor_bytes("Q4_K", (288, 2048, 4096)) == 288 * 2048 * 16 * 144
    assert gl.tensor_bytes("F32", (7,)) == 28 and gl.tensor_bytes("F16", ()) == 2


def test_ids_and_names():
    assert [gl.type_id(t) for t in ("F32", "F16", "Q8_0", "Q4_K", "IQ2_XXS", "BF16")] == [0, 1, 8, 12, 16, 30]
    assert gl.type_name(23) == "IQ4_XS"
    with pytest.raises(FormatError, match="unknown GGML type"):
        gl.ggml_type("Q9_K")
    with pytest.raises(FormatError, match="unknown ggml type id"):
        gl.type_name(1000)


def test_ragged_rows_are_refused():
    with pytest.raises(FormatError, match="row length 100 is not a multiple of the Q4_K block size 256"):
        gl.tensor_bytes("Q4_K", (4, 100))


def test_lists():
    assert gl.FLOAT_TYPES == ("F32", "F16", "BF16") and not any(gl.is_quantized(t) for t in gl.FLOAT_TYPES)
    assert gl.is_quantized("IQ4_NL") and not gl.is_quantized("i32")
    assert set(gl.GGML_REQUIRES_IMATRIX) <= set(gl.QUANTIZE_REQUIRES_IMATRIX)
    assert REQUIRES_IMATRIX == tuple(t for t in REGISTRY if t in gl.GGML_REQUIRES_IMATRIX) == ("IQ2_XXS", "IQ2_XS",
                                                                                         "IQ1_S")
    for name, t in REGISTRY.items():
        assert (t.block_weights, t.block_bytes) == gl.block_shape(name)
