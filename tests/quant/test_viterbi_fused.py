"""quant/viterbi_fused.py: the fused Triton Viterbi against the torch path of quant/viterbi.py.

On the CPU the kernels run in Triton's interpreter (a subprocess with TRITON_INTERPRET=1, which must be set before
triton is imported); the `gpu` test compiles them for the device and checks many tiles at every integer K.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mixq.quant import codebooks as cb
from mixq.quant import viterbi

_CHECK = r"""
import json, sys, torch
from mixq.quant import viterbi, viterbi_fused, codebooks as cb
bits, tiles = float(sys.argv[1]), int(sys.argv[2])
x = torch.randn(tiles, 256, generator=torch.Generator().manual_seed(int(2 * bits))) * 0.9
table = cb.codebook_table("mul1")
a = viterbi_fused.encode(x, table.half(), bits)
b = viterbi.viterbi_tiles(x, table, bits, warm=128)
print(json.dumps({"a": a.tolist(), "b": b.tolist(), "x": x.tolist()}))
"""


def _interpret(bits: float, tiles: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _CHECK, str(bits), str(tiles)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return torch.tensor(r["a"]), torch.tensor(r["b"]), torch.tensor(r["x"])


def _assert_same_encode(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, bits: float, tol: float,
                        rel: float = 0.0) -> None:
    table = cb.codebook_table("mul1", x.device)
    assert viterbi.ring_consistent(a, bits)
    ea = (table[a] - x).square().mean(1)
    eb = (table[b] - x).square().mean(1)
    same = (a == b).all(1)
    # identical rings, or (near-)ties broken the other way: the same squared error
    assert bool((same | ((ea - eb).abs() <= tol + rel * eb)).all()), (ea - eb).abs().max()


def test_fused_kernel_equals_torch_path_in_interpreter():
    a, b, x = _interpret(4, 1)
    assert a.shape == (1, 256)
    _assert_same_encode(a, b, x, 4, 1e-6)
    assert torch.equal(a, b)  # numpy's fp16 arithmetic reproduces the fp32 path's choices on this tile


@pytest.mark.slow
@pytest.mark.parametrize("bits", [1, 1.5, 2, 2.5, 3, 3.5, 5, 8])
def test_fused_kernel_every_rate_in_interpreter(bits):
    a, b, x = _interpret(bits, 2)
    _assert_same_encode(a, b, x, bits, 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", [1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8])
def test_fused_kernel_equals_torch_path_on_gpu(bits):
    from mixq.quant import viterbi_fused

    dev = torch.device("cuda")
    x = (torch.randn(96, 256, generator=torch.Generator().manual_seed(int(2 * bits))) * 0.9).to(dev)
    table = cb.codebook_table("mul1", dev)
    a = viterbi_fused.encode(x, table.half(), bits)
    b = viterbi.viterbi_tiles_reference(x, table, float(bits))
    # the kernel adds fp16 costs (the torch path fp32): equal squared error up to fp16's near-ties
    _assert_same_encode(a, b, x, bits, 1e-6, rel=2e-3)
    ea = float((table[a] - x).square().mean())
    eb = float((table[b] - x).square().mean())
    assert ea <= eb * 1.002
    assert viterbi.fused_ok(bits)
