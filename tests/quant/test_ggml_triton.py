"""The fused Triton kernels (quant/ggml/triton_kernels/search.py, triton_grid.py, triton_descent.py) against the eager torch
searches they replace: bitwise equal.

On the CPU the kernels run in Triton's interpreter (a subprocess with TRITON_INTERPRET=1, set before triton is
imported; it runs the same kernels with numpy float32 ops, one op at a time, so inputs stay small): the default
suite walks a few candidate scales and one super-block, the `slow` tests the encoders' own settings. The `gpu`
tests compile them for the device, compare large random and edge-case batches, and check that the encoders
trust every kernel variant they use (a variant that fails its first-use check falls back to the eager path:
right bytes, lost speed).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from triton_helpers import interpret

from mixq.quant.ggml import encoders

from mixq.quant.ggml.triton_kernels import search as triton_search

from mixq.quant.ggml.triton_kernels import descent as triton_descent

from mixq.quant.ggml.triton_kernels import grid as triton_grid
from mixq.quant.ggml.i_quants import torch_grid as tg
from mixq.quant.ggml.k_quants import torch_search as ts

pytestmark = pytest.mark.usefixtures("needs_triton")  # a skip without Triton, a failure under CI

# the i-quant search set-ups of i_quants.torch_iq: (sub-block, sigma factor, parity, plain weights, steps, step,
# refine, scale seed)
IQ_SETUPS = {
    "IQ2_S": (16, 2, False, False, 9, 0.1, "offgrid", 5.0), "IQ2_XS": (16, 1, True, False, 9, 0.1, "offgrid", 5.0),
    "IQ3_S": (32, 2, False, True, 9, 0.2, "all_if_offgrid", 15.0),
    "IQ3_XXS": (32, 2, True, True, 15, 0.2, "offgrid", 15.0), "IQ2_XXS": (32, 1, True, False, 6, 0.1, "all", None),
}


def iq_search_inputs(qtype: str, superblocks: torch.Tensor, qw: torch.Tensor):
    """(xval, w, waux, base, scale, steps, step, refine) of qtype's search for super-blocks (S, 256)."""
    m, sf, parity, plain, steps, step, refine, div = IQ_SETUPS[qtype]
    xval, w, waux, _ = tg.prepare(superblocks, qw, m, sf, parity, plain)
    mx = xval.amax(0)
    if div is None:  # IQ2_XXS seeds with make_qp_quants
        sc, _ = ts.make_qp_quants_eager(xval, 4, w)
        eff = sc * 3.0
        return xval, w, waux, torch.where(eff > 0, eff, 1.0), sc, steps, step, refine
    mx = torch.where(mx < 1e-8, 1.0, mx)
    return xval, w, waux, mx, torch.div(mx, mx.new_full((), div)), steps, step, refine


