"""runtime/distributed.py and the EXL3 conversion over several ranks (gloo, CPU processes).

The end-to-end test converts a tiny MoE checkpoint in one process and over two CPU ranks (`devices="cpu,cpu"`)
and compares every output file's sha256. The trellis encoder is replaced (in this process, and in the workers
through a sitecustomize on PYTHONPATH) by a stand-in that is cheap but as sensitive as the real one to what
byte identity depends on: the whole stacked batch (a batch-wide scale), the seed, each unit's weight and its
Hessian; the dequantized weights it returns (the real trellis decoder) feed the next layer's calibration.
"""
from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import pytest
import torch

from mixq.runtime import distributed as D
from thread_helpers import at_threads
from mixq.errors import InputError

# ------------------------------------------------------------------------------------------------ pure parts


def test_parse_devices():
    assert D.parse_devices("0,1") == ("cuda:0", "cuda:1")
    assert D.parse_devices("cuda:1, cuda:0") == ("cuda:1", "cuda:0")
    assert D.parse_devices(["cpu", "cpu"]) == ("cpu", "cpu")
    assert D.parse_devices(None) == ()
    for bad, msg in [("0,0", "twice"), ("cpu,1", "one type"), ("gpu0", "not a device"), ("0,,1", "comma"),
                     ("cuda,cuda", "not a device")]:
        with pytest.raises(InputError, match=msg):
            D.parse_devices(bad)


def test_deal_balances_and_is_deterministic():
    costs = [5, 1, 1, 1, 4, 2, 2, 8]
    owner = D.deal(costs, 2)
    assert owner == D.deal(list(costs), 2)
    loads = [sum(c for c, o in zip(costs, owner) if o == r) for r in range(2)]
    assert sorted(loads) == [12, 12]
    assert owner[costs.index(8)] == 0  # largest first, to the least loaded (lowest) rank
    assert D.deal([3, 3, 3], 4) == [0, 1, 2]
    assert [D.block_owner(e, 6, 2) for e in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [D.block_owner(e, 3, 4) for e in range(3)] == [0, 1, 2]


def test_one_rank_context_is_a_no_op():
    one = D.RankContext()
    t = {"a": torch.arange(3)}
    assert one.is_main and one.share_tensors(t, src=0) is t
    assert one.broadcast_object({"x": 1}) == {"x": 1} and one.gather_objects(5) == [5]
    with D.rank_context((), "cpu") as ctx:
        assert (ctx.rank, ctx.world, ctx.device.type) == (0, 1, "cpu")


# ------------------------------------------------------------------------------------------------ two gloo ranks

def _sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"f32": torch.randn(3, 5, generator=g), "f16": torch.randn(7, generator=g).half(),
            "bf16": torch.randn(2, 3, generator=g).bfloat16(), "i16": torch.randint(-9, 9, (4, 2, 3), generator=g,
                                                                                    dtype=torch.int16),
            "scalar": torch.tensor(-123456, dtype=torch.int32), "empty": torch.zeros(0, 4), "flag": torch.tensor([True, False])}


