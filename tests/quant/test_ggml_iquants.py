"""i-quant grid encoders (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) against ggml's own quantizer.

Byte equality with ``ggml_quantize_chunk`` of llama-cpp-python 0.3.36's libggml-base on trained k256
tensors and edge-case rows, with and without an importance matrix (IQ2_XXS/XS only with one: ggml
aborts without), and decoding of our bytes by gguf-py and by ggml's ``to_float``.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from mixq.errors import InputError
from mixq.quant.ggml import encoders
from mixq.quant.ggml import libggml


def _encoder_cases():
    """The shared fixtures of tests/quant/test_ggml_encoders.py (tensor names, edge-case rows, imatrices)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("_encoder_cases", Path(__file__).with_name("test_ggml_encoders.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_cases = _encoder_cases()
REAL, load_real, real_imatrix = _cases.REAL, _cases.load_real, _cases.real_imatrix
tricky_imatrices, tricky_rows = _cases.tricky_imatrices, _cases.tricky_rows

IQ = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"]
SIZES = {"IQ2_XXS": 66, "IQ2_XS": 74, "IQ2_S": 82, "IQ3_XXS": 98, "IQ3_S": 110, "IQ1_S": 50, "IQ1_M": 56}
needs_ggml = pytest.mark.skipif(not libggml.available(),
                                reason="llama-cpp-python's libggml-base not installed (the ggml oracle)")


def imatrices_for(qtype: str, im: np.ndarray) -> list[np.ndarray | None]:
    return [im] if qtype in encoders.REQUIRES_IMATRIX else [None, im]


def block_mismatches(a: np.ndarray, b: np.ndarray, qtype: str) -> int:
    bs = SIZES[qtype]
    return int((a.reshape(-1, bs) != b.reshape(-1, bs)).any(1).sum())


class _Traits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p), ("from_float_ref", ctypes.c_void_p)]


def ggml_to_float(q: np.ndarray, qtype: str, n: int) -> np.ndarray:
    """ggml's own dequantizer (type traits' to_float) of rows of bytes q -> float32 (rows, n)."""
    lib = libggml._lib()
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    tr = lib.ggml_get_type_traits(int(GGMLQuantizationType[qtype])).contents
    assert tr.type_size == SIZES[qtype] and tr.blck_size == 256
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(tr.to_float)
    q = np.ascontiguousarray(q)
    out = np.empty((q.shape[0], n), np.float32)
    fn(q.ctypes.data, out.ctypes.data, out.size)
    return out


def test_block_sizes_match_gguf_py():
    for t in IQ:
        assert (encoders.block_size(t), encoders.type_size(t)) == (256, SIZES[t])
        assert encoders.row_bytes(t, 512) == 2 * SIZES[t]


def test_iq2_xxs_xs_refuse_without_imatrix():
    x = np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32)
    for t in ("IQ2_XXS", "IQ2_XS"):
        with pytest.raises(InputError, match=f"{t} needs an importance matrix"):
            encoders.quantize(x, t)


def test_codebook_tables_follow_ggml_rules():
    from mixq.quant.ggml.i_quants.numpy_iq2 import codebook

    for t, (n, nwant) in {"IQ2_XXS": (256, 2), "IQ2_S": (1024, 1), "IQ3_XXS": (256, 2)}.items():
        cb = codebook(t)
        assert cb.levels.shape[0] == n and (cb.kmap >= 0).sum() == n
        # each neighbour list is sorted by (integer distance, index) and spans exactly nwant distance shells
        row = int(np.argmax(cb.nb_len))
        code = int(np.nonzero(cb.nb_row == row)[0][0])
        lv = (code >> cb.shifts) & ((1 << int(cb.shifts[1])) - 1)
        nbs = cb.nb[row, :cb.nb_len[row]]
        d2 = ((2 * lv[None] + 1 - (2 * cb.levels[nbs] + 1)) ** 2).sum(1)
        assert np.all(np.diff(d2) >= 0) and len(np.unique(d2)) == nwant
        assert np.all(nbs[1:][d2[1:] == d2[:-1]] > nbs[:-1][d2[1:] == d2[:-1]])


@pytest.mark.parametrize("qtype", IQ)
def test_gguf_py_and_ggml_decode_our_bytes_alike(qtype):
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((4, 512)) * 0.02).astype(np.float32)
    im = rng.random(512).astype(np.float32) + 0.1
    q = encoders.quantize(x, qtype, im)
    assert q.shape == (4, 2 * SIZES[qtype])
    y = dequantize(q, GGMLQuantizationType[qtype])
    rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2))
    assert rel < {"IQ2_XXS": 0.6, "IQ2_XS": 0.55, "IQ2_S": 0.5, "IQ3_XXS": 0.35, "IQ3_S": 0.3}[qtype]
    if libggml.available():
        assert np.array_equal(ggml_to_float(q, qtype, 512), y)


@needs_ggml
@pytest.mark.parametrize("case", ["expert_gate", "expert_down", "attn_q"])
def test_k256_tensors_equal_ggml(k256_model, case):
    x = load_real(k256_model, REAL[case])
    im = real_imatrix(x.shape[1])
    for t in IQ:
        for imx in imatrices_for(t, im):
            got = encoders.quantize(x, t, imx)
            want = libggml.ggml_quantize(x, t, imx)
            assert block_mismatches(got, want, t) == 0, (t, imx is not None)


@needs_ggml
def test_edge_case_rows_equal_ggml():
    rows, where = tricky_rows()
    # ggml asserts (aborts the process) on rows whose squares overflow: leave those out
    keep = np.ones(len(rows), bool)
    keep[where["overflow"]] = False
    x = rows[keep]
    for im_name, im in tricky_imatrices().items():
        for t in IQ:
            if im is None and t in encoders.REQUIRES_IMATRIX:
                continue
            got = encoders.quantize(x, t, im)
            assert block_mismatches(got, libggml.ggml_quantize(x, t, im), t) == 0, (t, im_name)


def test_overflowing_rows_still_encode():
    rows, where = tricky_rows()
    x = rows[where["overflow"]]
    for t in IQ:
        q = encoders.quantize(x, t, np.ones(x.shape[1], np.float32))
        assert q.shape == (x.shape[0], encoders.row_bytes(t, x.shape[1]))


@needs_ggml
@pytest.mark.slow
def test_all_experts_of_a_layer_equal_ggml(k256_model):
    """Every routed expert matrix of one k256 layer (48 matrices, 12288 blocks per type)."""
    x = _cases.layer_experts(k256_model, 2)
    im = real_imatrix(x.shape[1])
    for t in IQ:
        for imx in imatrices_for(t, im):
            assert block_mismatches(encoders.quantize(x, t, imx), libggml.ggml_quantize(x, t, imx), t) == 0
