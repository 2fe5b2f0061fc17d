"""bench/release/glm53_slice.py: the progress-log summaries (a cut EXL3 layer completed at its own per-unit rate; a cut
GGUF file's per-type figures) and the script end to end on a toy slice on the CPU, with a deadline that cuts the
EXL3 stage and skips the next one."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "release" / "glm53_slice.py"


def _module():
    spec = importlib.util.spec_from_file_location("glm53_slice_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _events() -> list[dict]:
    """A child that calibrated layer.1 (forward 10 s, 4 s of it Hessian accumulation), then encoded 4 of its 10
    routed-expert units in 2 calls of 2 s and was killed 0.5 s into a third call of 2 units."""
    return [
        {"k": "child", "t0": 0.0},
        {"k": "forward/layer.1", "t0": 5.0, "begin": 1},
        {"k": "hessian_add", "t0": 6.0, "t1": 8.0},
        {"k": "hessian_add", "t0": 9.0, "t1": 11.0},
        {"k": "forward/layer.1", "t0": 5.0, "t1": 15.0, "peak_gpu_mib": 900.0},
        {"k": "stage/layer.1", "t0": 15.0, "begin": 1, "units": {"routed_expert": [10, 1000], "attn": [2, 400]}},
        {"k": "encode/layer.1/routed_expert", "t0": 16.0, "begin": 1, "n": 2, "w": 200},
        {"k": "encode/layer.1/routed_expert", "t0": 16.0, "t1": 18.0, "n": 2, "w": 200,
         "by_role": {"routed_expert": [2, 200]}, "peak_gpu_mib": 1200.0},
        {"k": "encode/layer.1/routed_expert", "t0": 18.0, "begin": 1, "n": 2, "w": 200},
        {"k": "encode/layer.1/routed_expert", "t0": 18.0, "t1": 20.0, "n": 2, "w": 200},
        {"k": "encode/layer.1/routed_expert", "t0": 20.0, "begin": 1, "n": 2, "w": 200},
        '{"k": "encode/layer.1/routed_exp',  # the line a kill cut short
    ]


def test_summarise_exl3_completes_a_cut_layer_at_its_measured_rate(tmp_path):
    g = _module()
    log = tmp_path / "exl3.jsonl"
    log.write_text("\n".join(e if isinstance(e, str) else json.dumps(e) for e in _events()) + "\n")
    s = g.summarise_exl3(g.read_log(log), t_end=20.5)
    d = s["stages"]["layer.1"]
    assert d["state"] == "cut"
    assert d["calibration_forward_s"] == 10.0 and d["hessian_accumulate_s"] == 4.0
    r = d["encode"]["routed_expert"]
    assert (r["units_done"], r["units_total"], r["seconds"], r["s_per_unit"]) == (4, 10, 4.0, 1.0)
    x = d["extrapolated_within_layer"]
    # 6 routed units left at 1 s (0.5 s of the call in flight already spent) + 2 attention units of 400 weights
    # at the layer's rate per weight (4 s / 400 weights => 2 s each)
    assert x["per_role"]["routed_expert"] == {"units_left": 6, "s_per_unit": 1.0, "from": "measured in this layer"}
    assert x["per_role"]["attn"]["s_per_unit"] == 2.0
    assert x["encode_left_s"] == 6 * 1.0 + 2 * 2.0 - 0.5
    assert x["stage_seconds"] == d["seconds"] + x["encode_left_s"] and d["seconds"] == 5.5
    assert set(x["not_reached"]) == {"write", "record", "advance_forward"}
    assert d["in_flight"] == [{"role": "routed_expert", "units": 2, "elapsed_s": 0.5}]
    assert s["peak_gpu_mib"] == 1200.0 and s["before_first_stage_s"] == 5.0


def test_a_record_written_behind_the_next_stage_is_listed_not_added(tmp_path):
    """A finished layer whose part and job record were written on the worker thread (while the next stage ran):
    its seconds leave them out, its parts name them."""
    g = _module()
    events = [
        {"k": "child", "t0": 0.0},
        {"k": "forward/layer.0", "t0": 1.0, "t1": 4.0},
        {"k": "stage/layer.0", "t0": 4.0, "t1": 10.0, "units": {"attn": [2, 400]}},
        {"k": "encode/layer.0/attn", "t0": 4.0, "t1": 9.0, "n": 2, "w": 400},
        {"k": "advance/layer.0", "t0": 10.0, "t1": 12.0},
        {"k": "write/layer.0", "t0": 12.0, "t1": 15.0, "thread": "behind"},
        {"k": "record/layer.0", "t0": 15.0, "t1": 18.0, "thread": "behind"},
    ]
    d = g.summarise_exl3(events, t_end=18.0)["stages"]["layer.0"]
    assert d["write_behind"] and d["record_behind"] and d["fetch_other_s"] == 1.0
    c = g._layer_from_phases(d, 1.0, 0.0, False, None)
    assert c["seconds"] == 3.0 + 5.0 + 1.0 + 2.0  # forward, encode, the rest of the stage, advance
    assert c["parts"]["record (behind the next stage: not added)"] == 3.0
    assert c["parts"]["write (behind the next stage: not added)"] == 3.0
    inline = g.summarise_exl3([dict(e, thread=None) if "thread" in e else e for e in events], t_end=18.0)
    assert g._layer_from_phases(inline["stages"]["layer.0"], 1.0, 0.0, False, None)["seconds"] == 14.0


def test_summarise_trellis_profile():
    g = _module()
    ev = [{"k": "trellis_phases", "t0": 0.0, "t1": 2.0, "w": 4_000_000, "bits": 3.0, "stack": 16,
           "phases": {"viterbi": 1.5, "ldl": 0.2}},
          {"k": "trellis_phases", "t0": 3.0, "t1": 5.0, "w": 4_000_000, "bits": 3.0, "stack": 16,
           "phases": {"viterbi": 1.7, "refit": 0.1}},
          {"k": "trellis_phases", "t0": 6.0, "t1": 7.0, "w": 1_000_000, "bits": 6.0, "stack": 1, "phases": {}},
          {"k": "dequantize", "t0": 2.0, "t1": 2.25}, {"k": "dequantize", "t0": 5.0, "begin": 1}]
    s = g.summarise_trellis(ev)
    c = s["calls"]["stack 16 K=3.0"]
    assert c["calls"] == 2 and c["weights"] == 8_000_000 and c["seconds"] == 4.0 and c["mweights_per_s"] == 2.0
    assert c["phases"] == {"viterbi": 3.2, "ldl": 0.2, "refit": 0.1}
    assert s["calls"]["stack 1 K=6.0"]["calls"] == 1
    assert s["dequantize"] == {"calls": 1, "seconds": 0.25}
    assert "trellis_profile" not in g.summarise_exl3([{"k": "child", "t0": 0.0}], t_end=1.0)
    rates = {"k": "exl3_rates", "t0": 0.5, "t1": 0.5, "release_bpw": 3.05, "rates": {"routed_expert": 3.0}}
    x = g.summarise_exl3([{"k": "child", "t0": 0.0}, rates] + ev, t_end=8.0)
    assert x["role_rates"] == {"release_bpw": 3.05, "routed_expert": 3.0}
    assert x["trellis_profile"]["calls"]["stack 16 K=3.0"]["calls"] == 2


def test_release_rates_pin_every_role_of_the_slice(flash_config):
    """The slice is converted at the release plan's rate per role (3 bits for the routed experts at 3.05 bpw)."""
    g = _module()
    rates = g.release_exl3_rates(3.05)
    assert rates["routed_expert"] == 3.0 and rates["attn"] >= 5.0 and set(rates) >= {"dense_mlp", "lm_head"}


