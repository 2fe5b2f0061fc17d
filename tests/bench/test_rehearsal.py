"""bench/release/rehearsal_model.py and rehearsal.py: the rehearsal model at toy widths has every part of GLM-5.3-Flash
(read back by mixq's checkpoint reader and by transformers' glm5_next), its FP8 copy GLM's block-scaled layout; the
driver runs the plain CLI, records each step's command line and exit code, and records a step its limit cut as
incomplete."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "bench" / "release"), str(REPO / "bench")]
import rehearsal  # noqa: E402
import rehearsal_model as rm  # noqa: E402

EXPERTS = 12  # past the 8 transformers initialises: the drawn experts are in the files too


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rehearsal") / "model"
    info = rm.build(out, experts=EXPERTS, small=True, device="cpu", fp8=True)
    assert info["kinds"] == list(rm.DEFAULT_KINDS) and info["bf16_bytes"] > 0 and info["fp8_bytes"] > 0
    return out


def tensors(copy: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) of every tensor in a copy's shards, read from the files."""
    index = json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(copy / shard), "pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    assert set(out) == set(index)
    return out


def test_every_part_of_the_release(model):
    from mixq.formats.checkpoint import open_checkpoint

    cfg = json.loads((model / "bf16" / "config.json").read_text())
    t = cfg["text_config"]
    assert t["layer_types"] == ["linear_attention", "linear_attention", "deepseek_sparse_attention"]
    assert t["mlp_layer_types"] == ["dense", "sparse", "sparse"] and t["num_nextn_predict_layers"] == 1
    names = tensors(model / "bf16")
    lm = "model.language_model.layers"
    for layer in (1, 2, 3):  # two MoE decoder layers and the NextN block, every expert written
        experts = {n.split(".experts.")[1].split(".")[0] for n in names if n.startswith(f"{lm}.{layer}.mlp.experts.")}
        assert experts == {str(e) for e in range(EXPERTS)}
        assert f"{lm}.{layer}.mlp.shared_experts.down_proj.weight" in names
    assert f"{lm}.0.mlp.gate_proj.weight" in names and f"{lm}.0.self_attn.A_log" in names  # KDA + dense
    assert f"{lm}.2.self_attn.indexer.wq_b.weight" in names  # DSA with its indexer
    assert {f"{lm}.3.eh_proj.weight", f"{lm}.3.enorm.weight", f"{lm}.3.shared_head.norm.weight"} <= set(names)
    assert names["lm_head.weight"][1] == names["model.language_model.embed_tokens.weight"][1] == (t["vocab_size"],
                                                                                                  t["hidden_size"])
    assert any(n.startswith("model.visual.") for n in names)
    ck = open_checkpoint(model / "bf16")
    roles = {ck.info(n).role for n in ck.names()}
    assert {"embed", "lm_head", "attn", "routed_expert", "shared_expert", "dense_mlp", "router", "vision"} <= roles
    assert set(ck.names()) == set(names)


