"""bench/quality/train_nextn.py on mini (a short run), and `eval --mtp` on the model it writes."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "bench" / "quality"), str(REPO / "bench")]

import train_nextn  # noqa: E402
from thread_helpers import at_threads  # noqa: E402


@pytest.fixture(scope="module")
def trained_mini(mini_model, tmp_path_factory):
    # the training's own figures are deterministic at one thread; the rest of the session keeps its count
    res = at_threads(1, lambda: train_nextn.train(mini_model, steps=24, rows=8, seq_len=64, batch=4, lr=3e-3,
                                                  seed=0, eval_rows=4))
    out = tmp_path_factory.mktemp("nextn") / "mini-nextn"
    names = train_nextn.write_model(res, mini_model, out)
    return res, out, names


def test_training_raises_the_heads_agreement(trained_mini, mini_model):
    res, out, names = trained_mini
    assert res["losses"][-1][1] < res["losses"][0][1]
    assert res["after"] > res["before"] + 0.05, (res["before"], res["after"])
    from mixq.formats.checkpoint import open_checkpoint
    src, got = open_checkpoint(mini_model), open_checkpoint(out)
    assert set(names) == {n for n in src.names() if src.info(n).mtp}
    assert torch.equal(got.get("model.language_model.layers.0.mlp.down_proj.weight"),
                       src.get("model.language_model.layers.0.mlp.down_proj.weight"))  # the trunk as it was
    assert not torch.equal(got.get("model.language_model.layers.4.eh_proj.weight"),
                           src.get("model.language_model.layers.4.eh_proj.weight"))


@pytest.mark.slow
def test_eval_mtp_bf16_equals_reference_and_fewer_bits_fall(trained_mini, heldout_text, tmp_path):
    """A BF16 candidate against itself agrees exactly as the reference (relative 1.0); its NextN block at
    Q4_0 (the trunk at Q8_0) agrees less; a file without the NextN block says so in its row."""
    from mixq.api import convert, evaluate

    _, ref, _ = trained_mini
    low = tmp_path / "nextn-q4_0.gguf"
    convert(ref, low, qtype="Q8_0", tensor_type=[r"blk\.4\.(attn_.*|ffn_.*|indexer\..*|nextn\.eh_proj)\.weight=Q4_0"],
            progress=False)
    none = tmp_path / "no-mtp.gguf"
    convert(ref, none, qtype="Q8_0", include_mtp=False, progress=False)
    rep = evaluate(ref, [ref, low, none], heldout_text, ctx=64, windows=4, mtp=True, device="cpu", progress=False)
    by = {Path(c["path"]).name: c for c in rep["candidates"]}
    assert rep["mtp"]["agreement"] > 0.05 and rep["mtp"]["positions"] == 4 * (64 - 1 - 32)
    assert by[ref.name]["mtp_agreement"] == rep["mtp"]["agreement"] and by[ref.name]["mtp_relative"] == 1.0
    assert by[low.name]["mtp_agreement"] < rep["mtp"]["agreement"]
    assert by[ref.name]["mtp_gained"] == by[ref.name]["mtp_lost"] == 0 and by[ref.name]["mtp_delta_se"] == 0
    n = rep["mtp"]["positions"]  # the paired counts account for the two rates' difference exactly
    assert by[low.name]["mtp_gained"] - by[low.name]["mtp_lost"] == round(n * by[low.name]["mtp_agreement"]) - round(
        n * rep["mtp"]["agreement"])
    assert 0 < by[low.name]["mtp_delta_se"] < 0.5
    assert "no NextN block" in by[none.name]["mtp_note"]