def test_summarise_gguf_cut_file():
    g = _module()
    ev = [{"k": "imatrix", "t0": 0.0, "begin": 1}, {"k": "forward/layer.0", "t0": 1.0, "t1": 3.0},
          {"k": "imatrix", "t0": 0.0, "t1": 4.0}, {"k": "convert/Q4_K_M", "t0": 4.0, "begin": 1},
          {"k": "encode/Q4_K", "t0": 5.0, "t1": 5.5, "w": 1_000_000}, {"k": "encode/Q6_K", "t0": 6.0, "begin": 1}]
    s = g.summarise_gguf(ev, t_end=7.0)
    assert s["imatrix"] == {"seconds": 4.0, "state": "done", "forward_s": {"layer.0": 2.0}, "accumulate_s": 0}
    q = s["Q4_K_M"]
    assert q["state"] == "cut" and q["seconds"] == 3.0
    assert q["encode"]["Q4_K"]["mweights_per_s"] == 2.0 and "Q6_K" not in q["encode"]
    assert s["open_at_end"][-1] == {"phase": "encode/Q6_K", "elapsed_s": 1.0}


@pytest.mark.slow  # a 70 s deadline by design, and its stage timings move with the machine's load
def test_slice_cut_by_deadline_on_cpu(tmp_path, flash_config):
    """build, then EXL3 killed by its stage limit mid-layer, GGUF skipped by the deadline, projection."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(SCRIPT), "--work", str(tmp_path / "w"), "--json", str(out), "--small",
           "--device", "cpu", "--experts", "2", "--layers", "kda-dense,kda-moe", "--no-fp8", "--rows", "4",
           "--seq-len", "64", "--deadline-s", "70", "--reserve-s", "25", "--stage-limits", "exl3=25",
           "--stages", "build,exl3,gguf,project", "--gguf-types", "Q4_K_M"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    st = res["stages"]
    b = st["build"]
    assert b["layers"] == ["kda-dense", "kda-moe"] and b["fp8"] is False and b["bytes_written"] > 10**6
    assert (tmp_path / "w" / "bf16" / "config.json").is_file() and not (tmp_path / "w" / "fp8").exists()
    cfg = json.loads((tmp_path / "w" / "bf16" / "config.json").read_text())["text_config"]
    assert cfg["n_routed_experts"] == 2 and cfg["mlp_layer_types"] == ["dense", "sparse"]
    assert res["cut"] == [{"stage": "exl3", "by": "--stage-limits exl3=25", "after_s": st["exl3"]["cut_after_s"]}]
    x = st["exl3"]
    assert x["cut"] and 24 <= x["cut_after_s"] <= 30 and x["peak_rss_mib"] > 100
    ph = x["phases"]
    assert ph["open_at_end"], ph  # the phase it was killed in
    cut = [d for k, d in ph["stages"].items() if d["state"].startswith("cut")]
    assert len(cut) == 1
    if cut[0]["state"] == "cut":  # cut while encoding: N of M units and the rest extrapolated
        enc = cut[0]["encode"]
        assert sum(e.get("units_total", 0) for e in enc.values()) > sum(e["units_done"] for e in enc.values())
        assert cut[0]["extrapolated_within_layer"]["stage_seconds"] >= cut[0]["measured_s"]
    assert ph["stages"]["layer.0"]["calibration_forward_s"] > 0
    assert [s["stage"] for s in res["skipped"]] == ["gguf"] and "gguf" not in st
    p = st["project"]
    assert p["assumptions"]["slice_layers"] == ["kda-dense", "kda-moe"] and p["assumptions"]["reference"] is None
    assert "exl3_3.05" in p


def test_each_types_first_call_is_booked_once_not_in_its_rate():
    """A type's first tensor far slower than its later ones (its kernels built) leaves the type's rate at the later
    tensors' and is booked once; a type with one tensor is measured against its kind's other types; a first tensor
    within the factor is no warm-up."""
    mod = _module()

    def t(qtype, seconds, weights=10**6, experts=0):
        return {"type": qtype, "weights": weights, "experts": experts, "weights_done": weights,
                "s_per_mweight": seconds * 1e6 / weights}

    stages = {"layer.0": {"round": {"tensors": {"a": t("Q5_K", 60.0), "b": t("Q4_K", 50.0), "c": t("Q4_K", 1.0),
                                                "d": t("Q4_K", 1.0), "e": t("Q3_K", 2.5), "f": t("Q3_K", 1.0)}}},
              "layer.1": {"round": {"tensors": {"g": t("IQ2_S", 40.0, 2 * 10**9, 288)}}}}
    warm = mod.rounding_warmup(stages)
    assert set(warm) == {"Q5_K", "Q4_K"}  # Q3_K's first is 2.5x its later one: under the factor
    assert warm["Q4_K"]["seconds"] == 49.0 and warm["Q5_K"]["seconds"] == 59.0  # Q5_K against Q4_K/Q3_K's later 1 s
    rates = mod._round_rates(stages)
    assert rates["Q4_K/matrix"]["s_per_mweight"] == 1.0 and rates["Q5_K/matrix"]["s_per_mweight"] == 1.0
    assert rates["Q3_K/matrix"]["s_per_mweight"] == 1.75 and rates["IQ2_S/stack"]["s_per_mweight"] == 0.02


def test_a_stacks_first_slice_call_carries_its_types_warm_up():
    """A routed-expert stack (one per type in a slice) books its first expert-slice call's excess over its later
    calls as the type's warm-up, and its rate is the later calls'; a first call within the factor books none."""
    mod = _module()
    w = 2**28

    def stack(qtype, calls):
        total = sum(s for s, _ in calls)
        return {"type": qtype, "weights": 9 * w, "experts": 288, "weights_done": 9 * w,
                "s_per_mweight": total * 1e6 / (9 * w), "calls": calls}

    stages = {"layer.1": {"round": {"tensors": {
        "gate": stack("IQ2_S", [[15.0, w]] + [[3.0, w]] * 8),
        "up": stack("IQ2_XS", [[10.5, w]] + [[4.0, w]] * 8),
        "down": stack("Q2_K", [[4.0, w]] + [[3.0, w]] * 8)}}}}
    warm = mod.rounding_warmup(stages)
    assert set(warm) == {"IQ2_S", "IQ2_XS"} and warm["IQ2_S"]["seconds"] == 12.0 and warm["IQ2_XS"]["seconds"] == 6.5
    rates = mod._round_rates(stages)
    assert abs(rates["IQ2_S/stack"]["seconds"] - 27.0) < 1e-6 and abs(rates["Q2_K/stack"]["seconds"] - 28.0) < 1e-6


def test_a_stage_without_the_source_layers_events_keeps_its_capture_forward():
    """A log with no materialise/release events (before that probe, or a stage that builds no layer) still gives
    the stage's capture forward, its Hessian accumulation and its state; with them, the source layer's seconds."""
    mod = _module()
    conv = [{"k": "convert/x", "t0": 0.0, "begin": 1}, {"k": "convert/x", "t0": 0.0, "t1": 30.0}]
    fwd = [{"k": "forward/layer.0", "t0": 1.0, "begin": 1}, {"k": "hessian_add", "t0": 2.0, "t1": 3.5},
           {"k": "forward/layer.0", "t0": 1.0, "t1": 6.0}]
    d = mod.summarise_hessian(conv + fwd)["stages"]["layer.0"]
    assert d["state"] == "done" and d["capture_forward_s"] == 5.0 and d["hessian_accumulate_s"] == 1.5
    assert "source_layer_s" not in d
    moved = [{"k": "materialize/layer.0", "t0": 0.5, "begin": 1}, {"k": "materialize/layer.0", "t0": 0.5, "t1": 0.9}]
    d = mod.summarise_hessian(conv + moved + fwd)["stages"]["layer.0"]
    assert d["source_layer_s"] == 0.4 and d["hessian_accumulate_s"] == 1.5 and d["state"] == "done"


def test_a_cold_runs_warm_up_is_read_from_its_file(tmp_path):
    """--warmup-json: the warm-ups come from that run's rounded tensors (a cold kernel cache), named by its file."""
    mod = _module()
    w = 2**28
    calls = [[15.0, w]] + [[3.0, w]] * 8
    stages = {"layer.1": {"round": {"tensors": {"gate": {
        "type": "IQ2_S", "weights": 9 * w, "experts": 288, "weights_done": 9 * w,
        "s_per_mweight": sum(c for c, _ in calls) * 1e6 / (9 * w), "calls": calls}}}}}
    cold = tmp_path / "cold.json"
    cold.write_text(json.dumps({"stages": {"gguf-hessian": {"phases": {"stages": stages}}}}))
    where, warm = mod.cold_warmup(cold)
    assert where.endswith("cold.json") and warm["IQ2_S"]["seconds"] == 12.0
    assert mod.cold_warmup(None) is None


