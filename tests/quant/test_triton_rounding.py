"""The fused kernels of the Hessian rounding against the eager torch they replace: the code descent
(quant/ggml/triton_kernels/refine.py) against refine_codes' column loop, bytes equal; the IQ2_S codebook search
(quant/ggml/triton_kernels/iq2s.py) against the score table, the same entries up to near-ties; the IQ2_S group
descent (quant/ggml/triton_kernels/iq2s_descent.py) against refine_iq2's group loop, the same layer error and nearly
all the same groups (an inverse of H_BB and sums in another order move near-ties), and one window of it checked
inside; the sub-block scale descent (quant/ggml/triton_kernels/subscales.py) against refine_sub_scales' sub-block
loop, the same layer error and nearly all the same scales and mins (sums in another order could move near-ties; the
bytes were equal when written), and one window of it replayed in float64, move by move.

On the CPU the kernel runs in Triton's interpreter (a subprocess with TRITON_INTERPRET=1, set before triton is
imported): the default suite on small problems (a few rows, one or two windows), the `slow` runs on the full ones;
the `gpu` test compiles it for the device. Both compare the bytes of refine_codes with the kernel and with the eager
loop, for feedback windows that cover every column, whole windows and a partial last window. Triton is required
under CI (tests/triton_helpers.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from triton_helpers import interpret as interpreted

pytestmark = pytest.mark.usefixtures("needs_triton")  # a skip without Triton, a failure under CI

# what the scripts share: the device argument, the real use_fused, and one random problem (weights, a Hessian of 3n/2
# tokens with a few outlier channels, damped, per expert or one for all, ggml's own encoding of the weights)
_PROBLEM = r"""
import json, sys
import numpy as np, torch
from mixq.quant.ggml import encoders
from mixq.quant.ggml.rounding import hessian as kh
from mixq.quant.ggml.rounding import levels as gl
dev, small = sys.argv[1], sys.argv[2] == "small"  # "small": the default suite's sizes
fused = kh.use_fused


