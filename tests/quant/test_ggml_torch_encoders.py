"""The torch encoders (mixq.quant.ggml.torch_encoders*) give ggml's bytes on CPU and, with ``-m gpu``, on CUDA.

CPU: the recorded ggml digests of tests/data/ggml_digests.json (edge-case rows, every type, four
imatrices) and, for the lattice i-quants (not recorded), equality with the numpy encoders that
tests/quant/test_ggml_iquants.py proves equal to ggml. GPU: the same digests and comparisons on CUDA,
every k256 tensor of the digest set, a whole layer of experts per type, and the ``device=`` API.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from mixq.errors import InputError
from mixq.quant.ggml import encoders
from mixq.quant.ggml import libggml
from mixq.quant.ggml import torch_encoders


def _encoder_cases():
    """The shared fixtures of tests/quant/test_ggml_encoders.py (digests, edge-case rows, tensor names)."""
    spec = importlib.util.spec_from_file_location("_encoder_cases_torch",
                                                  Path(__file__).with_name("test_ggml_encoders.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_cases = _encoder_cases()
IQ = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"]
CUDA = "cuda"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _encoder(device: str):
    """encoders.quantize signature over the torch path on ``device``."""
    def encode(x: np.ndarray, qtype: str, imatrix: np.ndarray | None) -> np.ndarray:
        im = None if imatrix is None else torch.from_numpy(np.asarray(imatrix, np.float32))
        return encoders.quantize_tensor(torch.from_numpy(x).to(device), qtype, im).cpu().numpy()
    return encode


@pytest.fixture(scope="module")
def digests() -> dict:
    import json
    return json.loads(_cases.DIGESTS.read_text())


def _tricky_digest_mismatches(device: str, digests: dict) -> list[str]:
    x, where, imats = _cases.load_tricky()
    assert _cases.sha(x) == digests["inputs"]["tricky"]
    got = _cases._digests_of(_encoder(device), x, where, imats, "tricky")
    assert len(got) == len(_cases.TYPES) * 4 * len(where)
    return _cases._mismatches(digests["outputs"], got)


def _iq_mismatches(device: str, x: np.ndarray, imats: dict) -> list[tuple[str, str]]:
    """(type, imatrix name) pairs whose torch bytes on ``device`` differ from the numpy encoders'."""
    bad = []
    for t in IQ:
        for name, im in imats.items():
            if im is None and t in encoders.REQUIRES_IMATRIX:
                continue
            if not np.array_equal(_encoder(device)(x, t, im), encoders.quantize(x, t, im)):
                bad.append((t, name))
    return bad


def test_registry_covers_every_supported_type():
    assert set(torch_encoders.TYPES) == set(encoders.SUPPORTED)


def test_cpu_edge_case_rows_match_recorded_ggml(digests):
    assert _tricky_digest_mismatches("cpu", digests) == []


def test_cpu_lattice_iquants_equal_numpy_on_edge_case_rows():
    x, _, imats = _cases.load_tricky()
    # two of the four imatrices keep the default suite short (CUDA runs all four)
    assert _iq_mismatches("cpu", x, {k: imats[k] for k in ("none", "spiky")}) == []


@pytest.mark.slow
def test_cpu_k256_expert_matches_recorded_ggml(digests, k256_model):
    case = "expert_down"
    x = _cases.load_real(k256_model, _cases.REAL[case])
    got = _cases._digests_of(_encoder("cpu"), x, {case: slice(None)},
                             {"none": None, "imatrix": _cases.real_imatrix(x.shape[1])}, "real")
    assert len(got) == 2 * len(_cases.TYPES)
    assert _cases._mismatches(digests["outputs"], got) == []


def test_per_row_imatrix_equals_stacked_numpy():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 4, 512)).astype(np.float32)
    im = rng.random((3, 512)).astype(np.float32)
    xt = torch.from_numpy(x).reshape(12, 512)
    it = torch.from_numpy(im)[:, None].expand(3, 4, 512).reshape(12, 512)
    for t in ("Q4_K", "IQ2_S", "Q5_1", "IQ4_NL"):
        got = encoders.quantize_tensor(xt, t, it).numpy().reshape(3, 4, -1)
        assert np.array_equal(got, encoders.quantize_stacked(x, t, im)), t


