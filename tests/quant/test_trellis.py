"""Trellis encoder: round trip, padding, stacked experts, distortion vs the R-D bound, LDLQ, determinism.

The CPU Viterbi costs tens of ms per 16×16 tile and pass, so every encode here is a single 128×128 block
(64 tiles) and encodes are shared between tests; larger tables live in bench/speed/trellis.py (the H200 figures).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mixq.quant.trellis import codebooks as cb
from mixq.quant.trellis import ldlq
from mixq.quant import trellis
from mixq.quant.trellis import viterbi

DATA = Path(__file__).resolve().parent.parent / "data"
_CACHE: dict = {}


def _gauss(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _encode_gauss(bits):
    if bits not in _CACHE:
        w = _gauss((128, 128), 100 + int(bits))
        _CACHE[bits] = (w, trellis.quantize(w, bits, seed=3))
    return _CACHE[bits]


@pytest.fixture(scope="module")
def stacked():
    w = _gauss((2, 128, 128), 1)
    w[1, 7] = 0.0  # an all-zero output row must reconstruct to exactly zero
    return w, trellis.quantize(w, 2, seed=0)


def test_stacked_returns_one_linear_per_expert_with_padded_tensors(stacked):
    w, qs = stacked
    assert isinstance(qs, list) and len(qs) == 2
    for q in qs:
        t = q.tensors()
        assert set(t) == {"trellis", "suh", "svh", "mul1"}
        assert t["trellis"].shape == (8, 8, 32) and t["trellis"].dtype == torch.int16
        assert t["suh"].shape == (128,) and t["svh"].shape == (128,)
        assert t["suh"].dtype == t["svh"].dtype == torch.float16
        assert t["mul1"].shape == () and int(t["mul1"]) == -2082680531
        assert q.bits == 2 and q.shape == (128, 128)
        assert q.dequantize().shape == (128, 128)
    assert torch.equal(qs[1].dequantize()[7], torch.zeros(128))


def test_stacked_k2_distortion_within_rd_bound(stacked):
    """K=2 on N(0,1): the stacked fixture doubles as the K=2 rate–distortion case."""
    w, qs = stacked
    wd = torch.stack([q.dequantize() for q in qs])
    keep = torch.ones_like(w, dtype=torch.bool)
    keep[1, 7] = False
    ratio = float((wd - w)[keep].square().mean() / w[keep].square().mean()) / 2 ** -4
    assert 0.9 < ratio < 1.15, ratio


def test_round_trip_tensors_from_tensors(stacked):
    _, qs = stacked
    for q in qs:
        stored = {k: v.clone() for k, v in q.tensors().items()}
        back = trellis.from_tensors(stored, q.shape)
        assert back.codebook == "mul1" and back.bits == q.bits
        assert torch.equal(back.dequantize(), q.dequantize())


@pytest.mark.slow
@pytest.mark.parametrize("bits", [3, 4])
def test_distortion_within_rd_bound(bits):
    w, q = _encode_gauss(bits)
    ratio = float((q.dequantize() - w).square().mean() / w.square().mean()) / 2 ** (-2 * bits)
    assert ratio < 1.15, ratio
    assert ratio > 0.9  # a trellis cannot beat the Shannon bound by this much: catches a broken metric


def test_viterbi_deterministic_and_consistent():
    """The tile encoder (the only search in the pipeline) gives identical, self-consistent rings on repeat."""
    x = _gauss((1, 256), 9)
    table = cb.codebook_table("mul1")
    for bits in (2,):
        a = viterbi.viterbi_tiles(x, table, bits)
        assert torch.equal(a, viterbi.viterbi_tiles(x.clone(), table, bits))
        words = cb.pack_states(a, bits)
        assert torch.equal(cb.unpack_states(words, bits), a)  # the ring reproduces every state, seam included


@pytest.mark.slow
def test_quantize_deterministic_with_padding():
    w = _gauss((100, 120), 11)
    q = trellis.quantize(w, 3, seed=3)
    t = q.tensors()
    assert t["trellis"].shape == (8, 8, 48) and t["suh"].shape == (128,) and t["svh"].shape == (128,)
    assert q.dequantize().shape == (100, 120)
    again = trellis.quantize(w.clone(), 3, seed=3)
    assert set(again.tensors()) == set(t)
    for key, val in t.items():
        assert torch.equal(val, again.tensors()[key]), key
    # padding adds rate for the real weights, so only the upper bound applies
    assert float((q.dequantize() - w).square().mean() / w.square().mean()) < 1.15 * 2 ** -6


def test_block_ldl_and_ldlq_feedback_on_real_hessian():
    """Block LDL of the damped Hessian is exact, and LDLQ error feedback (with a plain rounding quantizer, so no
    Viterbi cost) lowers tr(E H Eᵀ) against independent rounding."""
    h = torch.load(DATA / "trellis_hessian_l0_q_proj.pt")["hessian"].double()[None]
    lmat = ldlq.block_ldl(h, 0.025).double()
    m = torch.eye(128, dtype=torch.float64) + lmat[0]
    hd = ldlq.damp(h, 0.025)[0]
    dmat = torch.linalg.solve(m, hd) @ torch.linalg.inv(m).T
    blocks = torch.block_diag(*[torch.ones(16, 16)] * 8).bool()
    assert float(dmat[~blocks].abs().max()) < 1e-4 * float(hd.diagonal().mean())
    assert float(lmat[0][blocks].abs().max()) == 0.0 and float(lmat[0].triu().abs().max()) == 0.0
    w = _gauss((1, 128, 64), 4)
    rnd = lambda t: torch.round(t * 2) / 2  # noqa: E731
    q = ldlq.ldlq(w, lmat.float(), lambda t, b: rnd(t))
    proxy = lambda e: float(torch.trace(e[0].T.double() @ h[0] @ e[0].double()))  # noqa: E731
    assert proxy(w - q) < 0.8 * proxy(w - rnd(w))


@pytest.mark.slow
def test_hessian_ldlq_lowers_proxy_loss(mini_model):
    """Hessian from real activations of glm5next-mini (layer 0 q_proj input, 384 calibration tokens)."""
    rec = torch.load(DATA / "trellis_hessian_l0_q_proj.pt")
    with safe_open(str(mini_model / "model.safetensors"), "pt") as f:
        w = f.get_tensor(rec["name"] + ".weight").float()
    h = rec["hessian"].double()

    def proxy(q):
        e = (q.dequantize() - w).double()
        return float(torch.trace(e @ h @ e.T) / torch.trace(w.double() @ h @ w.double().T))

    with_h = proxy(trellis.quantize(w, 2, hessian=h))
    without = proxy(trellis.quantize(w, 2))
    assert with_h < 0.9 * without, (with_h, without)
