"""quant/ggml/block_tuning.py: ggml codes as a differentiable parameter on their encoded grid, and the signed descent
(glm5next-k256 weights, encoded by mixq's exact ggml encoders)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from mixq.quant.ggml import block_tuning as bt
from mixq.quant.ggml import levels as gl
from mixq.quant.ggml import encoders as kquants


@pytest.fixture(scope="module")
def weights(k256_model):
    from mixq.formats.checkpoint import open_checkpoint

    ck = open_checkpoint(k256_model)
    return ck.get("model.language_model.layers.0.mlp.down_proj.weight", dtype=torch.float32)[:48, :512].contiguous()


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q6_K", "Q5_0", "Q8_0", "IQ4_NL"])
def test_codes_start_at_the_encoding(weights, qtype):
    """Untouched, the relaxation decodes to exactly the encoded weights and writes back the same bytes; each u
    sits within half a step of its code, towards the source weight."""
    blocks = kquants.quantize(weights.numpy(), qtype)
    c = bt.LevelCodes(blocks, qtype, weights)
    ref = gguf_quants.dequantize(blocks, GGMLQuantizationType[qtype])
    assert torch.allclose(c.dequantized().detach(), torch.from_numpy(ref), rtol=1e-5, atol=1e-6)
    assert np.array_equal(c.blocks(), blocks)
    assert c.changed() == 0.0
    gap = (c.u.detach() - c.start).abs()
    assert float(gap.max()) <= bt.START_REACH + 1e-6 and float(gap.mean()) > 0.05


def _layer_loss(weights, x, codes):
    y = x @ weights.T
    return lambda sl: ((x[sl] @ codes.dequantized().T - y[sl]) ** 2).mean()


# per type: block bytes, and the byte ranges outside the codes (Q2_K: 16 scale bytes, d, dmin; IQ4_NL: d)
_KEPT_BYTES = {"Q2_K": (84, [(0, 16), (80, 84)]), "IQ4_NL": (18, [(0, 2)])}


@pytest.mark.parametrize("qtype", list(_KEPT_BYTES))
def test_sign_descent_lowers_a_held_out_loss_and_keeps_the_scales(weights, qtype):
    """The codes of a tensor tuned for a Linear's output on correlated inputs: the held-out loss falls, some
    codes move, and every byte outside the codes (scales, mins, super-scales) stays. IQ4_NL's non-uniform levels
    are relaxed through their piecewise-linear interpolation."""
    g = torch.Generator().manual_seed(0)
    mix = 3.0 * torch.randn(512, 512, generator=g) / 512 ** 0.5 + torch.eye(512)
    x = torch.randn(640, 512, generator=g) @ mix
    blocks = kquants.quantize(weights.numpy(), qtype)
    codes = bt.LevelCodes(blocks, qtype, weights)
    loss = _layer_loss(weights, x, codes)
    fit = [slice(i, i + 64) for i in range(0, 512, 64)]
    held = slice(512, 640)
    with torch.no_grad():
        start = float(loss(held))
    first, best = bt.sign_descent([codes.u], loss, fit, 40, 0.5, score=lambda: float(loss(held).detach()))
    assert first == pytest.approx(start) and best < 0.95 * start
    with torch.no_grad():
        assert float(loss(held)) == pytest.approx(best)
    assert 0.01 < codes.changed() < 0.5
    out = codes.blocks()
    assert out.shape == blocks.shape
    size, kept = _KEPT_BYTES[qtype]
    o, b = out.reshape(-1, size), blocks.reshape(-1, size)
    assert all(np.array_equal(o[:, i:j], b[:, i:j]) for i, j in kept)
    assert not np.array_equal(out, blocks)


def test_sign_descent_returns_to_the_start_when_nothing_scores_better(weights):
    """A held-out score that every move makes worse: the parameters end where they started."""
    blocks = kquants.quantize(weights.numpy(), "Q4_K")
    codes = bt.LevelCodes(blocks, "Q4_K", weights)
    u0 = codes.u.detach().clone()
    loss = lambda _sl: (codes.dequantized() - 1.0).square().mean()  # noqa: E731  (pulls every code upward)
    score = lambda: float((codes.u.detach() - u0).abs().sum())  # noqa: E731  (0 only at the start)
    first, best = bt.sign_descent([codes.u], loss, [None], 10, 1.0, score=score)
    assert first == best == 0.0
    assert torch.equal(codes.u.detach(), u0) and np.array_equal(codes.blocks(), blocks)


def test_level_grid_types_are_the_tunable_ones():
    assert set(bt.TUNABLE) == set(gl.SCALAR_TYPES) and "IQ2_S" not in bt.TUNABLE


@pytest.mark.parametrize("qtype", ["Q5_0", "Q4_1", "IQ4_NL"])
def test_learned_scales_are_what_the_file_decodes_to(weights, qtype):
    """With scales learned, the relaxation starts at the encoding, and after the descent the written blocks (fp16
    scales, codes) decode through gguf-py to exactly the weights the loss saw."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(640, 512, generator=g) @ (3.0 * torch.randn(512, 512, generator=g) / 512 ** 0.5 + torch.eye(512))
    blocks = kquants.quantize(weights.numpy(), qtype)
    codes = bt.LevelCodes(blocks, qtype, weights, scales=True)
    ref = torch.from_numpy(gguf_quants.dequantize(blocks, GGMLQuantizationType[qtype]))
    assert torch.allclose(codes.dequantized().detach(), ref, rtol=1e-5, atol=1e-6)
    assert np.array_equal(codes.blocks(), blocks) and len(codes.params) == 2
    loss = _layer_loss(weights, x, codes)
    first, best = bt.sign_descent(codes.params, loss, [slice(i, i + 64) for i in range(0, 512, 64)], 40,
                                  [0.5, 0.2], score=lambda: float(loss(slice(512, 640)).detach()))
    assert best < first
    assert not torch.equal(codes.super_scales(), codes.sup0)
    got = torch.from_numpy(gguf_quants.dequantize(codes.blocks(), GGMLQuantizationType[qtype]))
    assert torch.allclose(got, codes.dequantized().detach(), rtol=1e-6, atol=1e-7)
