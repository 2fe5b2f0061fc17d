"""quant/trellis/viterbi_triton.py: the fused Triton Viterbi against the torch path of quant/trellis/viterbi.py.

On the CPU the kernels run in Triton's interpreter (a subprocess with TRITON_INTERPRET=1, which must be set before
triton is imported); the `gpu` tests compile them for the device and check many tiles at every rate.

Tolerances: the ``exact`` cost arithmetic is the torch path's own (fp32 c² − 2xc with one rounding, fp32 sums,
lowest index on ties), so its states must be identical. The default arithmetic (``mixed``: fp32 squares of fp16
differences c − fp16(x); ``fp32`` from K = 7) differs only by rounding: where both chose the same seam edge, a
tile's squared error may differ from the torch path's by at most what the rounded differences and the fp32
accumulations can move a path's cost (:func:`_rounding_bound`); over 2048 tiles (on the GPU) MSE/D(R) must agree
to 0.0005.
"""
from __future__ import annotations

import json

import pytest
import torch
from triton_helpers import interpret

from mixq.quant.trellis import codebooks as cb
from mixq.quant.trellis import viterbi

# The interpreter's generic reduction calls the combine function once per element in Python (hours for one tile):
# reduce as a balanced tree of adjacent pairs instead, vectorised (log2 n calls; for a selection that keeps the
# lower index on ties, as the kernel's, the same result as the in-order fold the GPU does within a thread). Its
# fma rounds twice; the host's addcmul (the torch path) rounds once where the CPU has FMA, so fma follows the
# host: then ``exact`` costs are bit-identical to the torch path's.
_CHECK = r"""
import json, sys
import numpy as np, torch
from triton.runtime import interpreter as ti


def tree_reduce(self, input):
    input, axis = self.unravel(input, self.axis)
    acc = tuple(np.moveaxis(a.handle.data, axis, -1) for a in input)
    while acc[0].shape[-1] > 1:
        if acc[0].shape[-1] % 2:  # odd length: fold the last element into the one before it
            lo = tuple(self.to_tensor(a[..., -2], i.dtype) for a, i in zip(acc, input))
            hi = tuple(self.to_tensor(a[..., -1], i.dtype) for a, i in zip(acc, input))
            r = self.combine_fn.fn(*lo, *hi)
            r = r if isinstance(r, tuple) else (r,)
            acc = tuple(np.concatenate([a[..., :-2], t.handle.data[..., None]], -1) for a, t in zip(acc, r))
            continue
        lo = tuple(self.to_tensor(a[..., 0::2], i.dtype) for a, i in zip(acc, input))
        hi = tuple(self.to_tensor(a[..., 1::2], i.dtype) for a, i in zip(acc, input))
        r = self.combine_fn.fn(*lo, *hi)
        acc = tuple(t.handle.data for t in (r if isinstance(r, tuple) else (r,)))
    return [self.to_tensor(np.expand_dims(a[..., 0], axis) if self.keep_dims else a[..., 0], i.dtype)
            for a, i in zip(acc, input)]


def fma_one_rounding(self, x, y, z):  # exact in float64 for these operands (fp16 × fp32 + fp32), then rounded once
    return ti.TensorHandle((x.data.astype(np.float64) * y.data + z.data).astype(z.data.dtype), z.dtype.scalar)


ti.ReduceOps.generic_reduce = tree_reduce
c = torch.randn(4096).half().float()
if torch.equal(torch.addcmul(c * c, torch.tensor([0.3]), c, value=-2.0),
               (c.double() * c.double() - 2 * torch.tensor(0.3).double() * c.double()).float()):
    ti.InterpreterBuilder.create_fma = fma_one_rounding

from mixq.quant.trellis import viterbi

from mixq.quant.trellis import viterbi_triton as viterbi_fused

from mixq.quant.trellis import codebooks as cb
bits, tiles, modes, ties = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4] == "1"
x = torch.randn(tiles, 256, generator=torch.Generator().manual_seed(int(2 * bits))) * 0.9
table = cb.codebook_table("mul1")
if ties:  # a coarse codebook and targets on its grid: many exactly equal costs, decided by the tie order
    table, x = (table * 4).round() / 4, (x * 4).round() / 4
out = {"x": x.tolist(), "table": table.tolist(), "torch": viterbi.viterbi_tiles(x, table, bits, warm=128).tolist()}
for m in modes:  # a mode: a cost arithmetic, optionally "+gather" (the other lowering of the cost exchange)
    costs, _, exchange = m.partition("+")
    out[m] = viterbi_fused.encode(x, table.half(), bits, costs=costs, exchange=exchange or "reshape",
                                  forward="triton").tolist()  # the Gluon forward has no interpreter
print(json.dumps(out))
"""


