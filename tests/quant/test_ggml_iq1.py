"""IQ1_S and IQ1_M encoders against ggml's own quantizer.

Byte equality with ``ggml_quantize_chunk`` of llama-cpp-python 0.3.36's libggml-base on trained k256 tensors and
edge-case rows (IQ1_S only with an importance matrix: ggml aborts without one; IQ1_M with and without), and decoding
of our bytes by gguf-py and by ggml's ``to_float``. The default suite checks digests recorded from ggml
(tests/data/ggml_iq1_digests.json: ggml builds its IQ1 neighbour tables for longer than these tests run); the
``slow`` tests compare with the C library live. Re-record with ``python tests/quant/test_ggml_iq1.py --record``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from mixq.errors import InputError
from mixq.quant.ggml import encoders, libggml


def _helpers():
    """The shared fixtures of the other encoder tests (tensor names, edge-case rows, imatrices, ggml's decoder)."""
    import importlib.util

    out = []
    for name in ("test_ggml_encoders.py", "test_ggml_iquants.py"):
        spec = importlib.util.spec_from_file_location(f"_iq1_{name[:-3]}", Path(__file__).with_name(name))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out.append(mod)
    return out


_cases, _iq = _helpers()
IQ1 = ["IQ1_S", "IQ1_M"]
SIZES = {t: _iq.SIZES[t] for t in IQ1}
DIGESTS = Path(__file__).resolve().parent.parent / "data" / "ggml_iq1_digests.json"
REAL_CASES = ("expert_gate", "attn_q")
needs_ggml = _iq.needs_ggml
imatrices_for, block_mismatches = _iq.imatrices_for, _iq.block_mismatches  # SIZES there has the IQ1 blocks


def _digests_of(encode, x: np.ndarray, where: dict[str, slice], imats: dict, tag: str) -> dict[str, str]:
    out = {}
    for t in IQ1:
        for im_name, im in imats.items():
            if im is None and t in encoders.REQUIRES_IMATRIX:
                continue
            q = encode(x, t, im)
            for case, sl in where.items():
                out[f"{tag}:{case}|{t}|{im_name}"] = _cases.sha(q[sl])
    return out


def _tricky() -> tuple[np.ndarray, dict[str, slice], dict]:
    """The recorded edge-case rows without the overflowing ones (ggml aborts on those), their slices, imatrices."""
    x, where, imats = _cases.load_tricky()
    keep = np.ones(len(x), bool)
    keep[where.pop("overflow")] = False
    pos = np.cumsum(keep) - 1
    return x[keep], {k: slice(int(pos[s.start]), int(pos[s.stop - 1]) + 1) for k, s in where.items()}, imats


def _real(model_dir: Path, case: str) -> tuple[np.ndarray, dict]:
    x = _cases.load_real(model_dir, _cases.REAL[case])
    return x, {"none": None, "imatrix": _cases.real_imatrix(x.shape[1])}


def record(model_dir: Path) -> None:
    """Write tests/data/ggml_iq1_digests.json from ggml's own quantizer."""
    x, where, imats = _tricky()
    data = {"inputs": {"tricky": _cases.sha(x)}, "outputs": _digests_of(libggml.ggml_quantize, x, where, imats, "tricky")}
    for case in REAL_CASES:
        a, ims = _real(model_dir, case)
        data["inputs"][case] = _cases.sha(a)
        data["outputs"].update(_digests_of(libggml.ggml_quantize, a, {case: slice(None)}, ims, "real"))
    DIGESTS.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")


@pytest.fixture(scope="module")
def digests() -> dict:
    return json.loads(DIGESTS.read_text())


def _mismatches(expected: dict, got: dict) -> list[str]:
    assert set(got) <= set(expected)
    return [k for k, v in got.items() if expected[k] != v]


def test_edge_case_rows_match_recorded_ggml(digests):
    x, where, imats = _tricky()
    assert _cases.sha(x) == digests["inputs"]["tricky"]
    got = _digests_of(encoders.quantize, x, where, imats, "tricky")
    assert len(got) == 7 * len(where)
    assert _mismatches(digests["outputs"], got) == []


@pytest.mark.parametrize("case", REAL_CASES)
def test_k256_tensors_match_recorded_ggml(digests, k256_model, case):
    x, ims = _real(k256_model, case)
    assert _cases.sha(x) == digests["inputs"][case], "fixture tensor changed; re-record"
    got = _digests_of(encoders.quantize, x, {case: slice(None)}, ims, "real")
    assert len(got) == 3 and _mismatches(digests["outputs"], got) == []


def _on(device: str):
    """encoders.quantize's signature over the torch encoders on ``device``."""
    def encode(x: np.ndarray, qtype: str, imatrix: np.ndarray | None) -> np.ndarray:
        return encoders.quantize(x, qtype, imatrix, device=device)
    return encode


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bytes_match_recorded_ggml(digests, k256_model):
    x, where, imats = _tricky()
    got = _digests_of(_on("cuda"), x, where, imats, "tricky")
    for case in REAL_CASES:
        a, ims = _real(k256_model, case)
        got.update(_digests_of(_on("cuda"), a, {case: slice(None)}, ims, "real"))
    assert len(got) == 7 * len(where) + 3 * len(REAL_CASES) and _mismatches(digests["outputs"], got) == []


def test_layout_and_imatrix_rule():
    for t in IQ1:
        assert (encoders.block_size(t), encoders.type_size(t)) == (256, SIZES[t])
    assert "IQ1_S" in encoders.REQUIRES_IMATRIX and "IQ1_M" not in encoders.REQUIRES_IMATRIX
    x = np.random.default_rng(1).standard_normal((1, 256)).astype(np.float32)
    with pytest.raises(InputError, match="IQ1_S needs an importance matrix"):
        encoders.quantize(x, "IQ1_S")


def test_codebook_is_ggml_ternary_grid():
    """2048 ternary entries; the off-codebook tuples' neighbour lists span the three nearest distance shells."""
    from mixq.quant.ggml.i_quants.numpy_iq2 import codebook

    cb = codebook("IQ1_S")
    assert cb.levels.shape == (2048, 8) and set(np.unique(cb.levels)) == {0, 1, 2}
    assert (cb.kmap >= 0).sum() == 2048 and len(cb.nb_len) == 3 ** 8 - 2048
    row = int(np.argmax(cb.nb_len))
    code = int(np.nonzero(cb.nb_row == row)[0][0])
    lv = (code >> cb.shifts) & 3
    nbs = cb.nb[row, :cb.nb_len[row]]
    d2 = ((2 * lv[None] - 2 * cb.levels[nbs]) ** 2).sum(1)
    assert np.all(np.diff(d2) >= 0) and len(np.unique(d2)) == 3


@pytest.mark.parametrize("qtype", IQ1)
def test_gguf_py_and_ggml_decode_our_bytes_alike(qtype):
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((2, 512)) * 0.02).astype(np.float32)
    im = rng.random(512).astype(np.float32) + 0.1
    q = encoders.quantize(x, qtype, im)
    assert q.shape == (2, 2 * SIZES[qtype])
    y = dequantize(q, GGMLQuantizationType[qtype])
    rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2))
    assert rel < {"IQ1_S": 0.75, "IQ1_M": 0.7}[qtype]
    if libggml.available():     # ggml's decoder builds no search tables
        assert np.array_equal(_iq.ggml_to_float(q, qtype, 512), y)


