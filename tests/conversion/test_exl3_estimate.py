"""conversion/exl3/estimate.py: the CPU time of an EXL3 conversion from its plan, and when it is refused."""
from __future__ import annotations

import math

import pytest

from mixq.conversion.exl3.estimate import (CPU_LIMIT_S, CPU_WEIGHTS_PER_CORE_S, check_cpu_time, cpu_seconds,
                                        describe_seconds, trellis_weights)
from mixq.planning.types import Plan
from mixq.planning.planner import plan_model
from mixq.errors import InputError


@pytest.fixture(scope="module")
def mini_plan(mini_model):
    return plan_model(mini_model, "exl3", bpw=3.05)


def test_trellis_weights_are_the_padded_trellis_tensors(mini_plan):
    tr = [t for t in mini_plan.tensors if t.type == "trellis"]
    raw = sum(math.prod(t.shape) for t in tr)
    # mini's routed experts are 64 x 128: the encoder works on 128 x 128 tiles
    assert trellis_weights(mini_plan) == 4_931_584 > raw == 3_178_496
    assert cpu_seconds(mini_plan, cores=2) == pytest.approx(4_931_584 / (2 * CPU_WEIGHTS_PER_CORE_S))
    assert cpu_seconds(mini_plan, cores=4) == pytest.approx(cpu_seconds(mini_plan, cores=2) / 2)


def test_refused_on_the_cpu_unless_asked_for(mini_plan):
    est = cpu_seconds(mini_plan)
    assert est > CPU_LIMIT_S
    with pytest.raises(InputError, match=r"about .*--device cpu") as e:
        check_cpu_time(mini_plan, "cpu", explicit=False)
    assert "\n" not in str(e.value) and describe_seconds(est) in str(e.value)
    assert check_cpu_time(mini_plan, "cpu", explicit=True) == pytest.approx(est)
    assert check_cpu_time(mini_plan, "cuda", explicit=False) is None  # an accelerator: no estimate, no refusal


def test_small_plans_pass(mini_plan):
    two = [t for t in mini_plan.tensors if t.type == "trellis" and t.shape == (128, 128)][:2]
    small = Plan("exl3", sum(t.bytes for t in two), 3.05, two, {})  # two 128 x 128 matrices: about a minute
    assert trellis_weights(small) == 2 * 128 * 128
    assert check_cpu_time(small, "cpu", explicit=False) < CPU_LIMIT_S


def test_describe_seconds():
    assert describe_seconds(12.4) == "12 s" and describe_seconds(270) == "4.5 min"
    assert describe_seconds(3 * 3600) == "3.0 h"