def _interpret(bits: float, tiles: int, modes: tuple[str, ...], ties: bool = False) -> dict[str, torch.Tensor]:
    out = interpret(_CHECK, str(bits), str(tiles), ",".join(modes), str(int(ties)), timeout=1800)
    assert out.returncode == 0, out.stderr[-2000:]
    return {k: torch.tensor(v) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


# quant/trellis/viterbi.py's own per-step kernels (the add-compare-select step and the one-launch traceback, which
# serve on CUDA where the fused encode does not): against the torch step and the torch pass. The same fma as above
# (one rounding where the host's addcmul rounds once) makes the costs, and so the states, the torch path's.
_STEP_CHECK = _CHECK[:_CHECK.index("from mixq.quant.trellis import viterbi")] + r"""
from mixq.quant.trellis import viterbi as v
from mixq.quant.trellis.codebooks import step_bits
v._build_triton()
g = torch.Generator().manual_seed(0)
table = torch.randn(v.NSTATES, generator=g)
table2 = table * table
out = {}
for dprev, dp in ((2, 2), (1, 2), (3, 3)):
    x = torch.randn(2, 1, generator=g)
    mprev = torch.randn(2, v.NSTATES >> dprev, generator=g)
    for free, mp in (("free", None), ("after", mprev)):
        a, b = v._acs_triton(mp, table, table2, x, dprev, dp), v._acs_torch(mp, table, table2, x, dprev, dp)
        out[f"acs {dprev}/{dp} {free}"] = bool(torch.equal(a, b))
x = torch.randn(2, 256, generator=g)
for bits, keep in ((2, 9), (2.5, 7)):  # the states of every position (as pass 2 keeps) or of the last ones
    d = step_bits(float(bits))
    pos = list(range(250, 256)) + list(range(3))
    sel = lambda c: c.argmin(dim=1)
    a = v._pass_triton(x, table, table2, d, pos, None, keep, sel)
    b = v._pass_torch(x, table, table2, d, pos, None, keep, sel)
    out[f"pass {bits}"] = bool(torch.equal(a, b)) and a.shape == (2, keep)
print(json.dumps(out))
"""


def test_per_step_kernels_are_the_torch_step_in_interpreter():
    """viterbi.py's add-compare-select kernel gives the torch step's minima (free start and after a step, at
    several step widths), and a short pass through it and the traceback kernel the torch pass's states."""
    out = interpret(_STEP_CHECK, timeout=1200)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(res) == 8 and all(res.values()), res


def _rounding_bound(states: torch.Tensor, x: torch.Tensor, table: torch.Tensor, costs: str) -> torch.Tensor:
    """Per tile, how far rounding can move the computed cost of the path ``states`` (T, 256) from the exact
    Σ(c − x)² (up to the constant Σx²): the rounded differences' |Σ (d̃² − (c − x)²)| (``mixed``:
    d̃ = fl16(c − fl16(x)); ``fp32``: that minus x − fl16(x)), plus one fp32 rounding per step and addition
    (≤ 2^-24 × the magnitude of the running sum: Σ d̃² for the kernel, Σ |c² − 2xc| for the torch path)."""
    c = table[states].double()
    xd = x.double()
    xf = xd.float()
    dr = (c.half() - xf.half()).float()  # the kernel's fp16 difference (c is fp16-exact)
    if costs == "fp32":  # corrected by what fp16(x) dropped
        dr = dr - (xf - xf.half().float())
    dr = dr.double()
    moved = (dr.square() - (c - xd).square()).sum(1).abs()
    magnitude = torch.maximum(dr.square().sum(1), (c.square() + 2 * (xd * c).abs()).sum(1))
    return moved + 512 * 2.0 ** -24 * magnitude


def _assert_within_rounding(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, table: torch.Tensor,
                            bits: float, costs: str) -> None:
    """``a`` (the kernel in ``costs``) against ``b`` (the torch path): consistent rings, and where both chose the
    same seam edge (pass 2 then solves the same problem) each path is optimal for its own rounded costs, so their
    exact squared errors differ by at most the two rounding bounds. (Pass 1 picks the seam edge from near-equal
    candidates: a rounding difference may pick another, a ring up to ~1% better or worse; only averages over many
    tiles compare those, see :func:`_assert_same_distortion`.)"""
    assert viterbi.ring_consistent(a, bits)
    ja = (table[a].double() - x.double()).square().sum(1)
    jb = (table[b].double() - x.double()).square().sum(1)
    d0 = cb.step_bits(float(bits))[0]
    same = (a[:, 0] >> d0) == (b[:, 0] >> d0)
    slack = (_rounding_bound(a, x, table, costs) + _rounding_bound(b, x, table, costs))[same]
    assert bool(((ja - jb)[same].abs() <= slack).all()), float(((ja - jb)[same].abs() - slack).max())


def _assert_same_distortion(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, table: torch.Tensor,
                            bits: float) -> None:
    """MSE/D(R) of many tiles (x ~ N(0, 0.81)) no worse than 0.0005 above the torch path's. One-sided: at K = 7, 8
    the torch path's fp32 c² − 2xc cancels (its error is ~2^-16 of x², the size of the trellis error), and the
    fused ``fp32`` costs, exact near the target, come out better (H200: by 0.6% of D(R) at K = 8)."""
    ea = (table[a].double() - x.double()).square().mean()
    eb = (table[b].double() - x.double()).square().mean()
    assert float(ea - eb) / (0.81 * 2.0 ** (-2 * bits)) <= 5e-4


def test_exact_costs_give_the_torch_path_states_in_interpreter():
    r = _interpret(2, 1, ("exact",))
    assert r["exact"].shape == (1, 256)
    assert torch.equal(r["exact"], r["torch"])


@pytest.mark.slow
@pytest.mark.parametrize("bits", [1, 1.5, 2.5, 3, 3.5, 4, 5, 8])
def test_every_rate_in_interpreter(bits):
    from mixq.quant.trellis.viterbi_triton import default_costs

    costs = default_costs(bits)
    r = _interpret(bits, 2, ("exact", costs))
    assert torch.equal(r["exact"], r["torch"])
    _assert_within_rounding(r[costs], r["torch"], r["x"], r["table"], bits, costs)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [2, 2.5])
