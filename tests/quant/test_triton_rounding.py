"""The fused kernels of the Hessian rounding against the eager torch they replace: the code descent
(quant/ggml/triton_refine.py) against refine_codes' column loop, bytes equal; the IQ2_S codebook search
(quant/ggml/triton_iq2s.py) against the score table, the same entries up to near-ties; the IQ2_S group descent
(quant/ggml/triton_iq2s_descent.py) against refine_iq2s' group loop, the same layer error and nearly all the same
groups (an inverse of H_BB and sums in another order move near-ties), and one window of it checked inside.

On the CPU the kernel runs in Triton's interpreter (a subprocess with TRITON_INTERPRET=1, set before triton is
imported); the `gpu` test compiles it for the device. Both compare the bytes of refine_codes with the kernel and
with the eager loop, for feedback windows that cover every column, whole windows and a partial last window."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_CHECK = r"""
import json, sys
import numpy as np, torch
from mixq.quant.ggml import encoders, hessian_rounding as kh
dev = sys.argv[1]
fused = kh.use_fused
res = {}
g = torch.Generator().manual_seed(0)
for qtype, n, window in (("Q4_K", 512, None), ("Q6_K", 768, 256), ("Q8_0", 768, 512), ("IQ4_NL", 256, 128)):
    E, R = 2, 24
    w = torch.randn(E, R, n, generator=g) * 0.02
    x = torch.randn(E, 3 * n // 2, n, generator=g)
    x[..., :7] *= 5
    h = x.mT @ x / x.shape[1]
    h = h + 0.1 * torch.diagonal(h, dim1=-2, dim2=-1).mean(-1)[:, None, None] * torch.eye(n)
    blocks = np.stack([encoders.quantize(w[e].numpy(), qtype) for e in range(E)])
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
from mixq.quant.ggml import levels as gl, triton_iq2s
dev = sys.argv[1]
g = torch.Generator().manual_seed(3)
grid = torch.from_numpy(gl.iq2s_grid()).to(dev)
res = {}
for E, R, k, shared in ((2, 40, 8, False), (3, 130, 1, True), (1, 7, 8, True)):
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


_IQ2S = r"""
import json, sys
import numpy as np, torch
from mixq.quant.ggml import encoders, hessian_rounding as kh, levels as gl, triton_iq2s_descent as td
dev = sys.argv[1]
fused = kh.use_fused
chunk = td.CHUNK
res = {}
g = torch.Generator().manual_seed(5)
# (n, one Hessian for every expert, feedback window, passes, codebook chunk): whole windows, a partial last one and
# one window for every column; the default chunk merges shortlists across chunks, the whole codebook at once keeps
# the interpreter quick
for n, shared, window, passes, ch in ((512, True, 256, 1, None), (512, True, 384, 1, 1024),
                                      (512, False, 384, 1, 1024), (256, False, 256, 2, 1024)):
    E, R = 2, 24
    w = torch.randn(E, R, n, generator=g) * 0.02
    x = torch.randn(1 if shared else E, 3 * n // 2, n, generator=g)
    x[..., :7] *= 5
    h = x.mT @ x / x.shape[1]
    h = h + 0.1 * torch.diagonal(h, dim1=-2, dim2=-1).mean(-1)[:, None, None] * torch.eye(n)
    blocks = np.stack([encoders.quantize(w[e].numpy(), "IQ2_S") for e in range(E)])
    wd, hd = w.to(dev), h.to(dev)
    kh.FEEDBACK_WINDOW["cpu"] = kh.FEEDBACK_WINDOW["accelerator"] = window
    td.CHUNK = ch or chunk
    kh.use_fused = fused
    a = kh.refine_iq2s(wd, blocks, hd, passes)
    kh.use_fused = lambda t: False
    b = kh.refine_iq2s(wd, blocks, hd, passes)
    err = lambda bl: float(kh.layer_error(wd, gl.decode_blocks(bl, "IQ2_S", dev).reshape(w.shape), hd).sum())
    (ia, sa), (ib, sb), (i0, s0) = gl.iq2s_groups(a), gl.iq2s_groups(b), gl.iq2s_groups(blocks)
    res[f"{n}/{window}{' shared' if shared else ''} x{passes}"] = {
        "fused_ran": bool(fused(wd)), "start": err(blocks), "fused": err(a), "eager": err(b),
        "agree": float(((ia == ib) & (sa == sb)).mean()), "moved": float(((ib != i0) | (sb != s0)).mean())}
td.CHUNK = 1024 if dev == "cpu" else chunk
# one window (not the first) straight through the kernel: its values, codes, gradient and pending agree
n, E, R, w0 = 512, 2, 24, 256
w = torch.randn(E, R, n, generator=g) * 0.02
x = torch.randn(E, 3 * n // 2, n, generator=g)
h = (x.mT @ x / x.shape[1] + 0.1 * torch.eye(n)).to(dev).contiguous()
blocks = np.stack([encoders.quantize(w[e].numpy(), "IQ2_S") for e in range(E)])
w = w.to(dev)
grid = torch.from_numpy(gl.iq2s_grid()).to(dev)
db = gl.iq2s_group_scales_on(blocks, dev).contiguous()
index, signs = (t.contiguous() for t in gl.iq2s_groups_on(blocks, dev))
val0 = gl.decode_blocks(blocks, "IQ2_S", dev).reshape(w.shape).contiguous()
val, grad = val0.clone(), ((w - val0) @ h).contiguous()
pending = torch.zeros(E, R, 256, device=dev)
td.iq2s_window(grad, h, td.group_inverses(h), val, db, index, signs, grid, grid.T.contiguous(), pending, w0, 256,
               kh.IQ2S_SHORTLIST)
dec = gl.decode_blocks(gl.set_iq2s_groups_on(blocks, index, signs), "IQ2_S", dev).reshape(w.shape)
want = ((w - val0) @ h)[..., w0:] + (val0 - val)[..., w0:] @ h[:, w0:, w0:]
res["window"] = {"fused_ran": bool(fused(w)), "decoded": bool(torch.equal(dec, val)),
                 "outside_kept": bool(torch.equal(val[..., :w0], val0[..., :w0])),
                 "pending": float((pending - (val0 - val)[..., w0:]).abs().max()),
                 "grad": float((grad[..., w0:] - want).abs().max() / want.abs().max()),
                 "moved": float((val != val0).any(-1).float().mean())}
print(json.dumps(res))
"""


def _run(dev: str, interpret: bool, script: str = _CHECK) -> dict:
    env = dict(os.environ, **({"TRITON_INTERPRET": "1"} if interpret else {}))
    out = subprocess.run([sys.executable, "-c", script, dev], env=env, capture_output=True, text=True, timeout=1800)
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


def test_fused_code_descent_is_the_column_loop_interpreted():
    _check(_run("cpu", interpret=True))


def test_fused_iq2s_search_finds_the_nearest_entries_interpreted():
    _check_nearest(_run("cpu", interpret=True, script=_NEAREST))


def test_fused_iq2s_descent_is_the_group_loop_interpreted():
    _check_iq2s(_run("cpu", interpret=True, script=_IQ2S))


@pytest.mark.gpu
def test_fused_code_descent_is_the_column_loop_on_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _check(_run("cuda", interpret=False))
    _check_nearest(_run("cuda", interpret=False, script=_NEAREST))
    _check_iq2s(_run("cuda", interpret=False, script=_IQ2S))