@needs_ggml
@pytest.mark.slow
@pytest.mark.parametrize("case", REAL_CASES)
def test_live_k256_tensors_equal_ggml(k256_model, case):
    x = _cases.load_real(k256_model, _cases.REAL[case])
    im = _cases.real_imatrix(x.shape[1])
    for t in IQ1:
        for imx in imatrices_for(t, im):
            got = encoders.quantize(x, t, imx)
            assert block_mismatches(got, libggml.ggml_quantize(x, t, imx), t) == 0, (t, imx is not None)


@needs_ggml
@pytest.mark.slow
def test_live_edge_case_rows_equal_ggml():
    rows, where = _cases.tricky_rows()
    keep = np.ones(len(rows), bool)
    keep[where["overflow"]] = False     # ggml asserts (aborts the process) on rows whose squares overflow
    x = rows[keep]
    for im_name, im in _cases.tricky_imatrices().items():
        for t in IQ1:
            if im is None and t in encoders.REQUIRES_IMATRIX:
                continue
            got = encoders.quantize(x, t, im)
            assert block_mismatches(got, libggml.ggml_quantize(x, t, im), t) == 0, (t, im_name)


def test_overflowing_rows_still_encode():
    rows, where = _cases.tricky_rows()
    x = rows[where["overflow"]]
    for t in IQ1:
        q = encoders.quantize(x, t, np.ones(x.shape[1], np.float32))
        assert q.shape == (x.shape[0], encoders.row_bytes(t, x.shape[1]))


@needs_ggml
@pytest.mark.slow
def test_live_all_experts_of_a_layer_equal_ggml(k256_model):
    """Every routed expert matrix of one k256 layer (48 matrices, 12288 blocks per type)."""
    x = _cases.layer_experts(k256_model, 2)
    im = _cases.real_imatrix(x.shape[1])
    for t in IQ1:
        for imx in imatrices_for(t, im):
            assert block_mismatches(encoders.quantize(x, t, imx), libggml.ggml_quantize(x, t, imx), t) == 0


if __name__ == "__main__" and "--record" in sys.argv:
    record(Path(__file__).resolve().parents[3] / "shared" / "models" / "glm5next-k256")
    print("wrote", DIGESTS)
