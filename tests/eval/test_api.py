"""`evaluate` on the trained glm5next-mini fixture with heldout.txt (2 windows of 128 tokens)."""
from __future__ import annotations

import json

import pytest

from mixq.errors import InputError
from mixq.eval import evaluate

from .conftest import CTX, WINDOWS

KEYS = ["path", "format", "bytes", "bpw", "kld_mean", "kld_mean_err", "kld_median", "kld_p90", "kld_p99",
        "kld_p999", "kld_max", "top1", "ppl_ref", "ppl", "dppl", "rms_dp", "positions"]


def test_reference_against_itself(first_run):
    report, _, _ = first_run
    me = report["candidates"][0]
    assert me["kld_mean"] < 1e-9 and me["kld_max"] < 1e-9
    assert me["top1"] == 1.0 and me["dppl"] == 0.0 and me["rms_dp"] == 0.0
    assert me["positions"] == WINDOWS * (CTX - 1 - CTX // 2)
    # the trained model predicts held-out text far better than uniform over 8192 tokens
    assert 5.0 < me["ppl_ref"] < 200.0


def test_noise_raises_kld(first_run):
    report, _, _ = first_run
    _, small, large = report["candidates"]
    assert 0 < small["kld_mean"] < large["kld_mean"]
    assert small["top1"] >= large["top1"] and large["top1"] < 1.0
    assert small["kld_median"] <= small["kld_p90"] <= small["kld_p99"] <= small["kld_p999"] <= small["kld_max"]
    assert large["rms_dp"] > small["rms_dp"] > 0


def test_report_shape(first_run, mini_model):
    report, _, out = first_run
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk == json.loads(json.dumps(report))
    assert on_disk["reference"] == str(mini_model) and on_disk["ctx"] == CTX and "text" in on_disk
    for c in on_disk["candidates"]:
        assert all(k in c for k in KEYS)
        assert c["bpw"] == pytest.approx(c["bytes"] * 8 / on_disk["ref_params"])
    assert "| noise-large | hf |" in (out / "report.md").read_text()


def test_ref_logits_reuse_is_identical(first_run, mini_model, noisy_candidates):
    """Same numbers from the saved reference file: also shows the run is deterministic."""
    report, ref_file, _ = first_run
    again = evaluate(mini_model, list(noisy_candidates), ref_logits=ref_file, progress=False)
    assert again["ctx"] == CTX and again["windows"] == WINDOWS
    for a, b in zip(report["candidates"][1:], again["candidates"]):
        for k in KEYS:
            assert a[k] == b[k], k
    # stored float32: windows · scored · vocab · 4 bytes plus the tokens
    assert ref_file.stat().st_size >= WINDOWS * (CTX - 1 - CTX // 2) * 8192 * 4


def test_bad_arguments(mini_model, heldout_text, tmp_path):
    with pytest.raises(InputError, match="at least one CANDIDATE"):
        evaluate(mini_model, [], heldout_text)
    with pytest.raises(InputError, match="--text is required"):
        evaluate(mini_model, [mini_model])
    with pytest.raises(InputError, match="HF checkpoint directory"):
        evaluate(tmp_path / "none", [mini_model], heldout_text)
    with pytest.raises(InputError, match="--engine"):
        evaluate(mini_model, [mini_model], heldout_text, engine="vllm")
    short = tmp_path / "short.txt"
    short.write_text("just a few words\n")
    with pytest.raises(InputError, match="fewer than one window"):
        evaluate(mini_model, [mini_model], short, ctx=CTX)