def problem(g, qtype, E, R, n, shared=False):
    w = torch.randn(E, R, n, generator=g) * 0.02
    x = torch.randn(1 if shared else E, 3 * n // 2, n, generator=g)
    x[..., :7] *= 5
    h = x.mT @ x / x.shape[1]
    h = h + 0.1 * torch.diagonal(h, dim1=-2, dim2=-1).mean(-1)[:, None, None] * torch.eye(n)
    blocks = np.stack([encoders.quantize(w[e].numpy(), qtype) for e in range(E)])
    return w, h, blocks
"""

_CHECK = _PROBLEM + r"""
res = {}
g = torch.Generator().manual_seed(0)
cases = ((("Q4_K", 256, None), ("Q8_0", 192, 64)) if small else
         (("Q4_K", 512, None), ("Q6_K", 768, 256), ("Q8_0", 768, 512), ("IQ4_NL", 256, 128)))
for qtype, n, window in cases:
    w, h, blocks = problem(g, qtype, 2, 4 if small else 24, n)
    wd, hd = w.to(dev), h.to(dev)
    kh.FEEDBACK_WINDOW["cpu"] = kh.FEEDBACK_WINDOW["accelerator"] = window
    kh.use_fused = fused
    a = kh.refine_codes(wd, blocks, qtype, hd, 2)
    kh.use_fused = lambda t: False
    b = kh.refine_codes(wd, blocks, qtype, hd, 2)
    res[qtype] = {"fused_ran": bool(fused(wd)), "equal": bool(np.array_equal(a, b)),
                  "moved": float((a != blocks).mean())}
print(json.dumps(res))
"""


_NEAREST = r"""
import json, sys
import numpy as np, torch
from mixq.quant.ggml.rounding import levels as gl
from mixq.quant.ggml.triton_kernels import iq2s as triton_iq2s
dev, small = sys.argv[1], sys.argv[2] == "small"
g = torch.Generator().manual_seed(3)
grid = torch.from_numpy(gl.iq2_grid("IQ2_S")).to(dev)
res = {}
for E, R, k, shared in (((2, 5, 8, False), (1, 7, 1, True)) if small else
                        ((2, 40, 8, False), (3, 130, 1, True), (1, 7, 8, True))):
    scale = (torch.rand(E, R, 1, generator=g) * 0.01 + 1e-4)
    target = torch.randn(E, R, 8, generator=g) * 0.02
    target[0, 0] = 0.0                                   # the entries of smallest weighted norm, in order
    metric = torch.rand(1 if shared else E, 8, generator=g) + 0.1
    got = triton_iq2s.nearest_entries(scale.to(dev), metric.to(dev), target.to(dev), grid, k).cpu()
    s64 = scale.double() ** 2 * ((grid.cpu().double() ** 2) @ metric.double().unsqueeze(-1)).transpose(-1, -2) \
        - 2 * scale.double() * ((metric.double().unsqueeze(-2) * target.double().abs()) @ grid.cpu().double().T)
    best = s64.sort(-1).values[..., :k]
    mine = s64.gather(-1, got)
    tol = 1e-5 * s64.abs().amax(-1, keepdim=True)
    res[f"{E}x{R}x{k}"] = {"sorted": bool((mine[..., 1:] >= mine[..., :-1] - tol).all()),
                          "smallest": bool(((mine - best).abs() <= tol).all()),
                          "distinct": bool(all(len(set(r.tolist())) == k for r in got.reshape(-1, k))),
                          "tie_order": got[0, 0].tolist() == s64[0, 0].argsort(stable=True)[:k].tolist()}
print(json.dumps(res))
"""


_IQ2S = _PROBLEM + r"""
from mixq.quant.ggml.triton_kernels import iq2s_descent as td
if fused(torch.zeros(1, device=dev)):  # the kernel under test serves only where asked for
    if small:  # without its first-use check (a problem of its own, larger than these)
        kh.FUSED_SWEEPS[("iq2s", str(torch.device(dev)))] = True
    else:
        kh.allow_fused_sweep("iq2s", torch.device(dev))
chunk = td.CHUNK
res = {}
g = torch.Generator().manual_seed(5)
# (n, one Hessian for every expert, feedback window, passes, codebook chunk): whole windows, a partial last one and
# one window for every column; the default chunk merges shortlists across chunks, the whole codebook at once keeps
# the interpreter quick
for n, shared, window, passes, ch in (((256, False, 128, 1, 1024),) if small else
                                     ((512, True, 256, 1, None), (512, True, 384, 1, 1024),
                                      (512, False, 384, 1, 1024), (256, False, 256, 2, 1024))):
    E, R = (1, 8) if small else (2, 24)
    w, h, blocks = problem(g, "IQ2_S", E, R, n, shared)
    wd, hd = w.to(dev), h.to(dev)
    kh.FEEDBACK_WINDOW["cpu"] = kh.FEEDBACK_WINDOW["accelerator"] = window
    td.CHUNK = ch or chunk
    kh.use_fused = fused
    a = kh.refine_iq2(wd, blocks, "IQ2_S", hd, passes)
    kh.use_fused = lambda t: False
    b = kh.refine_iq2(wd, blocks, "IQ2_S", hd, passes)
    err = lambda bl: float(kh.layer_error(wd, gl.decode_blocks(bl, "IQ2_S", dev).reshape(w.shape), hd).sum())
    (ia, sa), (ib, sb), (i0, s0) = gl.iq2_groups(a, "IQ2_S"), gl.iq2_groups(b, "IQ2_S"), gl.iq2_groups(blocks, "IQ2_S")
    res[f"{n}/{window}{' shared' if shared else ''} x{passes}"] = {
        "fused_ran": bool(fused(wd)), "start": err(blocks), "fused": err(a), "eager": err(b),
        "agree": float(((ia == ib) & (sa == sb)).mean()), "moved": float(((ib != i0) | (sb != s0)).mean())}
td.CHUNK = 1024 if dev == "cpu" else chunk
# one window (not the first) straight through the kernel: its values, codes, gradient and pending agree
n, E, R, w0 = (256, 1, 8, 128) if small else (512, 2, 24, 256)
w = torch.randn(E, R, n, generator=g) * 0.02
x = torch.randn(E, 3 * n // 2, n, generator=g)
h = (x.mT @ x / x.shape[1] + 0.1 * torch.eye(n)).to(dev).contiguous()
blocks = np.stack([encoders.quantize(w[e].numpy(), "IQ2_S") for e in range(E)])
w = w.to(dev)
grid = torch.from_numpy(gl.iq2_grid("IQ2_S")).to(dev)
db = gl.iq2_group_scales_on(blocks, "IQ2_S", dev).contiguous()
index, signs = (t.contiguous() for t in gl.iq2_groups_on(blocks, "IQ2_S", dev))
val0 = gl.decode_blocks(blocks, "IQ2_S", dev).reshape(w.shape).contiguous()
val, grad = val0.clone(), ((w - val0) @ h).contiguous()
pending = torch.zeros(E, R, n - w0, device=dev)
td.iq2s_window(grad, h, td.group_inverses(kh.diagonal_blocks(h, 8)), val, db, index, signs, grid, grid.T.contiguous(),
               pending, w0, n - w0, kh.IQ2_SHORTLIST)
dec = gl.decode_blocks(gl.set_iq2_groups_on(blocks, "IQ2_S", index, signs), "IQ2_S", dev).reshape(w.shape)
want = ((w - val0) @ h)[..., w0:] + (val0 - val)[..., w0:] @ h[:, w0:, w0:]
res["window"] = {"fused_ran": bool(fused(w)), "decoded": bool(torch.equal(dec, val)),
                 "outside_kept": bool(torch.equal(val[..., :w0], val0[..., :w0])),
                 "pending": float((pending - (val0 - val)[..., w0:]).abs().max()),
                 "grad": float((grad[..., w0:] - want).abs().max() / want.abs().max()),
                 "moved": float((val != val0).any(-1).float().mean())}
print(json.dumps(res))
"""


_SUBSCALES = _PROBLEM + r"""
from mixq.quant.ggml.triton_kernels import subscales as ts
if fused(torch.zeros(1, device=dev)):  # the first-use check's own launches, before they are counted
    kh.fused_sweep_ok("sub_scales", torch.device(dev))
launches = [0]
window_call = ts.sub_scale_window
def counted(*args):
    launches[0] += 1
    return window_call(*args)
ts.sub_scale_window = counted
res = {}
g = torch.Generator().manual_seed(11)
# (type, one Hessian for every expert, feedback window): mins or none, sub-blocks of 32 and 16, whole windows, a
# partial last one and one window for every column
for qtype, shared, window in ((("Q4_K", False, 128), ("Q6_K", True, 256)) if small else
                             (("Q4_K", True, 256), ("Q4_K", False, 384), ("Q6_K", False, 512), ("Q6_K", True, 384),
                              ("Q2_K", False, 256), ("Q3_K", True, 512), ("IQ2_S", False, 384), ("IQ2_S", True, 256))):
    E, R, n = (1, 8, 256) if small else (2, 24, 512)
    w, h, blocks = problem(g, qtype, E, R, n, shared)
    wd, hd = w.to(dev), h.to(dev)
    kh.FEEDBACK_WINDOW["cpu"] = kh.FEEDBACK_WINDOW["accelerator"] = window
    kh.use_fused = fused
    launches[0] = 0
    a = kh.refine_sub_scales(wd, blocks, qtype, hd)
    ran = launches[0]
    kh.use_fused = lambda t: False
    b = kh.refine_sub_scales(wd, blocks, qtype, hd)
    err = lambda bl: float(kh.layer_error(wd, gl.decode_blocks(bl, qtype, dev).reshape(w.shape), hd).sum())
    (sa, ma), (sb, mb), (s0, m0) = gl.sub_scales(a, qtype), gl.sub_scales(b, qtype), gl.sub_scales(blocks, qtype)
    same, moved = sa == sb, sb != s0
    if m0 is not None:
        same, moved = same & (ma == mb), moved | (mb != m0)
    res[f"{qtype}/{window}{' shared' if shared else ''}"] = {
        "fused_ran": bool(fused(wd)) and ran == -(-n // window), "start": err(blocks), "fused": err(a),
        "eager": err(b), "agree": float(same.mean()), "moved": float(moved.mean()), "equal": bool(np.array_equal(a, b))}
# one window (not the first) straight through the kernel, on random fields with many at their range's ends: every
# choice is the best admissible move of a float64 replay (up to rounding), and the gradient and pending follow it;
# where a row's min has its scale's slopes, the two fields tie and the scale (the earlier candidate) must win
n, E, R = (256, 1, 16) if small else (512, 2, 24)
for sub, sc_range, mn_range, shared, w0, width in (((32, (0, 63), (0, 63), False, 128, 128),
                                                    (16, (-32, 31), None, True, 64, 192)) if small else
                                                   ((32, (0, 63), (0, 63), False, 256, 256),
                                                    (16, (-32, 31), None, True, 128, 384))):
    x = torch.randn(1 if shared else E, 3 * n // 2, n, generator=g)
    h = (x.mT @ x / x.shape[1] + 0.1 * torch.eye(n)).to(dev).contiguous()
    ranges = [sc_range] + ([mn_range] if mn_range else [])
    vals0, slopes = [], []
    for lo, hi in ranges:
        v = torch.randint(lo, hi + 1, (E, R, n // sub), generator=g)
        edge = torch.rand(v.shape, generator=g)
        vals0.append(torch.where(edge < 0.25, lo, torch.where(edge > 0.75, hi, v)).to(dev))
        slopes.append((torch.randn(E, R, n, generator=g) * 0.01).to(dev))
    if mn_range:
        slopes[1][:, :6] = slopes[0][:, :6]
    quads = [ts.sub_block_quads(a, kh.diagonal_blocks(h, sub)) for a in slopes]
    grad0 = ((torch.randn(E, R, n, generator=g) * 0.05).to(dev) @ h).contiguous()
    grad, vals = grad0.clone(), [v.clone() for v in vals0]
    pending = torch.zeros(E, R, width, device=dev)
    none = [None] * (2 - len(ranges))
    window_call(grad, h, *(vals + none), *(slopes + none), *(quads + none), pending, w0, width, sub, *(ranges + none))
    gr, hw, want = grad0[..., w0:w0 + width].double(), h.double()[:, :, w0:w0 + width], torch.zeros_like(pending)
    wrong, picks, ties, tie_lost = 0, torch.zeros(2 * len(ranges), dtype=torch.long), 0, 0
    for j in range(w0 // sub, (w0 + width) // sub):
        c = slice(j * sub - w0, (j + 1) * sub - w0)
        dls, scale, kc = [], 0, torch.full((E, R), -1, device=dev)
        for f, ((lo, hi), v, a, q) in enumerate(zip(ranges, vals0, slopes, quads)):
            lin = (a[..., j * sub:(j + 1) * sub].double() * gr[..., c]).sum(-1)
            scale = scale + 2 * lin.abs() + q[..., j].double().abs()
            for k, sign in enumerate((1, -1)):
                ok = (v[..., j] + sign >= lo) & (v[..., j] + sign <= hi)
                dls.append(torch.where(ok, -2 * sign * lin + q[..., j].double(), float("inf")))
            d = vals[f][..., j] - v[..., j]
            kc = torch.where(d == 1, 2 * f, torch.where(d == -1, 2 * f + 1, kc))
        dl = torch.stack(dls, -1)
        best = dl.min(-1).values.clamp(max=0)
        mine = torch.where(kc >= 0, dl.gather(-1, kc.clamp(min=0)[..., None])[..., 0], 0.0)
        wrong += int(((mine - best).abs() > 1e-4 * scale).sum())
        picks += torch.bincount(kc[kc >= 0].cpu(), minlength=len(picks))
        if mn_range:  # the kernel's pick tied with the other field's move of the same sign
            tied = (kc >= 0) & (mine == dl.gather(-1, (kc.clamp(min=0) ^ 2)[..., None])[..., 0])
            ties, tie_lost = ties + int(tied.sum()), tie_lost + int((tied & (kc >= 2)).sum())
        change = torch.zeros(E, R, sub, device=dev)
        for f, a in enumerate(slopes):
            for k, sign in enumerate((1, -1)):
                change = torch.where((kc == 2 * f + k)[..., None], -sign * a[..., j * sub:(j + 1) * sub], change)
        want[..., c] = change
        gr = gr + change.double() @ hw[:, j * sub:(j + 1) * sub]
    res[f"window {sub}"] = {
        "wrong": wrong, "picks": picks.tolist(), "ties": ties, "tie_lost": tie_lost, "moved": float((picks.sum() / (E * R * width // sub)).item()),
        "in_range": all(bool(((v >= lo) & (v <= hi)).all()) for v, (lo, hi) in zip(vals, ranges)),
        "outside_kept": all(bool(torch.equal(torch.cat([v[..., :w0 // sub], v[..., (w0 + width) // sub:]], -1),
                                             torch.cat([v0[..., :w0 // sub], v0[..., (w0 + width) // sub:]], -1)))
                            for v, v0 in zip(vals, vals0))
        and bool(torch.equal(torch.cat([grad[..., :w0], grad[..., w0 + width:]], -1),
                             torch.cat([grad0[..., :w0], grad0[..., w0 + width:]], -1))),
        "pending": float((pending - want).abs().max()),
        "grad": float((grad[..., w0:w0 + width] - gr).abs().max() / gr.abs().max())}
print(json.dumps(res))
"""


def _run(dev: str, interpret: bool, script: str = _CHECK, size: str = "full") -> dict:
    if interpret:
        out = interpreted(script, dev, size)
    else:
        out = subprocess.run([sys.executable, "-c", script, dev, size], capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check(res: dict) -> None:
    for qtype, r in res.items():
        assert r["fused_ran"], qtype
        assert r["moved"] > 0, qtype          # the descent moved codes, so equal bytes say something
        assert r["equal"], qtype


def _check_nearest(res: dict) -> None:
    for case, r in res.items():
        assert r["sorted"] and r["smallest"] and r["distinct"] and r["tie_order"], (case, r)


def _check_iq2s(res: dict) -> None:
    win = res.pop("window")
    assert win["fused_ran"] and win["moved"] > 0.2, win
    assert win["decoded"] and win["outside_kept"], win      # the kernel's values are its codes' decode
    assert win["pending"] == 0.0 and win["grad"] < 1e-4, win
    for case, r in res.items():
        assert r["fused_ran"] and r["moved"] > 0.2, (case, r)
        assert r["eager"] < r["start"] and r["fused"] < r["start"], (case, r)
        assert abs(r["fused"] / r["eager"] - 1) < 1e-3, (case, r)
        assert r["agree"] >= 0.95, (case, r)


def _check_sub_scales(res: dict) -> None:
    for case in [c for c in res if c.startswith("window")]:
        win = res.pop(case)
        assert win["wrong"] == 0 and win["in_range"] and win["outside_kept"], (case, win)
        assert all(p > 0 for p in win["picks"]) and win["moved"] > 0.2, (case, win)  # every candidate taken
        assert win["tie_lost"] == 0 and (win["ties"] > 0 or case == "window 16"), (case, win)  # the earlier wins
        assert win["pending"] == 0.0 and win["grad"] < 1e-5, (case, win)
    for case, r in res.items():
        assert r["fused_ran"] and r["moved"] > 0.1, (case, r)
        assert r["eager"] < r["start"] and r["fused"] < r["start"], (case, r)
        assert abs(r["fused"] / r["eager"] - 1) < 1e-3, (case, r)
        assert r["agree"] >= 0.95, (case, r)


# the default suite runs each kernel on small problems ("small"); the `slow` runs take the full sizes
@pytest.mark.parametrize("size", ["small", pytest.param("full", marks=pytest.mark.slow)])
def test_fused_code_descent_is_the_column_loop_interpreted(size):
    _check(_run("cpu", interpret=True, size=size))


@pytest.mark.parametrize("size", ["small", pytest.param("full", marks=pytest.mark.slow)])
def test_fused_iq2s_search_finds_the_nearest_entries_interpreted(size):
    _check_nearest(_run("cpu", interpret=True, script=_NEAREST, size=size))


@pytest.mark.parametrize("size", ["small", pytest.param("full", marks=pytest.mark.slow)])
def test_fused_iq2s_descent_is_the_group_loop_interpreted(size):
    _check_iq2s(_run("cpu", interpret=True, script=_IQ2S, size=size))


@pytest.mark.parametrize("size", ["small", pytest.param("full", marks=pytest.mark.slow)])
def test_fused_sub_scale_descent_is_the_sub_block_loop_interpreted(size):
    _check_sub_scales(_run("cpu", interpret=True, script=_SUBSCALES, size=size))


@pytest.mark.gpu
def test_fused_code_descent_is_the_column_loop_on_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _check(_run("cuda", interpret=False))
    _check_nearest(_run("cuda", interpret=False, script=_NEAREST))
    _check_iq2s(_run("cuda", interpret=False, script=_IQ2S))
    _check_sub_scales(_run("cuda", interpret=False, script=_SUBSCALES))
