"""quant/trellis/viterbi_gluon.py: the Gluon forward of the fused Viterbi.

Gluon has no CPU interpreter. On the CPU the kernel is compiled for sm_90 with the SASS tools Triton ships, and its
step loop is read: the design's promises (two barriers a step, a few shared loads, fewer instructions than the
Triton forward's loop) are checked there. On the GPU (`gpu` tests) its states are checked against the torch path
and the Triton forward at every rate it serves.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import pytest
import torch

from mixq.quant.trellis import codebooks as cb
from mixq.quant.trellis import viterbi

gluon = pytest.importorskip("triton.experimental.gluon")


def _sm90_loop(forward: str, d: int, free: bool, costs: int) -> collections.Counter:
    """Opcode counts of the longest backward-branch loop (the 255 steps) of a forward kernel built for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    from mixq.quant.trellis import viterbi_gluon, viterbi_triton

    bp = {1: "*u8", 2: "*u8", 3: "*i32", 4: "*i64"}[d]
    sig = {"x_ptr": "*fp32", "table_ptr": "*fp16", "bp_ptr": bp, "seam_ptr": "*i32", "final_ptr": "*i32"}
    consts = dict(D=d, FREE=free, COSTS=costs)
    if forward == "gluon":
        fn, source = viterbi_gluon.forward, GluonASTSource
    else:
        fn, source = viterbi_triton.kernels()[0], ASTSource
        consts.update(RENORM=viterbi_triton.RENORM_EVERY, GATHER=False)
    sig.update({k: "constexpr" for k in consts})
    names = list(sig)
    src = source(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": viterbi_triton.NUM_WARPS})
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kern.asm["cubin"])
        text = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", path], capture_output=True, text=True,
                              check=True).stdout
    labels, body = {}, []
    for line in text.splitlines():
        if m := re.match(r"^\.L_x_(\d+):", line.strip()):
            labels[m.group(1)] = len(body)
        elif m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line):
            body.append(m.group(1))
    loops = [body[labels[m.group(1)]:i + 1] for i, ins in enumerate(body)
             if (m := re.search(r"BRA.*\.L_x_(\d+)", ins)) and labels.get(m.group(1), len(body)) < i]
    loop = max(loops, key=len)
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0] for ins in loop)


@pytest.mark.parametrize("d", [2, 3, 4])
@pytest.mark.parametrize("free", [True, False])
def test_step_loop_on_sm90_has_one_exchange(d, free):
    pytest.importorskip("triton.backends.nvidia")
    ops = _sm90_loop("gluon", d, free, 1)
    assert ops["BAR"] == 2, ops  # one store and one load of the edge costs a step
    assert ops["LDS"] + ops["LDSM"] <= 16 and ops["SHFL"] == 0, ops
    assert sum(ops.values()) < 1900, sum(ops.values())


@pytest.mark.slow
@pytest.mark.parametrize("d", [2, 3, 4])
def test_step_loop_on_sm90_is_shorter_than_the_triton_forward(d):
    pytest.importorskip("triton.backends.nvidia")
    g, t = _sm90_loop("gluon", d, False, 1), _sm90_loop("triton", d, False, 1)
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
def test_gluon_forward_is_the_default_after_its_check_on_gpu(bits):
    from mixq.quant.trellis import viterbi_triton as viterbi_fused

    assert viterbi_fused.default_forward(bits) == "gluon"
    assert viterbi.fused_forward(bits) == "gluon"