def test_an_earlier_runs_groups_price_a_run_that_measured_none(tmp_path):
    """--groups-json: every expert-group stage an earlier run measured (its layer stages left out), named by its
    file; a file without a measured group gives none."""
    mod = _module()
    tune = {"stages": [{"what": "the layer's tensors", "s_per_step": 0.19, "steps_done": 200},
                       {"what": "group", "s_per_step": 0.33, "steps_done": 25},
                       {"what": "group", "s_per_step": None, "steps_done": 0}]}
    f = tmp_path / "earlier.json"
    f.write_text(json.dumps({"stages": {"gguf-hessian": {"phases": {"stages": {"layer.1": {"tune": tune}}}}}}))
    where, groups, commit = mod.measured_groups(f)
    assert where.endswith("earlier.json") and [g["s_per_step"] for g in groups] == [0.33] and commit is None
    # a tuner that commits each group's routed sums: their seconds per finished group
    tune["stages"][1]["state"] = "done"
    tune["streams_parts_s"] = {"commit": 0.3}
    f.write_text(json.dumps({"stages": {"gguf-hessian": {"phases": {"stages": {"layer.1": {"tune": tune}}}}}}))
    assert mod.measured_groups(f)[2] == 0.3
    tune["stages"] = tune["stages"][:1]
    f.write_text(json.dumps({"stages": {"gguf-hessian": {"phases": {"stages": {"layer.1": {"tune": tune}}}}}}))
    assert mod.measured_groups(f) is None and mod.measured_groups(None) is None


