"""quant/trellis/viterbi_gluon.py: the Gluon forward of the fused Viterbi.

Gluon has no CPU interpreter. On the CPU the kernel is compiled for sm_90 with the SASS tools Triton ships, and its
step loop is read: the design's promises (two barriers a step, a few shared loads, fewer instructions than the
Triton forward's loop) are checked there. On the GPU (`gpu` tests) its states are checked against the torch path
and the Triton forward at every rate it serves.
"""
from __future__ import annotations

import collections

import pytest
import torch
from triton_helpers import require

from mixq.quant.trellis import codebooks as cb
from mixq.quant.trellis import viterbi


def _sm90_loop(forward: str, d: int, free: bool) -> collections.Counter:
    require("triton.experimental.gluon")
    require("triton.backends.nvidia")
    from mixq.quant.trellis import viterbi_triton

    return viterbi_triton.forward_step_ops(d, free, "mixed", forward)


@pytest.mark.parametrize("d", [2, 3, 4])
@pytest.mark.parametrize("free", [True, False])
def test_step_loop_on_sm90_has_one_exchange(d, free):
    require("triton.backends.nvidia")
    ops = _sm90_loop("gluon", d, free)
    assert ops["BAR"] == 2, ops  # one store and one load of the edge costs a step
    assert ops["LDS"] + ops["LDSM"] <= 16 and ops["SHFL"] == 0, ops
    assert sum(ops.values()) < 1900, sum(ops.values())


@pytest.mark.slow
@pytest.mark.parametrize("d", [2, 3, 4])
def test_step_loop_on_sm90_is_shorter_than_the_triton_forward(d):
    require("triton.backends.nvidia")
    g, t = _sm90_loop("gluon", d, False), _sm90_loop("triton", d, False)
    mio = ("LDL", "STL", "LDS", "LDSM", "STS", "SHFL", "BAR")
    assert sum(g.values()) < 0.85 * sum(t.values())
    assert sum(g[k] for k in mio) < 0.6 * sum(t[k] for k in mio)


GLUON_RATES = [2, 3, 4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", GLUON_RATES)
@pytest.mark.parametrize("costs", ["mixed", "fp32"])
def test_gluon_forward_matches_the_torch_path_on_gpu(bits, costs):
    from mixq.quant.trellis import viterbi_triton as viterbi_fused

    dev = torch.device("cuda")
    x = (torch.randn(2048, 256, generator=torch.Generator().manual_seed(int(2 * bits))) * 0.9).to(dev)
    table = cb.codebook_table("mul1", dev)
    ref = viterbi.viterbi_tiles_reference(x, table, float(bits))
    a = viterbi_fused.encode(x, table.half(), bits, costs=costs, forward="gluon")
    b = viterbi_fused.encode(x, table.half(), bits, costs=costs, forward="triton")
    assert viterbi.ring_consistent(a, bits)
    ea, eb, er = ((table[s].double() - x.double()).square().mean() for s in (a, b, ref))
    dr = 0.81 * 2.0 ** (-2 * bits)
    assert float(ea - er) / dr <= 5e-4  # the criterion against the torch path
    assert abs(float(ea - eb)) / dr <= 5e-4  # and the Triton forward's distortion
    assert float((a == b).all(1).double().mean()) >= 0.9  # the same rings but for near-ties


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", GLUON_RATES)
def test_triton_forward_serves_and_gluon_runs_by_name_on_gpu(bits):
    """The Triton forward serves the fused path (the faster of the two in a 288-expert layer on an H200); the
    Gluon forward stays available where it applies, for the side-by-side bench."""
    from mixq.quant.trellis import viterbi_triton as viterbi_fused

    assert viterbi_fused.default_forward(bits) == "triton"
    assert viterbi.fused_forward(bits) == "triton"
    assert viterbi_fused.gluon_serves(bits)
