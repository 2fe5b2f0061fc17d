"""quant/ggml/rounding/levels.py: level codes written into ggml blocks decode (through gguf-py) to step*code + base."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from mixq.errors import InputError
from mixq.quant.ggml.rounding import levels as gl
from mixq.quant.ggml import encoders


def _k256_rows(k256_model, n_rows: int = 6) -> np.ndarray:
    from mixq.formats.checkpoint import open_checkpoint

    ck = open_checkpoint(k256_model)
    return ck.get("model.language_model.layers.0.self_attn.q_proj.weight").numpy()[:n_rows].copy()


@pytest.mark.parametrize("qtype", gl.SCALAR_TYPES)
def test_codes_round_trip_and_decode_on_the_grid(qtype, k256_model):
    x = _k256_rows(k256_model)
    imx = np.linspace(0.5, 2.0, x.shape[1], dtype=np.float32)
    blocks = encoders.quantize(x, qtype, imx)
    step, base = gl.level_grid(blocks, qtype)
    gt = GGMLQuantizationType[qtype]
    decoded = gguf_quants.dequantize(blocks, gt)
    lo, hi = gl.CODE_RANGE[qtype]
    pos = torch.from_numpy((decoded - base) / np.where(step != 0, step, 1))
    own = np.where(step != 0, gl.nearest_codes(pos, qtype).numpy(), lo)
    # ggml's own codes, read back through the grid and written again, give ggml's bytes
    assert np.array_equal(gl.set_levels(blocks, qtype, own), blocks)
    codes = np.random.default_rng(1).integers(lo, hi + 1, size=x.shape)
    got = gguf_quants.dequantize(gl.set_levels(blocks, qtype, codes), gt)
    want = step * gl.level_values(qtype)[codes - lo] + base
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(decoded).max())


@pytest.mark.parametrize("qtype", ["Q2_K", "Q4_K", "Q6_K", "Q5_1", "IQ4_XS"])
def test_the_level_grid_is_the_same_read_in_chunks(qtype, k256_model, monkeypatch):
    x = _k256_rows(k256_model)
    blocks = encoders.quantize(x, qtype, None)
    whole = gl.level_grid(blocks, qtype)
    monkeypatch.setattr(gl, "GRID_CHUNK_WEIGHTS", 4 * x.shape[1])  # passes of 4 rows and of 2
    chunked = gl.level_grid(blocks.reshape(2, 3, -1), qtype)
    for a, b in zip(whole, chunked):
        assert b.shape == (2, 3, a.shape[-1]) and np.array_equal(a, b.reshape(a.shape))


def test_iq4nl_levels_round_and_interpolate():
    levels = gl.level_values("IQ4_NL")
    assert levels[0] == -127 and levels[-1] == 113 and np.all(np.diff(levels) > 0)
    codes = torch.arange(16, dtype=torch.float32)
    v = gl.interpolated_values(codes, "IQ4_NL")
    assert torch.equal(v, torch.from_numpy(levels)) and torch.equal(gl.code_values(codes, "IQ4_NL"), v)
    assert torch.allclose(gl.code_positions(v, "IQ4_NL"), codes)
    # halfway between two levels is halfway between their codes; ties go to the upper level (ggml's best_index)
    mid = torch.tensor([(-127 - 104) / 2, 0.5 * (1 + 13), 5.0, -200.0, 200.0])
    assert gl.nearest_codes(mid, "IQ4_NL").tolist() == [1.0, 9.0, 8.0, 0.0, 15.0]
    assert torch.allclose(gl.code_positions(mid[:2], "IQ4_NL"), torch.tensor([0.5, 8.5]))
    u = torch.tensor([7.25], requires_grad=True)
    gl.interpolated_values(u, "IQ4_NL").backward()
    assert float(u.grad) == float(levels[8] - levels[7])


def test_scales_are_untouched(k256_model):
    x = _k256_rows(k256_model)
    blocks = encoders.quantize(x, "Q4_K")
    changed = gl.set_levels(blocks, "Q4_K", np.zeros(x.shape, np.int64)).reshape(-1, 144)
    # d, dmin and the 12 packed scale bytes are the first 16 bytes of a Q4_K block
    assert np.array_equal(changed[:, :16], blocks.reshape(-1, 144)[:, :16])
    assert not np.array_equal(changed[:, 16:], blocks.reshape(-1, 144)[:, 16:])


@pytest.mark.parametrize("qtype", ["IQ2_S", "IQ2_XS"])
def test_iq2_groups_decode(k256_model, qtype):
    """Every group's (index, sign byte) written into the blocks is what gguf-py decodes and what reads back
    (IQ2_XS: sign bytes with an even count of negatives, the only ones it stores)."""
    x = _k256_rows(k256_model)
    blocks = encoders.quantize(x, qtype, np.ones(x.shape[1], np.float32))
    db = gl.iq2_group_scales(blocks, qtype)
    rng = np.random.default_rng(2)
    idx = rng.integers(0, gl.IQ2_LAYOUTS[qtype].entries, size=db.shape)
    signs = rng.integers(0, 256, size=db.shape)
    if gl.IQ2_LAYOUTS[qtype].parity:
        signs = np.array([v for v in range(256) if bin(v).count("1") % 2 == 0])[signs % 128]
    got = gguf_quants.dequantize(gl.set_iq2_groups(blocks, qtype, idx, signs), GGMLQuantizationType[qtype])
    sign = np.where((signs[..., None] >> np.arange(8)) & 1, -1.0, 1.0)
    want = (db[..., None] * gl.iq2_grid(qtype)[idx] * sign).reshape(x.shape)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    own_idx, own_signs = gl.iq2_groups(blocks, qtype)
    assert np.array_equal(gl.set_iq2_groups(blocks, qtype, own_idx, own_signs), blocks)
    back = gl.iq2_groups(gl.set_iq2_groups(blocks, qtype, idx, signs), qtype)
    assert np.array_equal(back[0], idx) and np.array_equal(back[1], signs)


def test_even_sign_flip_flips_the_cheapest_weight_of_odd_groups():
    neg = torch.tensor([[True, False, False, False, False, False, False, False],
                        [True, True, False, False, False, False, False, False]])
    cost = torch.tensor([[5.0, 1.0, 3.0, 0.5, 2.0, 4.0, 6.0, 7.0], [1.0] * 8])
    out, paid = gl.even_sign_flip(neg, cost)
    assert out[0].tolist() == [True, False, False, True, False, False, False, False]
    assert torch.equal(out[1], neg[1]) and paid.tolist() == [0.5, 0.0]


def test_bad_codes_and_types_are_refused():
    blocks = encoders.quantize(np.ones((1, 256), np.float32), "Q4_K")
    with pytest.raises(InputError, match=r"Q4_K level codes must lie in \[0, 15\]"):
        gl.set_levels(blocks, "Q4_K", np.full((1, 256), 16))
    with pytest.raises(InputError, match="no level layout for ggml type 'IQ3_S'"):
        gl.set_levels(blocks, "IQ3_S", np.zeros((1, 256)))
    b = encoders.quantize(np.ones((1, 256), np.float32), "IQ2_S")
    with pytest.raises(InputError, match="IQ2_S codebook indices"):
        gl.set_iq2_groups(b, "IQ2_S", np.full((1, 32), 1024), np.zeros((1, 32)))
    xs = encoders.quantize(np.ones((1, 256), np.float32), "IQ2_XS", np.ones(256, np.float32))
    with pytest.raises(InputError, match=r"IQ2_XS codebook indices must lie in \[0, 511\]"):
        gl.set_iq2_groups(xs, "IQ2_XS", np.full((1, 32), 512), np.zeros((1, 32)))
    with pytest.raises(InputError, match="IQ2_XS sign bytes must have an even number"):
        gl.set_iq2_groups(xs, "IQ2_XS", np.zeros((1, 32)), np.ones((1, 32)))
    with pytest.raises(InputError, match="no codebook group layout for ggml type 'IQ2_XXS'"):
        gl.iq2_groups(xs, "IQ2_XXS")