def test_the_streams_around_a_layers_tuning_are_split():
    """The tuner's time outside its stages (streams_other_s), split by part: a layer call inside a stage is a step,
    one outside it is the quantized pass."""
    mod = _module()
    ev = [{"k": "tune_layer/layer.1", "t0": 0.0, "t1": 20.0},
          {"k": "tune_streams/materialize", "t0": 0.5, "t1": 3.5},
          {"k": "tune_streams/source_pass", "t0": 4.0, "t1": 6.0},
          {"k": "tune_streams/decode_rounded", "t0": 6.0, "t1": 7.0},
          {"k": "tune_stage/layer.1", "t0": 8.0, "t1": 14.0, "w": 100, "iters": 2},
          {"k": "tune_step", "t0": 9.0}, {"k": "tune_step", "t0": 11.0},
          {"k": "tune_streams/layer_call", "t0": 9.0, "t1": 10.0},
          {"k": "tune_streams/layer_call", "t0": 15.0, "t1": 17.5}]
    d = mod._tune_summary(ev, ev, "layer.1")
    p = d["streams_parts_s"]
    assert (p["materialize"], p["source_pass"], p["decode_rounded"], p["quantized_pass"]) == (3.0, 2.0, 1.0, 2.5)
    assert d["streams_other_s"] == 14.0 and d["stages"][0]["steps_done"] == 2