def _share_from_rank1() -> dict:
    """Launch target: rank 1 shares its tensors; rank 0 returns what it received plus a gathered object."""
    import torch.distributed as dist

    ctx = D.RankContext(dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    got = ctx.share_tensors(_sample_tensors() if ctx.rank == 1 else None, src=1)
    return {"tensors": got, "gathered": ctx.gather_objects(ctx.rank * 10), "obj": ctx.broadcast_object(
        "from 1" if ctx.rank == 1 else None, src=1)}


def _fail_on_rank1(kind: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        if kind == "input":
            raise InputError("calibration file not found: x.txt")
        raise ZeroDivisionError("boom")
    dist.barrier()  # rank 0 waits in a collective: the launcher must end it


@pytest.mark.slow  # ~15 s of process start-up; the conversion test below shares every dtype it writes
def test_share_tensors_bit_exact_over_two_ranks():
    res = D.launch(_share_from_rank1, (), ("cpu", "cpu"))
    want = _sample_tensors()
    assert list(res["tensors"]) == list(want)
    for k, t in want.items():
        got = res["tensors"][k]
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k
    assert res["gathered"] == [0, 10] and res["obj"] == "from 1"


@pytest.mark.parametrize("kind", ["input", pytest.param("crash", marks=pytest.mark.slow)])
def test_a_failing_rank_ends_every_rank_with_one_error(kind):
    t0 = time.monotonic()
    if kind == "input":
        with pytest.raises(InputError, match="^calibration file not found: x.txt$"):
            D.launch(_fail_on_rank1, (kind,), ("cpu", "cpu"))
    else:
        with pytest.raises(D.RankError, match=r"rank 1 \(cpu\) failed: ZeroDivisionError: boom"):
            D.launch(_fail_on_rank1, (kind,), ("cpu", "cpu"))
    # no wait for the collective timeout (MIXQ_DIST_TIMEOUT_S, 1800 s): far below it on any machine, however slow
    # its process start-up
    assert time.monotonic() - t0 < D.timeout_s() / 2


# ------------------------------------------------------------------------------------------------ the conversion

FAKE_TRELLIS_SITE = '''
import torch
import mixq.quant.trellis as _t

def _pad(x):
    return -(-x // 128) * 128

def fake_quantize(weight, bits, hessian=None, codebook="mul1", seed=0):
    stacked = weight.dim() == 3
    w = weight.float() if stacked else weight.float()[None]
    h = None if hessian is None else (hessian.float() if stacked else hessian.float()[None])
    # batch-wide, as the real encoder's global scale; a max, exact in any order: a float sum over the whole
    # tensor is split over torch's threads (from 32768 elements), so its last bit follows the thread count
    scale = float(w.abs().amax()) + 1e-6
    out = []
    for i in range(w.shape[0]):
        out_f, in_f = w.shape[1:]
        k, n = _pad(in_f), _pad(out_f)
        wi = w[i] / scale
        if h is not None:
            d = h[i].diagonal()
            wi = wi * (1 + d / d.abs().max().clamp_min(1e-12)) + 1e-3 * h[i].sum(0) / in_f
        width = int(16 * bits) if bits == int(bits) else 16 * int(bits) + 8
        need = (k // 16) * (n // 16) * width
        codes = (wi.flatten() * 2048).round().long() + 977 * (seed + i)
        codes = codes.repeat(need // codes.numel() + 1)[:need].remainder(65536) - 32768
        suh = torch.zeros(k)
        svh = torch.zeros(n)
        suh[:in_f] = 0.05 * torch.tanh(wi.mean(0))
        svh[:out_f] = 0.05 * torch.tanh(wi.mean(1))
        out.append(FakeQuantized(trellis=codes.to(torch.int16).view(k // 16, n // 16, width),
                                 suh=suh.half(), svh=svh.half(), codebook="mul1", shape=(out_f, in_f)))
    return out if stacked else out[0]


class FakeQuantized(_t.QuantizedLinear):
    def dequantize(self):  # cheap, and a function of every stored tensor
        out_f, in_f = self.shape
        codes = self.trellis.reshape(-1).float() / 32768
        codes = codes.repeat(out_f * in_f // codes.numel() + 1)[: out_f * in_f].reshape(out_f, in_f)
        return torch.outer(self.svh.float()[:out_f], self.suh.float()[:in_f]) + 1e-3 * codes

_t.quantize = fake_quantize
'''


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    """A tiny checkpoint: a KDA layer with a dense MLP, a DSA layer with 3 routed experts (blocks of 2 and 1 over
    two ranks), and the NextN block (an uncalibrated MoE stage)."""
    from mixq.formats.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("moe3") / "bf16", n_experts=3, top_k=2, dense_layers=1,
                                 layer_types=("linear_attention", "deepseek_sparse_attention"), vision=False)


@pytest.fixture(scope="module")
def fake_site(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fake_trellis_site")
    (d / "sitecustomize.py").write_text(FAKE_TRELLIS_SITE)
    return d


def _digests(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


def test_two_cpu_ranks_write_the_one_process_bytes(moe_model, fake_site, tmp_path, monkeypatch):
    from mixq.conversion.api import convert
    from mixq.quant import trellis

    ns: dict = {}
    exec(FAKE_TRELLIS_SITE.replace("_t.quantize = fake_quantize", ""), ns)
    opts = dict(bpw=4.0, rows=3, seq_len=16, shard_size="1MiB", progress=False, batch_rows=2)
    with monkeypatch.context() as mp:
        mp.setattr(trellis, "quantize", ns["fake_quantize"])
        one = convert(moe_model, tmp_path / "one", "exl3", device="cpu", **opts)
    monkeypatch.setenv("PYTHONPATH", f"{fake_site}:{Path(__file__).resolve().parents[3]}:"
                       + ":".join(p for p in sys.path if p))
    two = convert(moe_model, tmp_path / "two", "exl3", devices="cpu,cpu", **opts)
    assert two.device == "cpu x2" and one.device == "cpu"
    assert (two.bytes, two.tensors, two.quantized, two.fallbacks) == (one.bytes, one.tensors, one.quantized,
                                                                      one.fallbacks)
    d1, d2 = _digests(tmp_path / "one"), _digests(tmp_path / "two")
    assert len(d1) > 3 and d1 == d2


def test_the_thread_count_leaves_the_bytes_alone(moe_model, tmp_path, monkeypatch):
    """One process at one torch thread and at two writes the same bytes: the ranks of a multi-device conversion
    run at their own thread count, not the one of the process they are compared with. Batches of 1024 tokens:
    enough for the CPU BLAS to split the Hessians' sums over its threads."""
    from mixq.conversion.api import convert
    from mixq.quant import trellis

    ns: dict = {}
    exec(FAKE_TRELLIS_SITE.replace("_t.quantize = fake_quantize", ""), ns)
    monkeypatch.setattr(trellis, "quantize", ns["fake_quantize"])
    opts = dict(bpw=4.0, rows=8, seq_len=128, shard_size="1MiB", progress=False, batch_rows=8, device="cpu")
    def digests_at(n: int) -> dict:
        convert(moe_model, tmp_path / f"t{n}", "exl3", **opts)
        return _digests(tmp_path / f"t{n}")

    digests = {n: at_threads(n, lambda n=n: digests_at(n)) for n in (1, 2)}
    assert len(digests[1]) > 3 and digests[1] == digests[2]
