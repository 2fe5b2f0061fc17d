"""eval/window_split.py: `mixq eval` with its windows dealt over two CPU ranks gives the one-process report."""
from __future__ import annotations

import pytest

from mixq.runtime.distributed import RankContext
from mixq.eval import evaluate
from mixq.eval.window_split import gather_in_order, rank_window_ids

from .conftest import write_noisy_copy

TIMING_KEYS = {"tokens_per_s", "ref_tokens_per_s", "peak_rss_mib", "peak_gpu_mib"}


def test_rank_window_ids_deal_whole_batches():
    assert rank_window_ids(5, 1, RankContext()) == [0, 1, 2, 3, 4]
    two = [rank_window_ids(5, 2, RankContext(r, 2)) for r in range(2)]
    assert two == [[0, 1, 2, 3], [4]]  # batches {0,1} {2,3} {4}: never split
    three = [rank_window_ids(7, 1, RankContext(r, 3)) for r in range(3)]
    assert sorted(sum(three, [])) == list(range(7)) and all(three)


def test_gather_in_order_one_rank():
    q = [{"kld": 1}, {"kld": 2}]
    assert gather_in_order(RankContext(), [0, 1], q, 2.5) == (q, 2.5)


def _plain(report: dict) -> dict:
    out = {k: v for k, v in report.items() if k not in TIMING_KEYS}
    out["candidates"] = [{k: v for k, v in c.items() if k not in TIMING_KEYS} for c in report["candidates"]]
    return out


@pytest.mark.slow  # ~40 s on 2 shared cores, most of it two worker processes starting
def test_two_cpu_ranks_give_the_one_process_numbers(mini_model, heldout_text, tmp_path, monkeypatch):
    noisy = write_noisy_copy(mini_model, tmp_path / "noisy", 0.05)
    kw = dict(ctx=96, windows=3, progress=False, device="cpu")
    one = evaluate(mini_model, [noisy, mini_model], heldout_text, **kw)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the workers' thread count = this process's (the fixture's)
    kw.pop("device")
    two = evaluate(mini_model, [noisy, mini_model], heldout_text, devices="cpu,cpu", **kw)
    assert two["windows"] == 3 and two["candidates"][0]["positions"] == one["candidates"][0]["positions"] > 0
    assert two["device"] == "cpu" and one["candidates"][0]["kld_mean"] > 0
    assert _plain(two) == _plain(one)


def test_save_ref_needs_one_device(mini_model, heldout_text, tmp_path):
    from mixq.errors import InputError

    with pytest.raises(InputError, match="--save-ref .* one device"):
        evaluate(mini_model, [], heldout_text, ctx=96, windows=2, save_ref=tmp_path / "r.bin", devices="cpu,cpu",
                 progress=False)
