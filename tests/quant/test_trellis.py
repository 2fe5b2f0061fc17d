"""Trellis encoder: round trip, padding, stacked experts, distortion vs the R-D bound, LDLQ, determinism.

The CPU Viterbi costs tens of ms per 16×16 tile and pass, so every encode here is a single 128×128 block
(64 tiles); larger tables live in bench/trellis.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mixq.quant import trellis

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
    w = _gauss((2, 100, 120), 1)
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
        assert q.bits == 2 and q.shape == (100, 120)
        assert q.dequantize().shape == (100, 120)
    assert torch.equal(qs[1].dequantize()[7], torch.zeros(120))
    for q, wi in zip(qs, w):
        rel = (q.dequantize() - wi).square().mean() / wi.square().mean()
        assert rel < 1.15 * 2 ** -4


def test_round_trip_tensors_from_tensors(stacked):
    _, qs = stacked
    for q in qs:
        stored = {k: v.clone() for k, v in q.tensors().items()}
        back = trellis.from_tensors(stored, q.shape)
        assert back.codebook == "mul1" and back.bits == q.bits
        assert torch.equal(back.dequantize(), q.dequantize())


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_distortion_within_rd_bound(bits):
    w, q = _encode_gauss(bits)
    ratio = float((q.dequantize() - w).square().mean() / w.square().mean()) / 2 ** (-2 * bits)
    assert ratio < 1.15, ratio
    assert ratio > 0.9  # a trellis cannot beat the Shannon bound by this much: catches a broken metric


def test_deterministic():
    w, q = _encode_gauss(2)
    again = trellis.quantize(w.clone(), 2, seed=3)
    for key, val in q.tensors().items():
        assert torch.equal(val, again.tensors()[key]), key
    other = trellis.quantize(w.clone(), 2, seed=4)
    assert not torch.equal(other.tensors()["suh"], q.tensors()["suh"])


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
