"""`mixq convert` for a new user: the format follows OUT, EXL3 on a CPU is estimated up front and refused when it
would take long (unless --device cpu), and the written file's bpw is the one plan predicted and eval reports."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from cli_helpers import run_cli as _cli
from mixq.conversion.api import output_format


def _one_error_line(r) -> str:
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mixq: error: "), r.stderr
    return lines[0]


def test_output_format_follows_the_name():
    assert output_format("m.gguf") == "gguf" and output_format("out/M-Q4_K_M.GGUF") == "gguf"
    assert output_format("m-exl3") == "exl3" and output_format("m.gguf.d") == "exl3"


@pytest.fixture(scope="module")
def mini_q8(mini_q8_converted):
    """glm5next-mini converted to Q8_0 with no --format: (path, convert JSON), conftest's one conversion."""
    return mini_q8_converted


def test_gguf_is_inferred_from_out(mini_q8):
    out, d = mini_q8
    assert d["format"] == "gguf" and d["out"] == str(out) and out.read_bytes()[:4] == b"GGUF"
    assert d["types"]["Q8_0"] > 0


def test_exl3_is_inferred_for_a_directory(mini_model, tmp_path):
    # no --format and a directory OUT: the EXL3 options apply, so a GGUF-only option is named
    line = _one_error_line(_cli("convert", mini_model, tmp_path / "mini-exl3", "--type", "Q8_0"))
    assert "--type applies to --format gguf only" in line
    line = _one_error_line(_cli("convert", mini_model, tmp_path / "x.gguf", "--format", "exl3", "--bpw", "3"))
    assert "x.gguf" in line and "EXL3" in line
    assert not any(tmp_path.iterdir())


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cpu_exl3_is_refused_with_an_estimate(mini_model, tmp_path, no_cuda):
    from mixq.conversion.exl3.estimate import CPU_LIMIT_S, cpu_seconds
    from mixq.planning.planner import plan_model

    out = tmp_path / "mini-exl3"
    line = _one_error_line(_cli("convert", mini_model, out, "--bpw", "3"))
    est = cpu_seconds(plan_model(mini_model, "exl3", bpw=3))
    assert est > CPU_LIMIT_S
    assert "EXL3 on the CPU would take about" in line and "--device cpu" in line and "GPU" in line
    assert f"{est / 60:.1f} min" in line or f"{est / 3600:.1f} h" in line
    assert not out.exists()  # refused before anything is written


def test_device_cpu_insists(mini_model, tmp_path, no_cuda, monkeypatch):
    import mixq.conversion.exl3.pipeline as pipeline

    started = []

    class Started(Exception):
        pass

    def stop(run):  # the conversion got past the estimate: stop before the (hours of) work
        started.append(run.device)
        raise Started

    monkeypatch.setattr(pipeline, "_start_job", stop)
    r = _cli("convert", mini_model, tmp_path / "mini-exl3", "--bpw", "3", "--device", "cpu")
    assert isinstance(r.exception, Started) and [d.type for d in started] == ["cpu"]
    assert "EXL3 on the CPU: about" in r.stderr


def test_one_bpw_from_plan_to_convert_to_eval(mini_model, mini_q8, heldout_text, tmp_path):
    """file bytes x 8 / the source's parameters, under the same key in every JSON; eval runs as a new user
    would (a fresh process: default windows, --json -), which also shows transformers stays quiet."""
    out, conv = mini_q8
    plan = json.loads(_cli("plan", mini_model, "--format", "gguf", "--type", "Q8_0", "--json").stdout)
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_VERBOSITY"}
    p = subprocess.run([sys.executable, "-m", "mixq", "eval", str(mini_model), str(out), "--text", str(heldout_text),
                        "--ctx", "8", "--json", "-"], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    ev = json.loads(p.stdout)  # stdout is the JSON report alone
    (cand,) = ev["candidates"]
    params = sum(v["params"] for v in json.loads(_cli("inspect", mini_model, "--json").stdout)["roles"].values())
    assert plan["ref_params"] == conv["ref_params"] == ev["ref_params"] == params
    assert conv["file_bytes"] == cand["file_bytes"] == out.stat().st_size
    assert conv["file_bpw"] == cand["file_bpw"] == cand["bpw"] == out.stat().st_size * 8 / params
    assert abs(plan["file_bpw"] - conv["file_bpw"]) < 0.01 * conv["file_bpw"]  # the plan's header estimate
    # the bounded default: 32 windows, announced with the way to score everything
    assert ev["windows"] == 32 and cand["positions"] == 32 * (8 // 2 - 1)
    assert "eval: 32 windows of 8 tokens" in p.stderr and "--windows all" in p.stderr
    assert "[transformers]" not in p.stderr and "falling back" not in p.stderr


def test_readable_summary_prints_the_one_bpw(mini_q8):
    from mixq.conversion.result import ConvertResult

    out, d = mini_q8
    res = ConvertResult(**{k: v for k, v in d.items() if k != "file_bpw"})
    text = res.summary()
    assert f"bpw        {d['file_bpw']:.3f} = file bytes x 8 / {d['ref_params']:,} model parameters" in text
    assert text.count("bpw") == 1 and "{" not in text and f"mixq verify {out}" in text
