"""runtime/overlap.py and what the EXL3 conversion does with it: the dequantized weights that come back for the next
layer's calibration (conversion/exl3/output.quantize_batch, to_host), and the stage written while the next one runs
(WriteBehind)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from mixq.conversion.exl3.output import quantize_batch
from mixq.formats.exl3_names import Exl3Unit
from mixq.quant import trellis
from mixq.runtime.overlap import WriteBehind, to_host


def _units(n: int) -> list[Exl3Unit]:
    return [Exl3Unit(key=f"model.layers.1.mlp.experts.{i}.down_proj", kind="trellis",
                     hf_names=[f"e{i}"], shape=(128, 256), role="routed_expert", stage="layer.1", bits_key="bits",
                     src_shapes=[(128, 256)]) for i in range(n)]


@pytest.mark.slow  # one of the longest of the default run: bench/results/ci_fresh_clone_283e8d1_durations.tsv
def test_batch_without_dequantized_weights_stores_the_same_tensors():
    """Stages whose weights nobody reads again (head, NextN, vision, the drafter) skip the dequantization and
    store the very same tensors; the dequantized weight that does come back is the stored tensors' decode."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(128, 256, generator=g) for _ in range(2)]
    hs = [None, None]
    kw = dict(seed=3, codebook="mul1", device=torch.device("cpu"))
    units = _units(2)
    with_deq = quantize_batch(units, ws, 2.0, hs, **kw)
    without = quantize_batch(units, ws, 2.0, hs, dequantized=False, **kw)
    for u, (s1, d1), (s2, d2) in zip(units, with_deq, without):
        assert d2 is None and d1.dtype == torch.float32 and d1.device.type == "cpu"
        assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
        parts = {k[len(u.key) + 1:]: v for k, v in s1.items()}
        assert torch.equal(d1, trellis.from_tensors(parts, u.shape).dequantize())


def test_to_host_keeps_a_host_tensor():
    t = torch.arange(6.0)
    assert to_host(t) is t


@pytest.mark.gpu
def test_to_host_copies_into_pinned_memory():
    t = torch.randn(2048, 4096, device="cuda")
    h = to_host(t * 2)
    assert h.device.type == "cpu" and h.is_pinned() and torch.equal(h, (t * 2).cpu())


def test_write_behind_runs_in_order_one_at_a_time():
    done, live = [], []

    def task(i):
        live.append(i)
        assert len(live) == 1  # never two in flight
        time.sleep(0.02)
        done.append((i, threading.current_thread().name))
        live.remove(i)
    with WriteBehind() as wb:
        for i in range(4):
            wb.submit(lambda i=i: task(i))
    assert [i for i, _ in done] == [0, 1, 2, 3]
    assert all(name.startswith("mixq-write") for _, name in done)


def test_write_behind_raises_a_failed_task_at_the_next_submit_and_at_the_end():
    def fail():
        raise OSError(28, "No space left on device")
    ran = []
    with pytest.raises(OSError, match="No space left"):
        with WriteBehind() as wb:
            wb.submit(fail)
            wb.submit(lambda: ran.append(1))  # raises the first task's error before submitting
    assert ran == []
    with pytest.raises(OSError, match="No space left"):
        with WriteBehind() as wb:
            wb.submit(fail)


def test_write_behind_lets_the_task_in_flight_finish_when_the_caller_fails():
    """A job record in flight is finished (whole), and the caller's own error is the one raised."""
    finished = []

    def slow():
        time.sleep(0.2)
        finished.append(1)
    with pytest.raises(KeyError):
        with WriteBehind() as wb:
            wb.submit(slow)
            raise KeyError("the next stage failed")
    assert finished == [1]


def test_exl3_layers_are_recorded_behind_the_next_stage(tiny_model, tmp_path, monkeypatch):
    """The calibrated stages' parts and job records are written on the worker thread, and the conversion's
    output is complete and verifies."""
    from conftest import cheap_trellis
    from mixq.conversion.api import convert, verify
    from mixq.conversion.job import Job

    monkeypatch.setattr(trellis, "quantize", cheap_trellis)
    real, threads = Job.record, {}

    def record(self, stage, *a, **k):
        threads[stage] = threading.current_thread().name
        return real(self, stage, *a, **k)
    monkeypatch.setattr(Job, "record", record)
    out = tmp_path / "e"
    convert(tiny_model, out, "exl3", bpw=4.0, rows=2, seq_len=16, device="cpu", progress=False)
    assert verify(out)["ok"]
    layers = [s for s in threads if s.startswith("layer.") or s == "head"]
    assert layers and all(threads[s].startswith("mixq-write") for s in layers), threads
    assert threads["embed"] == threading.main_thread().name
