"""`evaluate` on the trained glm5next-mini fixture with heldout.txt (2 windows of 128 tokens)."""
from __future__ import annotations

import json

import pytest

from mixq.errors import FormatError, InputError, MixqError
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
    with pytest.raises(InputError, match=f"{short}: .* tokens, fewer than one window"):
        evaluate(mini_model, [mini_model], short, ctx=CTX)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    with pytest.raises(InputError, match=f"{empty}: the text file is empty"):
        evaluate(mini_model, [mini_model], empty, ctx=CTX)
    for bad in (0, 3):
        with pytest.raises(InputError, match=f"--ctx {bad} is too small"):
            evaluate(mini_model, [mini_model], heldout_text, ctx=bad)
    for opt, val in (("ref_dtype", "int8"), ("state_dtype", "float8")):
        with pytest.raises(InputError, match=val):
            evaluate(mini_model, [mini_model], heldout_text, ctx=CTX, **{opt: val})


def test_problems_are_named_where_they_are(mini_model, noisy_candidates, heldout_text, tmp_path):
    """A broken reference is reported under the reference's name, a broken candidate under its own; both
    before any forward."""
    import json as _json
    import shutil

    ref = tmp_path / "ref"
    shutil.copytree(mini_model, ref)
    cfg = _json.loads((ref / "config.json").read_text())
    cfg["text_config"]["num_hidden_layers"] += 1  # the config disagrees with the weights
    (ref / "config.json").chmod(0o644)
    (ref / "config.json").write_text(_json.dumps(cfg))
    with pytest.raises(MixqError) as e:
        evaluate(ref, [noisy_candidates[0]], heldout_text, ctx=CTX, windows=1, progress=False)
    assert str(ref) in str(e.value) and str(noisy_candidates[0]) not in str(e.value)
    from mixq.formats.tiny import write_tiny_checkpoint

    other = write_tiny_checkpoint(tmp_path / "other", vision=False)  # another architecture's shapes
    with pytest.raises(FormatError, match=f"{other}: "):
        evaluate(mini_model, [other], heldout_text, ctx=CTX, windows=1, progress=False)


def test_json_dash_prints_the_report(mini_model, heldout_text, noisy_candidates, first_run, capsys):
    _, ref_file, _ = first_run
    rep = evaluate(mini_model, [noisy_candidates[0]], ref_logits=ref_file, windows=1, json_out="-", progress=False)
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(rep))
    assert rep["peak_rss_mib"] > 0 and rep["peak_gpu_mib"] is None and rep["state_dtype"] == "float32"


def test_uint16_reference_and_bfloat16_states(mini_model, noisy_candidates, heldout_text, first_run, tmp_path):
    """--ref-dtype uint16: a later --ref-logits run reproduces the saving run exactly and both stay within 1e-6 of
    the float32 numbers; bfloat16 hidden states move the KLD only a little."""
    report, _, _ = first_run
    exact = report["candidates"][1]
    f = tmp_path / "ref-u16.safetensors"
    saved = evaluate(mini_model, [noisy_candidates[0]], heldout_text, ctx=CTX, windows=WINDOWS, save_ref=f,
                     ref_dtype="uint16", progress=False)["candidates"][0]
    again = evaluate(mini_model, [noisy_candidates[0]], ref_logits=f, progress=False)["candidates"][0]
    assert all(saved[k] == again[k] for k in KEYS if k != "path")
    assert abs(saved["kld_mean"] - exact["kld_mean"]) < 1e-6 and saved["top1"] == exact["top1"]
    assert saved["ppl_ref"] == pytest.approx(exact["ppl_ref"], rel=1e-12)  # true tokens stored exactly
    assert f.stat().st_size < 0.55 * WINDOWS * (CTX - 1 - CTX // 2) * 8192 * 4
    bf = evaluate(mini_model, [noisy_candidates[0]], heldout_text, ctx=CTX, windows=WINDOWS, state_dtype="bfloat16",
                  progress=False)
    c = bf["candidates"][0]
    assert bf["state_dtype"] == "bfloat16" and c["kld_mean"] != exact["kld_mean"]
    assert c["kld_mean"] == pytest.approx(exact["kld_mean"], rel=0.2) and c["top1"] > 0.9
