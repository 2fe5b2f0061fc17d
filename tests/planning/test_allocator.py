"""quant/allocator.py: EXL3 byte accounting, rate ladder, solver (role model and measured curves)."""
from __future__ import annotations

import itertools

import pytest

from mixq.errors import InputError, PlanError
from mixq.planning import allocator as al
from mixq.planning.sizes import parse_size


def test_exl3_bytes_follow_the_padded_layout():
    # (out=200, in=300) pads to n=256, k=384; trellis (k/16, n/16, 16K) int16
    assert al.pad128(200) == 256 and al.pad128(384) == 384
    assert al.exl3_trellis_bytes(200, 300, 4) == (384 // 16) * (256 // 16) * 64 * 2
    assert al.exl3_trellis_bytes(200, 300, 2.5) == (384 // 16) * (256 // 16) * 40 * 2  # 16*2 + 8 words
    assert al.exl3_linear_overhead(200, 300) == 2 * 384 + 2 * 256 + 4
    assert al.exl3_linear_bytes(4096, 2048, 3) == 4096 * 2048 * 3 // 8 + 2 * 2048 + 2 * 4096 + 4
    with pytest.raises(PlanError):
        al.exl3_trellis_bytes(128, 128, 4.5)


def test_rate_floor_matches_exllamav3():
    assert al.rate_floor(3.05) == 3.0 and al.rate_floor(3.7) == 3.5 and al.rate_floor(4.7) == 4.0
    assert al.rate_floor(0.3) == 1.0 and al.rate_floor(9) == 8.0


def _units(n_layers=8):
    us = []
    for i in range(n_layers):
        us.append(al.Unit(f"L{i}.experts", "routed_expert", 64 * 128 * 128, layer=i, n_layers=n_layers))
        us.append(al.Unit(f"L{i}.attn", "attn", 4 * 128 * 128, layer=i, n_layers=n_layers))
        us.append(al.Unit(f"L{i}.shared", "shared_expert", 3 * 128 * 128, layer=i, n_layers=n_layers))
    return us


@pytest.mark.parametrize("target", [2.0, 2.55, 3.05, 4.0, 5.3])
def test_bpw_target_hit_and_role_order(target):
    us = _units()
    lv = al.allocate(us, al.bpw_budget(us, target))
    got = al.achieved_bpw(us, lv)
    assert target - 0.02 <= got <= target + 1e-9
    exp = [lv[u.key] for u in us if u.role == "routed_expert"]
    att = [lv[u.key] for u in us if u.role == "attn"]
    assert max(exp) <= min(att)  # experts never above attention


def test_default_role_gaps_are_the_optimum():
    # a budget equal to the role defaults reproduces them exactly (the role model's Lagrangian optimum)
    us = _units(4)
    budget = sum(u.numel * al.EXL3_ROLE_BITS[u.role] for u in us)
    lv = al.allocate(us, budget)
    assert all(lv[u.key] == al.EXL3_ROLE_BITS[u.role] for u in us)


def test_impossible_budget_and_fixed_units():
    us = _units(2)
    us[0].fixed = 8.0
    with pytest.raises(PlanError, match="too small"):
        al.allocate(us, al.bpw_budget(us, 1.2))
    lv = al.allocate(us, al.bpw_budget(us, 5.0))
    assert lv[us[0].key] == 8.0


def test_measured_curves_solver_is_optimal_on_small_knapsack():
    # non-convex curves: the greedy on the lower hull must match brute force at hull budgets
    levels = (2.0, 3.0, 4.0, 5.0)
    curves = {"a": (9.0, 4.0, 3.5, 0.5), "b": (5.0, 2.0, 1.0, 0.9), "c": (20.0, 6.0, 2.0, 1.5)}
    numel = {"a": 10, "b": 30, "c": 20}
    us = [al.Unit(k, "attn", numel[k], levels=levels, errors=curves[k]) for k in curves]
    for budget in (200, 230, 260, 300, 330, 400):
        lv = al.allocate(us, budget)
        cost = sum(lv[k] * numel[k] for k in curves)
        err = sum(curves[k][levels.index(lv[k])] for k in curves)
        assert cost <= budget
        best = min(sum(curves[k][i] for k, i in zip(curves, combo))
                   for combo in itertools.product(range(4), repeat=3)
                   if sum(levels[i] * numel[k] for k, i in zip(curves, combo)) <= budget)
        assert err <= best * 1.35 + 1e-9  # greedy on the hull: optimal up to one partial step


def test_parse_size():
    assert parse_size("108GB") == 108 * 10**9
    assert parse_size("100GiB") == 100 * 2**30
    assert parse_size("1.5TB") == 1_500_000_000_000
    assert parse_size("512MiB") == 512 * 2**20
    for bad in ("lots", "-3GB", "12XB"):
        with pytest.raises(InputError):
            parse_size(bad)
