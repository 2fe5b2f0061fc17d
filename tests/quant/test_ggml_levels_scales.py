"""quant/ggml/rounding/levels.py super-scales and sub-block scales: read, written and decoded as llama.cpp's decoder
(gguf-py's dequantize) reads them, on blocks from mixq's exact ggml encoders."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from mixq.errors import InputError
from mixq.quant.ggml.rounding import levels as gl
from mixq.quant.ggml import encoders

# per type: the code whose level value is 1 (y = d·s·1 − dmin·m)
UNIT_CODE = {"Q2_K": 1, "Q3_K": 5, "Q4_K": 1, "Q5_K": 1, "Q6_K": 33}


def _blocks(qtype: str, rows: int = 6, n: int = 512) -> np.ndarray:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((rows, n)) * rng.uniform(0.05, 3.0, (rows, 1))).astype(np.float32)
    x[0, :64] = 0.0  # degenerate sub-blocks
    im = rng.uniform(0.1, 2.0, n).astype(np.float32)
    return encoders.quantize(x, qtype, im)


def _decode(blocks: np.ndarray, qtype: str) -> np.ndarray:
    return gguf_quants.dequantize(blocks, GGMLQuantizationType[qtype])


@pytest.mark.parametrize("qtype", sorted(UNIT_CODE))
def test_sub_scales_are_the_decoders_scales_and_mins(qtype):
    b = _blocks(qtype)
    sc, mn = gl.sub_scales(b, qtype)
    sub, (lo, hi), mrange = gl.SUB_SCALES[qtype]
    assert sc.shape == (6, 512 // sub) and sc.min() >= lo and sc.max() <= hi
    assert np.array_equal(gl.set_sub_scales(b, qtype, sc, mn), b)
    nsb = len(gl.SUPER_SCALES[qtype])
    ones = gl.set_levels(b, qtype, np.full((6, 512), UNIT_CODE[qtype]))
    unit = np.zeros(gl.super_scales(b, qtype).shape, np.float32)
    unit[..., 0] = 1.0  # d = 1, dmin = 0: every weight decodes to its sub-block's scale
    assert np.array_equal(_decode(gl.set_super_scales(ones, qtype, unit), qtype), np.repeat(sc, sub, -1))
    if mrange is not None:
        unit = np.zeros_like(unit)
        unit[..., 1] = 1.0  # d = 0, dmin = 1: minus the min
        assert nsb == 2 and np.array_equal(_decode(gl.set_super_scales(b, qtype, unit), qtype),
                                           -np.repeat(mn, sub, -1).astype(np.float32))
    # writing new values: the decoder reads them back
    rng = np.random.default_rng(4)
    sc2 = rng.integers(lo, hi + 1, sc.shape)
    mn2 = None if mrange is None else rng.integers(mrange[0], mrange[1] + 1, sc.shape)
    b2 = gl.set_sub_scales(b, qtype, sc2, mn2)
    r_sc, r_mn = gl.sub_scales(b2, qtype)
    assert np.array_equal(r_sc, sc2) and (mn2 is None or np.array_equal(r_mn, mn2))
    assert np.array_equal(gl.super_scales(b2, qtype), gl.super_scales(b, qtype))


@pytest.mark.parametrize("qtype", ["IQ2_S", "IQ2_XS"])
def test_iq2_sub_scales_are_the_group_scales(qtype):
    """IQ2_S, IQ2_XS: each 16-weight sub-block's 4-bit scale s gives its groups the scale d·(0.5 + s)/4 the decoder uses."""
    b = _blocks(qtype)
    sc, mn = gl.sub_scales(b, qtype)
    assert mn is None and sc.shape == (6, 32) and sc.min() >= 0 and sc.max() <= 15
    assert np.array_equal(gl.set_sub_scales(b, qtype, sc), b)
    sc2 = np.random.default_rng(5).integers(0, 16, sc.shape)
    b2 = gl.set_sub_scales(b, qtype, sc2)
    d = gl.super_scales(b2, qtype)[..., 0]
    want = np.repeat(np.repeat(d, 16, -1) * (np.float32(0.5) + sc2.astype(np.float32)) * np.float32(0.25), 2, -1)
    assert np.array_equal(gl.iq2_group_scales(b2, qtype), want)
    assert np.array_equal(gl.iq2_groups(b2, qtype)[0], gl.iq2_groups(b, qtype)[0])  # codebook indices kept


def test_iq4_xs_sub_scales_are_the_decoders():
    """IQ4_XS: each 32-weight sub-block's 6-bit scale s (stored + 32, split over scales_l and scales_h) gives its
    weights d·s·table(code), as gguf-py decodes them; codes and d are kept."""
    b = _blocks("IQ4_XS")
    sc, mn = gl.sub_scales(b, "IQ4_XS")
    assert mn is None and sc.shape == (6, 16) and sc.min() >= -32 and sc.max() <= 31
    assert np.array_equal(gl.set_sub_scales(b, "IQ4_XS", sc), b)
    sc2 = np.random.default_rng(6).integers(-32, 32, sc.shape)
    b2 = gl.set_sub_scales(b, "IQ4_XS", sc2)
    assert np.array_equal(gl.sub_scales(b2, "IQ4_XS")[0], sc2)
    codes = np.random.default_rng(7).integers(0, 16, (6, 512))
    d = gl.super_scales(b2, "IQ4_XS")[..., 0]
    want = np.repeat(np.repeat(d, 8, -1) * sc2.astype(np.float32), 32, -1) * gl.level_values("IQ4_XS")[codes]
    assert np.array_equal(_decode(gl.set_levels(b2, "IQ4_XS", codes), "IQ4_XS"), want)


@pytest.mark.parametrize("qtype", sorted(gl.SUPER_SCALES))
def test_decode_is_linear_in_the_super_scales(qtype):
    b = _blocks(qtype, n=256)
    sc = gl.super_scales(b, qtype)
    basis = gl.super_scale_basis(b, qtype)
    bs = encoders.block_size(qtype)
    rebuilt = sum(np.repeat(sc[..., i], bs, -1) * basis[i] for i in range(sc.shape[-1]))
    assert np.array_equal(rebuilt, _decode(b, qtype))
    assert np.array_equal(gl.set_super_scales(b, qtype, sc), b)
    half = gl.set_super_scales(b, qtype, sc * 0.5)  # fp16 halving is exact
    assert np.array_equal(_decode(half, qtype), 0.5 * _decode(b, qtype))


def test_out_of_range_scales_are_refused():
    b = _blocks("Q4_K")
    sc, mn = gl.sub_scales(b, "Q4_K")
    with pytest.raises(InputError, match=r"Q4_K sub-block scales must lie in \[0, 63\]"):
        gl.set_sub_scales(b, "Q4_K", sc + 64, mn)
    with pytest.raises(InputError, match="needs the sub-block mins"):
        gl.set_sub_scales(b, "Q4_K", sc)
    with pytest.raises(InputError, match="no sub-block scale layout for ggml type 'Q8_0'"):
        gl.sub_scales(b, "Q8_0")