def test_measured_groups_are_pooled_by_their_steps():
    """The expert groups' step rate is the measured groups' pooled by the steps each ran (a cut group's three steps
    weigh three), and their checks' seconds are averaged per check."""
    mod = _module()
    groups = [{"steps_done": 25, "s_per_step": 0.33, "checks": 5, "check_s": 2.0, "setup_s": 0.0},
              {"steps_done": 3, "s_per_step": 0.24, "checks": 1, "check_s": 0.4, "setup_s": 0.0}]
    g = mod._pooled_groups(groups)
    assert abs(g["s_per_step"] - (25 * 0.33 + 3 * 0.24) / 28) < 1e-12
    assert g["checks"] == 6 and abs(g["check_s"] / g["checks"] - 0.4) < 1e-12


def test_rounding_calls_are_re_priced_by_a_measured_ratio(tmp_path):
    """--round-calls-json FROM TO: a stacked type both runs hold has its steady expert-slice calls scaled by TO / FROM
    (per weight), its other seconds (per-expert Hessians, fetch, spill) kept; other types and matrices unchanged."""
    mod = _module()
    rows = lambda sec: {"rows": [{"type": "IQ2_S", "kind": "stack", "weights": 1_000_000, "seconds": sec},  # noqa: E731
                                 {"type": "Q4_K", "kind": "matrix", "weights": 1_000_000, "seconds": sec}]}
    a, b = tmp_path / "one.json", tmp_path / "none.json"
    a.write_text(json.dumps(rows(2.0)))
    b.write_text(json.dumps(rows(0.5)))
    ratios = mod.round_call_ratios([a, b])
    assert ratios[1] == {"IQ2_S/stack": 0.25, "Q4_K/matrix": 0.25}
    # the run: 3 calls of 1 M weights (the first with a build), 10 s in all for 3 M weights (1 s outside the calls)
    stages = {"layer.1": {"round": {"tensors": {"x": {"type": "IQ2_S", "experts": 8, "weights_done": 3_000_000,
                                                      "s_per_mweight": 10 / 3, "calls": [[5, 1e6], [2, 1e6],
                                                                                         [2, 1e6]]}}}}}
    rates = {"IQ2_S/stack": {"weights": 3_000_000, "seconds": 10.0, "s_per_mweight": 10 / 3},
             "Q4_K/matrix": {"weights": 1_000_000, "seconds": 1.0, "s_per_mweight": 1.0}}
    r = mod._Rates()
    out = mod._repriced_rounding(rates, stages, ratios, r)
    assert out["IQ2_S/stack"]["s_per_mweight"] == round(10 / 3 - 2 * 0.75, 4)  # 2 s per M weights of calls, x0.25
    assert out["Q4_K/matrix"] == rates["Q4_K/matrix"] and "rounding IQ2_S/stack" in r.notes
    assert mod._repriced_rounding(rates, stages, None, r) is rates and mod.round_call_ratios(None) is None