def edge_superblocks(S: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(S)
    xs = torch.randn(S, 256, generator=g) * 0.02
    xs[0, :64] = 0.0
    xs[min(1, S - 1)] = (xs[min(1, S - 1)] * 100).round() / 100         # ties
    xs[min(2, S - 1), ::37] = 1.0                                        # outliers
    xs = xs.to(torch.bfloat16).float()
    qw = torch.rand(S, 256, generator=g) + 0.05
    return xs.to(device), qw.to(device)


_ENCODERS = r"""
import json, warnings, numpy as np, torch
warnings.simplefilter("error", UserWarning)  # a kernel variant failing its first-use check warns
from mixq.quant.ggml import encoders
from mixq.quant.ggml.triton_kernels import search as triton_search
x = (np.random.default_rng(0).standard_normal((2, 256)) * 0.02).astype(np.float32)
im = np.random.default_rng(1).random(256).astype(np.float32)
res = {}
for t, imx in [("Q4_K", im), ("Q3_K", None), ("Q6_K", im), ("Q2_K", None), ("IQ2_S", im), ("Q4_1", im)]:
    a = encoders.quantize_tensor(torch.from_numpy(x), t, None if imx is None else torch.from_numpy(imx)).numpy()
    res[t] = bool(np.array_equal(a, encoders.quantize(x, t, imx)))
res["variants"] = sorted({k[0] for k, ok in triton_search._VARIANTS.items() if ok})
print(json.dumps(res))
"""

_CHECK = r"""
import json, sys, torch
from mixq.quant.ggml.triton_kernels import search as kf
from mixq.quant.ggml.triton_kernels import descent as kd
from mixq.quant.ggml.triton_kernels import grid as kg
from mixq.quant.ggml.i_quants import torch_grid as tg
from mixq.quant.ggml.k_quants import torch_search as ts
sys.path.insert(0, sys.argv[2])
import test_ggml_triton as T
what = sys.argv[1]
dev = torch.device("cpu")
res = {}
x, w = kf.edge_blocks(32, dev)
x = torch.cat([x, torch.randn(32, 64, generator=torch.Generator().manual_seed(1)) * 0.01], 1)
w = torch.cat([w, torch.rand(32, 64, generator=torch.Generator().manual_seed(2))], 1)
if what == "small":
    res["seqsum"] = kf.same(kd.seq_sum(x), ts._seq_sum_eager(x, False))
    res["q3"] = kf.same(kd.q3_search(x[:16], 4, ts.GROUP_MAX_EPS), ts.make_q3_quants_eager(x[:16], 4))
    res["qp"] = kf.same(kd.qp_search(x[:8].abs(), 63, w[:8], ts.GROUP_MAX_EPS),
                        ts.make_qp_quants_eager(x[:8].abs(), 63, w[:8]))
    res["qp32"] = kf.same(kd.qp_search(x.abs(), 3, w, ts.GROUP_MAX_EPS), ts.make_qp_quants_eager(x.abs(), 3, w))
elif what in ("encoders", "encoders_small"):
    # (nmax, rmin, rdelta, nstep, mad): the small run walks fewer candidate scales of the same kernels
    small = what == "encoders_small"
    for args in ((15, -0.9, 0.05, 4 if small else 36, False), (3, -0.5, 0.1, 3 if small else 15, True)):
        rows = 16 if args[0] == 3 and small else 32
        res[f"qkx{args[0]}"] = kf.same(kf.qkx_search(x[:rows], w[:rows], *args),
                                       ts.make_qkx_quants_eager(x[:rows], w[:rows], *args))
    res["qx"] = kf.same(kf.qx_search(x[:16], 32, w[:16], ts.GROUP_MAX_EPS), ts.make_qx_quants_eager(x[:16], 32, w[:16]))
    res["qx_x2"] = kf.same(kf.qx_search(x[:16], 4, None, ts.GROUP_MAX_EPS), ts.make_qx_quants_eager(x[:16], 4, None))
else:
    qtype, small = what.removesuffix("_small"), what.endswith("_small")
    xs, qw = T.edge_superblocks(1 if small else 4 if qtype in ("IQ2_S", "IQ2_XS") else 2, dev)
    a = list(T.iq_search_inputs(qtype, xs, qw))
    if small:  # fewer candidate scales around the seed: the same kernel, a shorter loop
        a[5] = 2
    res[qtype] = kf.same(kg.search(qtype, *a), tg.search_eager(tg.device_codebook(qtype, "cpu"), *a))
print(json.dumps(res))
"""


def _interpret(what: str, script: str = _CHECK) -> dict:
    out = interpret(script, what, os.path.dirname(__file__), timeout=3000)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_descent_and_sum_kernels_equal_eager_in_interpreter():
    assert _interpret("small") == {"seqsum": True, "q3": True, "qp": True, "qp32": True}


def test_kquant_search_kernels_equal_eager_in_interpreter_small():
    """triton_search's make_qkx / make_qx kernels on a few candidate scales: the default suite's run."""
    assert _interpret("encoders_small") == {"qkx15": True, "qkx3": True, "qx": True, "qx_x2": True}


@pytest.mark.slow
def test_kquant_search_kernels_equal_eager_in_interpreter():
    assert _interpret("encoders") == {"qkx15": True, "qkx3": True, "qx": True, "qx_x2": True}


@pytest.mark.parametrize("qtype", ["IQ2_XXS", "IQ2_S"])
def test_lattice_search_kernel_equals_eager_in_interpreter_small(qtype):
    """triton_grid's lattice search on one super-block and a few candidate scales: the default suite's run."""
    assert _interpret(f"{qtype}_small") == {qtype: True}


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["IQ2_S", "IQ3_S", "IQ2_XXS"])
def test_lattice_search_kernel_equals_eager_in_interpreter(qtype):
    assert _interpret(qtype) == {qtype: True}


@pytest.mark.slow
def test_encoders_with_fused_kernels_equal_numpy_in_interpreter():
    """The whole torch path with every kind of fused kernel in use (each variant passing its first-use check)."""
    res = _interpret("", _ENCODERS)
    assert res.pop("variants") == ["grid", "q3", "qkx", "qp", "qx", "seqsum"]
    assert res == {t: True for t in ("Q4_K", "Q3_K", "Q6_K", "Q2_K", "IQ2_S", "Q4_1")}


