"""bench/release/release_hours.py: the projection's arithmetic on a hand-made profile (each kind's layer seconds
counted by the real model's count of that kind, whole-run stages scaled by the byte ratio, peaks not scaled), the
counts read from GLM-5.3-Flash's config, and the refusal of a kind the run never measured."""
from __future__ import annotations

import json

import pytest

from module_loader import BENCH, load_module

rh = load_module("release_hours_under_test", BENCH / "release" / "release_hours.py")

LAYERS = {"0": {"attention": "linear_attention", "mlp": "dense"},
          "1": {"attention": "linear_attention", "mlp": "moe"},
          "2": {"attention": "deepseek_sparse_attention", "mlp": "moe"},
          "nextn": {"attention": "deepseek_sparse_attention", "mlp": "moe"}}


def _stage(stage, layer, seconds, host=1, gpu=0):
    return {"stage": stage, "layer": layer, "seconds": seconds, "bytes_read": 0, "bytes_written": 0,
            "peak_host_bytes": host, "peak_gpu_bytes": gpu}


def _profile(stages, seconds=1000.0):
    return {"mixq_profile": 1, "verb": "convert", "argv": ["mixq"], "format": "exl3", "device": "cuda:0 X",
            "layers": LAYERS, "stages": stages,
            "total": {"seconds": seconds, "bytes_read": 0, "bytes_written": 0, "peak_host_bytes": 9,
                      "peak_gpu_bytes": 7}}


def _moving(stage, seconds, read=0, written=0):
    return dict(_stage(stage, None, seconds), bytes_read=read, bytes_written=written)


STAGES = [
    _stage("open", None, 2.0), _moving("scan", 3.0, read=100),
    _stage("encode", "embed", 1.5),
    _stage("calibrate", "0", 4.0), _stage("encode", "0", 6.0),
    _stage("calibrate", "1", 10.0), _stage("encode", "1", 290.0, host=50, gpu=80),
    _stage("calibrate", "2", 12.0), _stage("encode", "2", 280.0, host=60, gpu=70),
    _stage("calibrate", "head", 0.5), _stage("encode", "head", 2.5),
    _stage("encode", "nextn", 250.0), _stage("encode", "vision", 5.0),
    _moving("finalize", 5.0, read=10, written=10),
]
SCALE = {"bytes": 20.0, "tensors": 4.0}
COUNTS = {"embed": 1, "head": 1, "dsa-moe": 11, "kda-dense": 3, "kda-moe": 31, "nextn": 1, "vision": 1}


def test_projection_arithmetic():
    """Every term by hand: kinds counted, whole-run stages ×r (bytes where they moved bytes, else tensors), the
    total, peaks the largest stage's."""
    got = rh.project(_profile(STAGES), COUNTS, SCALE)
    k = got["kinds"]
    assert k["kda-dense"] == {"measured_layers": ["0"], "stages_per_layer": {"calibrate": 4.0, "encode": 6.0},
                              "seconds_per_layer": 10.0, "count": 3, "counted_seconds": 30.0}
    assert k["kda-moe"]["counted_seconds"] == 300.0 * 31
    assert k["dsa-moe"]["counted_seconds"] == 292.0 * 11
    assert k["nextn"]["counted_seconds"] == 250.0
    assert (k["embed"]["counted_seconds"], k["head"]["counted_seconds"], k["vision"]["counted_seconds"]) == \
        (1.5, 3.0, 5.0)
    w = got["whole_run"]
    assert w["stages"] == {
        "open": {"measured_seconds": 2.0, "scale_by": "tensors", "scale": 4.0, "scaled_seconds": 8.0},
        "scan": {"measured_seconds": 3.0, "scale_by": "bytes", "scale": 20.0, "scaled_seconds": 60.0},
        "finalize": {"measured_seconds": 5.0, "scale_by": "bytes", "scale": 20.0, "scaled_seconds": 100.0}}
    assert w["measured_seconds"] == 10.0 and w["scaled_seconds"] == 168.0
    assert set(w["scale_why"]) == {"bytes", "tensors"}
    want = 30.0 + 300.0 * 31 + 292.0 * 11 + 250.0 + 1.5 + 3.0 + 5.0 + 168.0
    assert got["projected_seconds"] == pytest.approx(want) and got["projected_hours"] == pytest.approx(want / 3600)
    assert got["peak"]["host_bytes"] == 60 and got["peak"]["gpu_bytes"] == 80
    assert got["outside_stages_seconds"] == pytest.approx(1000.0 - sum(s["seconds"] for s in STAGES))


def test_two_layers_of_a_kind_are_averaged_and_resumed_runs_merged():
    """A kind measured on two layers is priced per layer (their mean); two profiles of one run (--resume) are one."""
    layers = dict(LAYERS, **{"3": {"attention": "linear_attention", "mlp": "moe"}})
    a = dict(_profile(STAGES[:7], 500.0), layers=layers)
    b = dict(_profile(STAGES[7:] + [_stage("encode", "3", 310.0), _stage("calibrate", "3", 10.0)], 600.0),
             layers=layers)
    merged = rh.merge([a, b])
    assert merged["total"]["seconds"] == 1100.0 and merged["stages"] == a["stages"] + b["stages"]
    got = rh.project(merged, COUNTS, SCALE)
    assert got["kinds"]["kda-moe"]["measured_layers"] == ["1", "3"]
    assert got["kinds"]["kda-moe"]["seconds_per_layer"] == (300.0 + 320.0) / 2
    with pytest.raises(ValueError, match="differ in 'verb'"):
        rh.merge([a, dict(b, verb="eval")])


def test_missing_kind_is_refused_not_zero():
    """A MoE layer kind without a stage (the old bug priced those forwards as 0 s) is an error naming it; a kind the
    verb never runs passes only when declared absent, and is listed so."""
    no_dsa = [s for s in STAGES if s["layer"] != "2"]
    with pytest.raises(rh.MissingKind, match="dsa-moe.*has 11"):
        rh.project(_profile(no_dsa), COUNTS, SCALE)
    no_nextn = [s for s in STAGES if s["layer"] not in ("nextn", "vision")]
    with pytest.raises(rh.MissingKind, match="nextn"):
        rh.project(_profile(no_nextn), COUNTS, SCALE)
    got = rh.project(_profile(no_nextn), COUNTS, SCALE, absent={"nextn", "vision"})
    assert got["kinds"]["nextn"]["counted_seconds"] == 0.0 and "declared" in got["kinds"]["nextn"]["absent"]
    with pytest.raises(ValueError, match="not a mixq profile"):
        rh.merge([dict(_profile(STAGES), mixq_profile=2)])


def test_counts_from_the_flash_config(flash_config):
    """The counts come from GLM-5.3-Flash's config.json: 3 KDA+dense, 31 KDA+MoE, 11 DSA+MoE, one NextN block,
    one embedding, head and vision tower."""
    counts = rh.kind_counts(json.loads(flash_config.read_text()))
    assert counts == {"embed": 1, "head": 1, "dsa-moe": 11, "kda-dense": 3, "kda-moe": 31, "nextn": 1, "vision": 1}