def test_fp8_copy_is_glm_block_scaled(model):
    from mixq.formats.checkpoint import open_checkpoint

    cfg = json.loads((model / "fp8" / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    names = tensors(model / "fp8")
    fp8 = [n for n, (dt, _) in names.items() if dt == "F8_E4M3"]
    assert fp8
    for n in fp8:
        r, c = names[n][1]
        assert names[n + "_scale_inv"] == ("F32", (math.ceil(r / 128), math.ceil(c / 128)))
    lm = "model.language_model.layers"
    assert names[f"{lm}.0.self_attn.o_proj.weight"][0] == "BF16"  # KDA o_proj stays BF16
    assert names[f"{lm}.2.self_attn.o_proj.weight"][0] == "F8_E4M3"  # MLA o_proj is FP8
    assert names[f"{lm}.3.self_attn.o_proj.weight"][0] == "F8_E4M3"  # and the NextN block's
    assert names[f"{lm}.1.mlp.experts.{EXPERTS - 1}.up_proj.weight"][0] == "F8_E4M3"
    # mixq's reader dequantizes the FP8 copy back to the BF16 weights within e4m3's precision
    name = f"{lm}.1.mlp.experts.{EXPERTS - 1}.up_proj.weight"
    a = open_checkpoint(model / "fp8").get(name, dtype=torch.float32)
    b = open_checkpoint(model / "bf16").get(name, dtype=torch.float32)
    assert a.shape == b.shape and ((a - b).norm() / b.norm()).item() < 0.08


def test_transformers_runs_the_bf16_model(model):
    import transformers

    m = transformers.Glm5NextForConditionalGeneration.from_pretrained(model / "bf16", dtype=torch.float32)
    ids = torch.tensor([[1, 5, 7, 9, 11, 200]])
    with torch.no_grad():
        logits = m(input_ids=ids).logits
    vocab = json.loads((model / "bf16" / "config.json").read_text())["text_config"]["vocab_size"]
    assert logits.shape == (1, 6, vocab) and torch.isfinite(logits).all() and logits.std() > 0


def test_steps_and_limits_parse():
    assert rehearsal.parse_steps("verify,convert-gguf") == ["verify-exl3", "convert-gguf", "verify-gguf"]
    assert rehearsal.parse_limits("convert-exl3=300,imatrix=20") == {"convert-exl3": 300.0, "imatrix": 20.0}
    with pytest.raises(SystemExit):
        rehearsal.parse_steps("convert-exl4")


def drive(work: Path, model: Path | None, *args: str, out: str = "result.json") -> dict:
    """Run the driver on WORK (a new one holding `model`, or an earlier one's) and read its result file."""
    if model is not None:
        work.mkdir()
        (work / "model").symlink_to(model)
    out = work / out
    subprocess.run([sys.executable, str(REPO / "bench" / "release" / "rehearsal.py"), "--work", str(work), "--json",
                    str(out), "--small", "--experts", str(EXPERTS), "--device", "cpu", "--no-profile", *args],
                   cwd=REPO, check=False, timeout=600)
    return json.loads(out.read_text())


def test_a_step_cut_by_its_limit_is_incomplete(model, tmp_path):
    res = drive(tmp_path / "work", model, "--steps", "build,imatrix,verify-exl3", "--limits", "imatrix=2")
    assert res["steps"]["build"]["status"] == "skipped"  # built already
    imat = res["steps"]["imatrix"]
    last = imat["attempts"][-1]
    assert imat["status"] == "incomplete" and last["cut"] == "time limit" and last["seconds"] >= 2
    assert last["command"].startswith("python -m mixq imatrix WORK/model/bf16 WORK/rehearsal.imatrix.gguf")
    assert res["cut"] == [{"step": "imatrix", "call": 1, "cut": "time limit", "seconds": last["seconds"]}]
    assert "imatrix" in res["incomplete"]
    assert res["steps"]["verify-exl3"]["attempts"][-1]["why"] == "convert-exl3 has not finished"


@pytest.mark.slow
def test_driver_converts_and_verifies_through_the_cli(model, tmp_path):
    work = tmp_path / "work"
    # an earlier call's hessian convert was cut: this one writes the fallback plan for the checks
    hessian = rehearsal.GGUF_TARGET
    cut = {"call": 1, "status": "incomplete", "cut": "time limit", "seconds": 500.0, "target": hessian}
    carried = tmp_path / "state.json"
    carried.write_text(json.dumps({"calls": [{"call": 1}], "steps": {
        "convert-gguf": {"status": "incomplete", "attempts": [cut]}}}))
    res = drive(work, model, "--steps", "convert-gguf,verify,load-gguf", "--state-from", str(carried),
                "--gguf-fallback", "--type Q8_0")
    attempts = res["steps"]["convert-gguf"]["attempts"]
    conv, ver = attempts[-1], res["steps"]["verify-gguf"]["attempts"][-1]
    assert attempts[0] == cut and conv["fallback"] == f"the convert with {hessian!r} was cut in call 1"
    assert conv["command"] == ("python -m mixq convert WORK/model/bf16 WORK/rehearsal.gguf --type Q8_0 --overwrite "
                               "--device cpu")
    assert conv["rc"] == 0 and conv["status"] == "done" and (work / "rehearsal.gguf").is_file()
    assert ver["command"] == "python -m mixq verify WORK/rehearsal.gguf --json" and ver["rc"] == 0
    assert '"ok": true' in ver["output_tail"]
    assert res["steps"]["verify-exl3"]["status"] == "skipped"
    if rehearsal.has_module("llama_cpp"):
        gen = res["steps"]["load-gguf"]["attempts"][-1]
        assert gen["rc"] == 0 and len(gen["generated"]["tokens"]) == 8
    # a second call on the same WORK keeps the finished steps and adds its own
    again = drive(work, None, "--steps", "convert-gguf", out="result2.json")
    assert again["steps"]["convert-gguf"]["attempts"] == res["steps"]["convert-gguf"]["attempts"]
    assert len(again["calls"]) == 3



@pytest.mark.slow
def test_the_measure_steps_run_the_streamed_measurement_through_the_cli(model, tmp_path):
    work = tmp_path / "work"
    res = drive(work, model, "--steps", "measure")
    for fmt in ("exl3", "gguf"):
        last = res["steps"][f"measure-{fmt}"]["attempts"][-1]
        assert last["rc"] == 0 and last["status"] == "done", last.get("output_tail")
        assert last["command"].startswith(f"python -m mixq plan WORK/model/bf16 --format {fmt} ")
        assert "--measure stream --measure-out" in last["command"]
        curves = json.loads((work / f"curves-{fmt}.json").read_text())
        assert curves["_meta"]["method"] == "stream" and len(curves) > 2


def test_a_fresh_machine_continues_from_a_carried_state(model, tmp_path):
    state = {"calls": [{"call": 1, "steps": "all"}], "steps": {
        "convert-exl3": {"status": "done", "attempts": [{"call": 1, "status": "done", "seconds": 900.0}]},
        "free-exl3": {"status": "done", "attempts": [{"call": 1, "status": "done", "seconds": 0.0}]}}}
    carried = tmp_path / "state.json"
    carried.write_text(json.dumps(state))
    res = drive(tmp_path / "work", model, "--steps", "convert-exl3,verify-exl3", "--state-from", str(carried))
    assert [c["call"] for c in res["calls"]] == [1, 2]
    assert res["steps"]["convert-exl3"]["attempts"] == [{"call": 1, "status": "done", "seconds": 900.0}]
    assert res["steps"]["verify-exl3"]["attempts"][-1]["why"].endswith("(free-exl3 removed it)")


@pytest.mark.slow
def test_release_pins_reach_every_tensor_they_name(model):
    """The overrides the driver converts with, planned by mixq's planner on the small model: the NextN block at the
    default --mtp-bits (EXL3) and at the release's NextN type (GGUF), the trunk at the release's rates and types."""
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.planning.planner import plan_model

    ck = open_checkpoint(model / "bf16")
    exl3 = {t.name: t.bits for t in plan_model(ck, "exl3", bpw=8, overrides=rm.release_exl3_overrides(3.05, 3)).tensors}
    rates = rm.release_exl3_rates(3.05)
    lm = "model.language_model.layers"
    assert exl3[f"{lm}.1.mlp.experts.0.up_proj.weight"] == rates["routed_expert"]
    assert exl3[f"{lm}.2.self_attn.q_a_proj.weight"] == rates["attn"]
    assert exl3[f"{lm}.3.mlp.experts.0.up_proj.weight"] == exl3[f"{lm}.3.self_attn.q_a_proj.weight"] == 4
    cfg = json.loads((model / "bf16" / "config.json").read_text())
    pins = dict(o.rsplit("=", 1) for o in rm.release_gguf_overrides(cfg))
    gguf = {t.name: t.type for t in plan_model(ck, "gguf", bpw=8, gguf_ladder="iq", overrides=list(pins.items())
                                               ).tensors}
    for pattern, qtype in pins.items():
        name = pattern.strip("^$").replace("\\", "")
        assert gguf[name] == qtype


def test_the_profiles_of_each_run(tmp_path):
    """What the project step hands release_hours: the EXL3 calls since its last fresh start (one run continued with
    --resume, cut calls included), the last timed GGUF convert even if cut, the fallback and the finished verbs."""
    def att(call, status, profile, **kw):
        return {"call": call, "status": status, "profile": {"call": call} if profile else profile, **kw}

    target = rehearsal.GGUF_TARGET
    steps = {
        "convert-exl3": [att(1, "incomplete", True, resumed=False), att(2, "incomplete", True, resumed=False),
                         att(3, "incomplete", True, resumed=True), att(4, "done", True, resumed=True)],
        "convert-gguf": [att(5, "incomplete", True, target=target), att(6, "done", True, target="--bpw 8",
                                                                        fallback="cut")],
        "imatrix": [att(5, "done", True), att(6, "incomplete", True)],
        "eval-exl3": [att(4, "failed", True)],
    }
    state = {"calls": [], "steps": {k: {"status": v[-1]["status"], "attempts": v} for k, v in steps.items()}}
    (tmp_path / "rehearsal_state.json").write_text(json.dumps(state))
    reh = rehearsal.Rehearsal(rehearsal.parser().parse_args(["--work", str(tmp_path), "--json", "x.json"]))
    calls = {label: [p["call"] for p in profiles] for label, profiles in reh.profile_runs().items()}
    assert calls == {"exl3": [2, 3, 4], "gguf": [5], "gguf-fallback": [6], "imatrix": [5]}
    # a call of the resumed conversion that wrote no profile: that run is not priced, and says why
    steps["convert-exl3"][2]["profile"] = None
    state["steps"]["convert-exl3"]["attempts"] = steps["convert-exl3"]
    (tmp_path / "rehearsal_state.json").write_text(json.dumps(state))
    reh = rehearsal.Rehearsal(rehearsal.parser().parse_args(["--work", str(tmp_path), "--json", "x.json"]))
    assert reh.profile_runs()["exl3"] == {"calls without a profile": [3]}