def test_fused_path_is_off_on_cpu_and_by_switch(monkeypatch):
    x = torch.zeros(4, 4)
    assert not triton_search.use_fused(x)
    monkeypatch.setenv("MIXQ_KQUANT_FUSED", "0")
    assert not triton_search.fused_ok("cuda:0")


def test_variant_that_differs_falls_back_with_a_warning():
    key = ("test-variant", 1)
    with pytest.warns(UserWarning, match="differs from the eager path"):
        assert not triton_search.variant_ok(key, lambda: False)
    assert not triton_search.variant_ok(key, lambda: True)  # decided once per process
    triton_search._VARIANTS.pop(key)


# ----------------------------------------------------------------------------- CUDA

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _big_blocks(n: int, lanes: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n * 7 + lanes)
    x = torch.randn(n, lanes, generator=g) * torch.exp(torch.randn(1, lanes, generator=g))
    x = x.to(torch.bfloat16).float()
    w = torch.exp(torch.randn(n, lanes, generator=g))
    ex, ew = triton_search.edge_blocks(n, torch.device("cpu"))
    return torch.cat([ex, x], 1).to(device), torch.cat([ew, w], 1).to(device)


@pytest.mark.gpu
@needs_cuda
def test_cuda_kquant_kernels_equal_eager():
    x, w = _big_blocks(32, 200_000, "cuda")
    for args in ((15, -0.9, 0.05, 36, False), (15, -1.0, 0.1, 20, False), (31, -0.5, 0.1, 15, False),
                 (3, -0.5, 0.1, 15, True), (3, -0.9, 0.05, 36, False), (31, -0.9, 0.05, 36, False)):
        n = 16 if args[0] == 3 else 32
        assert triton_search.same(triton_search.qkx_search(x[:n], w[:n], *args),
                                  ts.make_qkx_quants_eager(x[:n], w[:n], *args)), args
    for nmax, qw in ((32, None), (32, w[:16]), (4, w[:16]), (8, w[:32]), (16, w[:32])):
        n = qw.shape[0] if qw is not None else 16
        assert triton_search.same(triton_search.qx_search(x[:n], nmax, qw, ts.GROUP_MAX_EPS),
                                  ts.make_qx_quants_eager(x[:n], nmax, qw)), nmax
    assert triton_search.same(triton_descent.q3_search(x[:16], 4, ts.GROUP_MAX_EPS),
                              ts.make_q3_quants_eager(x[:16], 4))
    for n, nmax in ((8, 63), (16, 15), (32, 4)):
        a = x[:n].abs()
        assert triton_search.same(triton_descent.qp_search(a, nmax, w[:n], ts.GROUP_MAX_EPS),
                                  ts.make_qp_quants_eager(a, nmax, w[:n])), (n, nmax)
    for n in (16, 32, 256):
        xx = x.reshape(-1)[: n * 50_000].reshape(n, -1)
        for first in (False, True):
            assert triton_search.same(triton_descent.seq_sum(xx, first), ts._seq_sum_eager(xx, first))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("qtype", list(IQ_SETUPS))
def test_cuda_lattice_kernel_equals_eager(qtype):
    xs, qw = edge_superblocks(512, "cuda")
    a = iq_search_inputs(qtype, xs, qw)
    assert triton_search.same(triton_grid.search(qtype, *a), tg.search_eager(tg.device_codebook(qtype, "cuda"), *a))


@pytest.mark.gpu
@needs_cuda
def test_cuda_encoders_trust_every_fused_variant():
    x = np.random.default_rng(4).standard_normal((64, 1024)).astype(np.float32) * 0.02
    im = np.random.default_rng(5).random(1024).astype(np.float32)
    triton_search._VARIANTS.clear()
    for t in encoders.SUPPORTED:
        for imx in (None, im):
            if imx is None and t in encoders.REQUIRES_IMATRIX:
                continue
            assert np.array_equal(encoders.quantize(x, t, imx, device="cuda"), encoders.quantize(x, t, imx)), t
    used = dict(triton_search._VARIANTS)
    assert {k[0] for k in used} >= {"qkx", "qx", "qp", "q3", "grid", "seqsum"}
    assert all(used.values()), [k for k, ok in used.items() if not ok]