def test_group_steps_are_re_priced_for_the_layers_stack_types(tmp_path):
    """--decode-json: an expert group's step pays each stack's decode per expert at the decode file's rates, so a
    release layer whose stacks are all IQ2_S steps slower than the slice's IQ2_S / IQ2_XS / Q2_K mix; a type the
    file lacks (Q2_K) counts as free."""
    from types import SimpleNamespace

    mod = _module()
    f = tmp_path / "decode.json"
    f.write_text(json.dumps({"types": [
        {"type": "IQ2_S", "weights": 1000, "scored": {"decode_forward_backward_s": 9.0},
         "one_kernel": {"decode_forward_backward_s": 2.0}},
        {"type": "IQ2_XS", "weights": 1000, "scored": {"decode_forward_backward_s": 1.0}}]}))
    src, rates = mod.decode_rates(f)
    assert rates == {"IQ2_S": 0.002, "IQ2_XS": 0.001} and mod.decode_rates(None) is None
    stages = {"layer.0": {"round": {"tensors": {"a": {"type": "Q4_K", "experts": 0, "weights": 50}}}},
              "layer.1": {"round": {"tensors": {"g": {"type": "IQ2_S", "experts": 4, "weights": 400},
                                                "u": {"type": "IQ2_XS", "experts": 4, "weights": 400},
                                                "d": {"type": "Q2_K", "experts": 4, "weights": 400}}}}}
    sliced = mod._slice_stacks(stages)
    assert sliced == [("IQ2_S", 100), ("IQ2_XS", 100), ("Q2_K", 100)]
    stack = lambda: SimpleNamespace(shape=(8, 10, 10), transform="stack")  # noqa: E731
    tensors = [(stack(), "IQ2_S", True) for _ in range(3)]
    tune = {"stages": [{"s_per_step": 0.1, "steps_done": 200, "checks": 5, "check_s": 0.5},
                       {"s_per_step": 0.2, "steps_done": 25, "checks": 1, "check_s": 0.1, "state": "done"}]}
    # a budget under one stack: no stack joins the layer stage, the experts go in 4 groups of 2
    plain = mod._layer_tuning(tensors, tune, 200, 2 * 300, mod._Rates())
    priced = mod._layer_tuning(tensors, tune, 200, 2 * 300, mod._Rates(), decode=(src, rates, sliced))
    # 4 groups x 25 steps x 2 experts x (3 x 100 x 0.002 - (100 x 0.002 + 100 x 0.001))
    assert priced["steps"] - plain["steps"] == pytest.approx(4 * 25 * 2 * (0.6 - 0.3))