def test_ties_go_to_the_lowest_predecessor_in_interpreter(bits):
    modes = ("exact", "fp32", "mixed", "fp16") + (("mixed+gather",) if bits == int(bits) else ())
    r = _interpret(bits, 1, modes, ties=True)
    for mode in modes:  # grid values: every difference, square and cost is exact in all four
        assert torch.equal(r[mode], r["torch"]), mode


@pytest.mark.slow
def test_fp16_costs_stay_close_in_interpreter():
    r = _interpret(2, 2, ("fp16",))
    table, x = r["table"], r["x"]
    assert viterbi.ring_consistent(r["fp16"], 2)
    ea = float((table[r["fp16"]] - x).square().mean())
    eb = float((table[r["torch"]] - x).square().mean())
    assert abs(ea - eb) <= 0.03 * eb  # a smoke test: fp16 costs may pick other seams (±1% per tile)


ALL_RATES = [1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8]


def _gpu_case(bits: float, tiles: int, ties: bool = False):
    dev = torch.device("cuda")
    x = (torch.randn(tiles, 256, generator=torch.Generator().manual_seed(int(2 * bits))) * 0.9).to(dev)
    table = cb.codebook_table("mul1", dev)
    if ties:
        table, x = (table * 4).round() / 4, (x * 4).round() / 4
    return x, table, viterbi.viterbi_tiles_reference(x, table, float(bits))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", ALL_RATES)
def test_default_costs_within_rounding_of_torch_path_on_gpu(bits):
    from mixq.quant.trellis import viterbi_triton as viterbi_fused

    x, table, ref = _gpu_case(bits, 2048)  # enough tiles that seam choices average out (see above)
    a = viterbi_fused.encode(x, table.half(), bits)
    costs = viterbi_fused.default_costs(bits)
    _assert_within_rounding(a.cpu(), ref.cpu(), x.cpu(), table.cpu(), bits, costs)
    _assert_same_distortion(a, ref, x, table, bits)
    assert viterbi.fused_ok(bits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", [2, 2.5, 3, 4])
@pytest.mark.parametrize("ties", [False, True])
def test_exact_costs_give_the_torch_path_states_on_gpu(bits, ties):
    from mixq.quant.trellis import viterbi_triton as viterbi_fused

    x, table, ref = _gpu_case(bits, 256, ties=ties)
    a = viterbi_fused.encode(x, table.half(), bits, costs="exact")
    assert torch.equal(a, ref), int((a != ref).any(1).sum())
