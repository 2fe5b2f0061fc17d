"""The expert-offload plan against llama.cpp itself (bench/engines/offload_plan_check.py, slow): k256 converted with
the planned types and loaded by llama-cpp-python 0.3.36 with the plan's -ot pattern and context; the tensors
llama.cpp's regex selects are the plan's host experts, and the buffers it logs match the plan within 2%.

A CPU build has no cards: the card split (-ts) and the CUDA buffers need a CUDA build (bench/README.md)."""
from __future__ import annotations

from pathlib import Path

import pytest
from module_loader import load_module

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def checked(k256_model, tmp_path_factory):
    pytest.importorskip("llama_cpp")
    bench = load_module("offload_plan_check", BENCH / "engines" / "offload_plan_check.py")
    try:
        return bench.run(k256_model, tmp_path_factory.mktemp("offload"))
    except bench.NoRepack as e:
        pytest.skip(str(e))


def test_llama_cpp_overrides_exactly_the_planned_host_experts(checked):
    c = checked["check"]
    assert c["types_written_equal_planned"]
    assert c["overridden_tensors"] and c["overridden_equal_plan_host_experts"] and c["overridden_types_equal_plan"]
    assert "-ot" in checked["flags"]


@pytest.mark.parametrize("buffer", ["host_experts", "rest_weights", "kv", "recurrent"])
def test_llama_cpp_buffers_match_the_plan(checked, buffer):
    row = checked["check"][buffer]
    assert row["llama_cpp"] > 0
    assert abs(row["rel"]) <= 0.02, row