def test_stacked_experts_in_groups_equal_numpy(monkeypatch):
    """The accelerator path of quantize_stacked (groups of experts per call), run on CPU tensors."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((5, 4, 512)).astype(np.float32)
    im = rng.random((5, 512)).astype(np.float32)
    monkeypatch.setattr(torch_encoders, "chunk_weights", lambda qtype, device: 2 * 4 * 512)  # two experts a call
    for t, imx in (("Q4_K", im), ("IQ4_NL", None)):
        got = encoders._quantize_stacked_on(torch.device("cpu"), x, t, imx)
        assert np.array_equal(got, encoders.quantize_stacked(x, t, imx)), t


def test_chunking_does_not_change_bytes():
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((6, 512)).astype(np.float32))
    im = torch.from_numpy(np.random.default_rng(6).random(512).astype(np.float32))
    for t in ("Q3_K", "IQ3_S", "Q4_1"):
        whole = torch_encoders.encode(x, t, im, encoders.row_bytes(t, 512), chunk=1 << 20)
        one_row = torch_encoders.encode(x, t, im, encoders.row_bytes(t, 512), chunk=512)
        assert torch.equal(whole, one_row), t


def test_bad_input_is_refused_naming_the_problem():
    with pytest.raises(InputError, match="multiple of 256"):
        encoders.quantize_tensor(torch.zeros(2, 96), "Q4_K")
    with pytest.raises(InputError, match="NaN"):
        encoders.quantize_tensor(torch.full((1, 256), float("nan")), "Q4_K")
    with pytest.raises(InputError, match="imatrix has shape"):
        encoders.quantize_tensor(torch.zeros(2, 256), "Q4_K", torch.ones(3, 256))
    with pytest.raises(InputError, match="IQ2_XS needs an importance matrix"):
        encoders.quantize_tensor(torch.zeros(2, 256), "IQ2_XS")
    with pytest.raises(InputError, match="unknown device 'tpu9'"):
        encoders.quantize(np.zeros((2, 256), np.float32), "Q4_K", device="tpu9")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="no CUDA device"):
            encoders.quantize(np.zeros((2, 256), np.float32), "Q4_K", device="cuda")


# ----------------------------------------------------------------------------- CUDA

@pytest.mark.gpu
@needs_cuda
def test_cuda_edge_case_rows_match_recorded_ggml(digests):
    assert _tricky_digest_mismatches(CUDA, digests) == []


@pytest.mark.gpu
@needs_cuda
def test_cuda_eager_path_matches_recorded_ggml(digests, monkeypatch):
    monkeypatch.setenv("MIXQ_KQUANT_FUSED", "0")  # every search in elementwise torch ops
    assert _tricky_digest_mismatches(CUDA, digests) == []
    x, where, imats = _cases.load_tricky()
    keep = np.ones(len(x), bool)
    keep[where["overflow"]] = False
    assert _iq_mismatches(CUDA, x[keep], {k: imats[k] for k in ("none", "spiky")}) == []


@pytest.mark.gpu
@needs_cuda
def test_cuda_lattice_iquants_equal_numpy_on_edge_case_rows():
    x, where, imats = _cases.load_tricky()
    keep = np.ones(len(x), bool)
    keep[where["overflow"]] = False  # ggml aborts on these; the overflow rows are checked just below
    assert _iq_mismatches(CUDA, x[keep], imats) == []


@pytest.mark.gpu
@needs_cuda
def test_cuda_lattice_iquants_equal_numpy_on_overflowing_rows():
    x, where, imats = _cases.load_tricky()
    assert _iq_mismatches(CUDA, x[where["overflow"]], imats) == []


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", sorted(_cases.REAL))
def test_cuda_k256_tensors_match_recorded_ggml(digests, k256_model, case):
    x = _cases.load_real(k256_model, _cases.REAL[case])
    got = _cases._digests_of(_encoder(CUDA), x, {case: slice(None)},
                             {"none": None, "imatrix": _cases.real_imatrix(x.shape[1])}, "real")
    assert _cases._mismatches(digests["outputs"], got) == []
    im = _cases.real_imatrix(x.shape[1])
    if x.shape[1] % 256 == 0:
        assert _iq_mismatches(CUDA, x, {"none": None, "imatrix": im}) == []


@pytest.mark.gpu
@needs_cuda
def test_cuda_every_expert_of_a_layer_equals_ggml(k256_model):
    """All routed experts of one k256 layer, every type, +-imatrix: CUDA bytes = ggml's (numpy's without ggml)."""
    x = _cases.layer_experts(k256_model, 2)
    im = _cases.real_imatrix(x.shape[1])
    oracle = libggml.ggml_quantize if libggml.available() else encoders.quantize
    for t in encoders.SUPPORTED:
        for imx in (None, im):
            if imx is None and t in encoders.REQUIRES_IMATRIX:
                continue
            assert np.array_equal(encoders.quantize(x, t, imx, device=CUDA), oracle(x, t, imx)), (t, imx is not None)


@pytest.mark.gpu
@needs_cuda
def test_cuda_stacked_experts_in_one_call_equal_cpu(k256_model):
    x = _cases.layer_experts(k256_model, 1).reshape(-1, 256, 256)[:8]
    im = np.exp(np.random.default_rng(1).standard_normal((8, 256))).astype(np.float32)
    for t in ("Q4_K", "IQ2_S", "IQ4_NL", "Q8_0"):
        assert np.array_equal(encoders.quantize_stacked(x, t, im, device=CUDA), encoders.quantize_stacked(x, t, im)), t