def _eval_state(ref_layers: dict, cand_layers: dict) -> dict:
    """An eval stage's phases as the slice writes them: 16 windows x 4096 tokens (the release eval's own count, so
    no token scaling), a reference and one GGUF candidate."""
    def model(per: dict) -> dict:
        return {"load_s": 2.0, "get_s": 1.0, "materialize_s": 0.5, "forward_per_layer_s": per, "embed_s": 0.25,
                "logits_s": 4.0}

    cand = dict(model(cand_layers), decode_s=1.0, decode={"Q4_K": {"weights": 2_000_000}})
    return {"eval": {"windows": 16, "ctx": 4096,
                     "phases": {"score_s": 3.0, "models": {"reference": model(ref_layers), "cand.gguf": cand}}}}


LAYERS = ("kda-dense", "kda-moe", "dsa-moe")
COUNTS = {"release": {"text": 1000, "vision": 5}, "slice": {"text": 10, "vision": 1}}  # text weights x100


def test_eval_projection_prices_every_release_layer_by_its_kind():
    """GLM-5.3-Flash's 45 layers: 3 KDA + dense, 31 KDA + MoE, 11 DSA + MoE (the shape config). The reference's
    forward is each kind's measured layer times its count plus the embedding; reads and copies scale by the text
    weights (x100 here)."""
    per = {"layer.0": 1.0, "layer.1": 2.0, "layer.2": 3.0}
    ev = _module().project_eval_phases(_eval_state(per, per), LAYERS, COUNTS)
    parts = ev["parts_hours"]
    assert parts["reference: forward"] == round((3 * 1.0 + 31 * 2.0 + 11 * 3.0 + 0.25) / 3600, 4)
    assert parts["candidate: forward"] == parts["reference: forward"]
    assert parts["reference: read BF16"] == round((2.0 + 1.0) * 100 / 3600, 4)
    assert parts["reference: copy to the device"] == round(0.5 * 100 / 3600, 4)
    assert parts["statistics (KLD, top-1)"] == round(3.0 / 3600, 4)
    assert ev["one_candidate_hours"] == round(sum(parts.values()), 3)


def test_eval_projection_refuses_a_stage_cut_before_the_last_layer():
    """A stage that ran layer 0 only has no MoE forward: no projection, rather than the MoE layers at 0 s."""
    mod = _module()
    ev = mod.project_eval_phases(_eval_state({"layer.0": 1.0}, {"layer.0": 1.5}), LAYERS, COUNTS)
    assert "one_candidate_hours" not in ev
    assert ev["incomplete"] == {"reference": ["layer.1", "layer.2"], "cand.gguf": ["layer.1", "layer.2"]}
    with pytest.raises(ValueError, match="kda-dense"):  # a release kind the slice does not hold is not free either
        mod.project_eval_phases(_eval_state({"layer.0": 1.0}, {"layer.0": 1.0}), ("kda-moe",), COUNTS)
