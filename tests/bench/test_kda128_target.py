"""bench/engines/kda128_target.py on the CPU: a 2-step build at a tiny sequence length (the config, the losses, the files,
transformers' reload), and bench/engines/drafter_check.py against the built target with the fake exllamav3 of
tests/conversion/test_drafter_check.py (the Generator path is taken, and its failure is an error for such a target)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from module_loader import load_module

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


@pytest.fixture(scope="module")
def kda():
    return load_module("kda128_target", BENCH / "engines" / "kda128_target.py")


@pytest.fixture(scope="module")
def texts(tmp_path_factory, calibration_text, heldout_text) -> tuple[Path, Path]:
    """The first lines of the fixture texts: enough for 16-token windows, quick to tokenize."""
    d = tmp_path_factory.mktemp("texts")
    out = []
    for src in (calibration_text, heldout_text):
        p = d / src.name
        p.write_text(src.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
        out.append(p)
    return out[0], out[1]


@pytest.fixture(scope="module")
def built(kda, k256_model, texts, tmp_path_factory):
    out = tmp_path_factory.mktemp("kda128") / "target"
    summary, model = kda.build(out, source=k256_model, calibration=texts[0], heldout=texts[1], train_seconds=math.inf,
                               steps=2, seq_len=16, batch=2, eval_windows=2, device="cpu", seed=0,
                               log=lambda s: None)
    return out, summary, model


def test_config_has_128_wide_kda_heads_and_keeps_the_rest(built, k256_model):
    out, summary, _ = built
    cfg, src = json.loads((out / "config.json").read_text()), json.loads((k256_model / "config.json").read_text())
    t, s = cfg["text_config"], src["text_config"]
    assert t["linear_head_dim"] == 128 and t["linear_attn_config"]["head_dim"] == 128
    assert t["linear_num_heads"] == t["linear_attn_config"]["num_heads"] == 2  # KDA width 2 x 128 = k256's 4 x 64
    changed = {"linear_head_dim", "linear_num_heads", "linear_attn_config"}
    assert {k: v for k, v in t.items() if k not in changed} == {k: v for k, v in s.items() if k not in changed}
    assert {k: v for k, v in cfg.items() if k != "text_config"} == {k: v for k, v in src.items() if k != "text_config"}
    assert t["layer_types"][-1] == "deepseek_sparse_attention"  # the spelling exllamav3 accepts
    assert summary["kda_heads"] == [2, 128] and set(summary["changed"]) == {
        "text_config.linear_head_dim", "text_config.linear_num_heads", "text_config.linear_attn_config.head_dim",
        "text_config.linear_attn_config.num_heads"}


def test_training_losses_are_finite(built):
    _, s, _ = built
    assert s["steps"] == 2 and s["seq"] == 16 and s["tokens_seen"] == 2 * 2 * 16
    for k in ("train_loss_first", "train_loss_last", "heldout_loss", "heldout_loss_init"):
        assert math.isfinite(s[k]) and 0 < s[k] < 2 * s["uniform_loss"], (k, s[k])
    assert s["uniform_loss"] == pytest.approx(math.log(8192))
    assert json.loads((built[0] / "training_run.json").read_text()) == s


def test_files_are_safetensors_only_with_k256_names(built, k256_model):
    from safetensors import safe_open

    out = built[0]
    names = {p.name for p in out.iterdir()}
    assert not {n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"))}
    assert {"config.json", "model.safetensors", "tokenizer.json", "processor_config.json"} <= names
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(n).get_dtype() for n in f.keys()}
        ours = set(f.keys())
    assert dtypes == {"BF16"}
    k256 = set(json.loads((k256_model / "model.safetensors.index.json").read_text())["weight_map"])
    assert ours == k256  # NextN block and vision tower included, nothing renamed


def test_transformers_loads_it_back_with_the_same_logits(built):
    import transformers

    out, summary, model = built
    assert summary["reload_max_abs_diff"] == 0.0  # the builder's own check (experts loop on both sides)
    loaded = transformers.Glm5NextForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, 8192, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = loaded(input_ids=ids).logits, model(input_ids=ids).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------ drafter_check

@pytest.fixture
def fake_check(monkeypatch, tmp_path, texts):
    """Run drafter_check.main against a target with the fake exllamav3 and a stand-in 6 bpw encoder."""
    tests = REPO / "tests" / "conversion"
    fakes = load_module("drafter_check_fakes", tests / "test_drafter_check.py")
    convert = fakes.stand_in_convert(monkeypatch)

    def run(target_args: list[str], generator_error: bool = False) -> tuple[int, dict, Path]:
        distill = load_module("drafter_distill", BENCH / "engines" / "drafter_distill.py")
        check = load_module("drafter_check", BENCH / "engines" / "drafter_check.py")
        fake = fakes.FakeEngine(distill, generator_error=generator_error).module()
        monkeypatch.setitem(sys.modules, "exllamav3", fake)
        monkeypatch.setitem(sys.modules, "exllamav3.constants", fake.constants)
        monkeypatch.setattr(check, "convert_drafter_cli", convert)
        out = tmp_path / ("fail" if generator_error else "ok")
        rc = check.main(["--out", str(out), *target_args, "--calibration", str(texts[0]), "--heldout",
                         str(texts[1]), *fakes.ARGS, "--train-steps", "5"])
        return rc, json.loads((out / "drafter_check.json").read_text()), out
    return run


def test_drafter_check_takes_the_generator_path_for_the_built_target(built, fake_check):
    out, summary, _ = built
    rc, rep, res = fake_check(["--target-build", str(out)])  # already built: reused, not trained again
    assert rep["errors"] == {}, rep["errors"]
    assert rep["target"] == {"kda_heads": 2, "kda_head_dim": 128, "generator_expected": True}
    assert rep["target_build"] == summary and rep["target_label"] == out.name
    assert rep["acceptance_method"] == "exllamav3 Generator, speculative greedy decoding"
    assert rep["training_generation"].startswith("engine generator")
    assert rep["generation"]["bf16"]["drafted"] > 0 and rep["generation"]["bf16"]["same_text_as_plain"] == 1.0
    md = (res / "results.md").read_text()
    assert md.startswith(f"- target: {out.name}, KDA 2 x 128 heads") and "trained 2 steps" in md


def test_a_generator_failure_on_the_built_target_is_an_error(built, fake_check):
    rc, rep, _ = fake_check(["--target", str(built[0])], generator_error=True)
    assert rc == 1 and "generate_plain" in rep["errors"] and "generate_plain failed" in rep["why_not"]
    assert rep["acceptance_method"].startswith("drafting rounds")  # still measured, for the record
    assert rep["acceptance"]["bf16"] is not None
