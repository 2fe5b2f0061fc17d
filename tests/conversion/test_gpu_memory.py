"""--gpu-memory on convert (GGUF, EXL3), imatrix and eval: parsed once into each verb's options, the estimate said
up front and reported, a budget below a stage's smallest piece refused with one line before anything is written,
and the GGUF bytes the same whatever the budget (the Hessian rounding's expert slices change memory, not codes)."""
from __future__ import annotations

import json

import pytest
import torch

import mixq
from cli_helpers import error_line, run_cli
from mixq.conversion.gguf.pipeline import run_gguf
from mixq.conversion.options import GGUFOptions, ImatrixOptions, options_for
from mixq.errors import InputError
from mixq.eval.options import EvalOptions


@pytest.mark.parametrize("make", [lambda v: GGUFOptions(qtype="Q8_0", gpu_memory=v),
                                  lambda v: options_for("exl3", bpw=3.0, gpu_memory=v),
                                  lambda v: ImatrixOptions(gpu_memory=v), lambda v: EvalOptions(gpu_memory=v)])
def test_the_budget_is_parsed_once_into_bytes(make):
    assert make("24GB").gpu_memory == 24 * 10**9
    assert make("80GiB").gpu_memory == 80 * 2**30
    assert make(None).gpu_memory is None
    with pytest.raises(InputError, match=r"^--gpu-memory 'lots': cannot parse size"):
        make("lots")
    with pytest.raises(InputError, match="--gpu-memory"):
        make(0)


@pytest.mark.parametrize("command", ["convert", "imatrix", "eval"])
def test_the_flag_is_offered(command):
    r = run_cli(command, "--help")
    assert r.exit_code == 0 and "--gpu-memory SIZE" in r.output


def test_convert_gguf_refuses_a_budget_it_cannot_meet(k256_model, tmp_path):
    out = tmp_path / "x.gguf"
    line = error_line(run_cli("convert", k256_model, out, "--type", "Q8_0", "--gpu-memory", "1MB"))
    assert line.startswith("mixq: error: --gpu-memory 0.95 MiB: the gguf_encode stage needs ")
    assert " bytes " in line and "on cpu" in line
    assert list(tmp_path.iterdir()) == []


def test_convert_exl3_refuses_a_budget_it_cannot_meet(k256_model, tmp_path):
    out = tmp_path / "x-exl3"
    line = error_line(run_cli("convert", k256_model, out, "--bpw", "3", "--device", "cpu", "--gpu-memory", "1MB"))
    assert "the calibration stage needs" in line
    assert not out.exists()


def test_imatrix_refuses_a_budget_it_cannot_meet(k256_model, tmp_path):
    line = error_line(run_cli("imatrix", k256_model, tmp_path / "i.gguf", "--device", "cpu", "--gpu-memory", "1MB"))
    assert "the calibration stage needs" in line
    assert list(tmp_path.iterdir()) == []


def test_eval_refuses_a_budget_it_cannot_meet(mini_model, mini_q8_gguf, tmp_path):
    from conftest import shared_path
    js = tmp_path / "r.json"
    line = error_line(run_cli("eval", mini_model, mini_q8_gguf, "--text", shared_path("data", "heldout.txt"),
                              "--device", "cpu", "--windows", "1", "--ctx", "32", "--gpu-memory", "1MB",
                              "--json", js))
    assert "the eval_forward stage needs" in line
    assert not js.exists()


def test_convert_states_its_memory_up_front_and_in_the_result(mini_model, tmp_path):
    r = run_cli("convert", mini_model, tmp_path / "m.gguf", "--type", "Q8_0", "--threads", "1", "--json")
    assert r.exit_code == 0, r.output[-2000:]
    assert "mixq convert: memory: device cpu needs ~" in r.stderr and "host ~" in r.stderr
    d = json.loads(r.stdout)
    assert d["memory"]["stages"][0]["stage"] == "gguf_encode" and d["memory"]["budget_given"] is False
    assert d["memory"]["host_bytes"] >= d["memory"]["device_bytes"] > 0


@pytest.mark.slow
def test_gguf_bytes_do_not_depend_on_the_budget(k256_model, tmp_path):
    """k256, Q4_K_M with Hessian rounding: a budget that leaves room for two routed experts per rounding call
    beside the calibration (16 experts: 8 calls a stack) writes the file the default writes, byte for byte.
    Tuning is off here: its expert groups are a result of the budget (runtime/memory_budget.STAGES)."""
    from conftest import shared_path
    cal = shared_path("data", "calibration.txt")
    kw = dict(qtype="Q4_K_M", rounding="hessian", calibration=[cal], rows=2, seq_len=64, tune_iters=0,
              threads=1, progress=False)
    ref = run_gguf(k256_model, tmp_path / "default.gguf", GGUFOptions(**kw))
    rounding = next(s for s in ref.memory["stages"] if s["stage"] == "gguf_rounding")
    assert rounding["piece"] == rounding["default_piece"] == 16  # the stack's 16 experts in one call
    budget = rounding["fixed"] + 2 * rounding["per_piece"] + 1
    small = run_gguf(k256_model, tmp_path / "small.gguf", GGUFOptions(**kw, gpu_memory=budget))
    assert next(s for s in small.memory["stages"] if s["stage"] == "gguf_rounding")["piece"] == 2
    assert (tmp_path / "default.gguf").read_bytes() == (tmp_path / "small.gguf").read_bytes()
    assert mixq.verify(tmp_path / "small.gguf")["ok"]


def test_exl3_stacks_shrink_only_where_the_budget_is_below_them(k256_model):
    """k256's MoE layer: without a budget (or with a large one) its 16 routed experts go in the default stacks;
    a budget of three units' bytes stacks three at a time. The stack is not piece-invariant (one global scale
    and one seed per stack), so the default is kept wherever it fits."""
    from mixq.conversion.exl3.pipeline import batches
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.exl3_names import exl3_layout
    from mixq.runtime.memory_budget import MemoryBudget, exl3_unit_bytes

    units = [u for u in exl3_layout(open_checkpoint(k256_model)) if u.stage == "layer.1" and u.kind == "trellis"]
    items = [(u, True) for u in units]
    bits = {u.key: 3.0 for u in units}
    default = batches(items, bits)
    assert batches(items, bits, MemoryBudget(torch.device("cpu"), 2**50, True)) == default
    assert max(len(g) for g in default) == 16
    expert = units[max(default, key=len)[0]].shape  # the routed experts' (out, in)
    budget = 3 * exl3_unit_bytes(*expert)
    small = batches(items, bits, MemoryBudget(torch.device("cpu"), budget, True))
    for g in small:
        shape = units[g[0]].shape
        assert len(g) <= max(1, budget // exl3_unit_bytes(*shape))
    assert max(len(g) for g in small if units[g[0]].shape == expert) == 3
    assert sorted(i for g in small for i in g) == sorted(i for g in default for i in g)
