"""The fused code-descent kernel (quant/ggml/triton_refine.py) against the column loop of refine_codes it replaces.

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
    h = kh._damped(x.mT @ x / x.shape[1], 0.1)
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


def _run(dev: str, interpret: bool) -> dict:
    env = dict(os.environ, **({"TRITON_INTERPRET": "1"} if interpret else {}))
    out = subprocess.run([sys.executable, "-c", _CHECK, dev], env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check(res: dict) -> None:
    for qtype, r in res.items():
        assert r["fused_ran"], qtype
        assert r["moved"] > 0, qtype          # the descent moved codes, so equal bytes say something
        assert r["equal"], qtype


def test_fused_code_descent_is_the_column_loop_interpreted():
    _check(_run("cpu", interpret=True))


@pytest.mark.gpu
def test_fused_code_descent_is_the_column_loop_on_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _check(_run("cuda", interpret=False))
