"""Bit allocation: pure arithmetic that turns a set of budget units into per-unit bitrates.

Nothing here reads files. The planner (``mixq.planning.planner``) builds ``Unit`` objects from the architecture
table and calls ``allocate``; this module owns the EXL3 byte accounting, the exllamav3 rate ladder and the solver.

Error model (see docs/planning.md). Without measurements the solver assumes the distortion of a tensor at
``b`` bits per weight is ``numel * 4**(d_role - b)``: the rate–distortion slope of a good quantizer
(MSE ∝ 2^(-2b)) weighted so that the role defaults ``d_role`` (experts 4, attention 6, ...) are exactly the
continuous optimum of the Lagrangian. Scaling the budget then shifts every role by the same number of bits,
which keeps the role order (experts never above attention), and the discrete leftover goes to the steps
with the largest error reduction per bit. With ``--measure`` the per-unit error curves are given instead and the
same solver (greedy on the lower convex hull, i.e. the Lagrangian relaxation of the knapsack) minimises their
sum for the byte budget.

EXL3 facts (../shared/reference/exl3-format.md): §1.4 per-Linear tensors (trellis int16 (k/16, n/16, 16K),
suh fp16 (k,), svh fp16 (n,), mul1/mcg int32 scalar marker), §1.6 padding of both dims to multiples of 128,
§4.1 rates 1..8 plus 1.5/2.5/3.5 with MUL1, ``bits`` = Σ K·padded numel / Σ padded numel over the budgeted
(``qbits_key == "bits"``) Linears.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from mixq.errors import InputError, PlanError
from mixq.formats.exl3_layout import PAD, RATES, TILE, pad_up, trellis_words

EXL3_RATES: tuple[float, ...] = RATES
EXL3_INT_RATES: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0)

# role defaults for EXL3 (head and NextN have their own keys; vision stays native unless asked)
EXL3_ROLE_BITS: dict[str, float] = {
    "routed_expert": 4.0, "attn": 6.0, "shared_expert": 6.0, "dense_mlp": 5.0, "lm_head": 6.0,
}
# tie-break when two steps buy the same error per bit (exllamav3 allocation.py ~L52-209 ranks attention first)
ROLE_PRIORITY: dict[str, int] = {"attn": 4, "shared_expert": 3, "lm_head": 3, "dense_mlp": 2, "routed_expert": 1}


def pad128(n: int) -> int:
    """Round up to a multiple of 128 (exllamav3 ``Linear(pad_to=128)``, exl3-format.md §1.6)."""
    return pad_up(n, PAD)


def exl3_padded_numel(out_features: int, in_features: int) -> int:
    """k·n of the padded Linear: the weight exllamav3 uses in its ``bits`` average (§4.1)."""
    return pad128(in_features) * pad128(out_features)


def exl3_trellis_bytes(out_features: int, in_features: int, bits: float) -> int:
    """Bytes of ``<key>.trellis``: int16 (k/16, n/16, 16·K); half rates use 16·⌊K⌋+8 = 16·K words (§1.4)."""
    if float(bits) not in EXL3_RATES:
        raise PlanError(f"EXL3 bitrate {bits} is not one of {EXL3_RATES}")
    return (pad128(in_features) // TILE) * (pad128(out_features) // TILE) * trellis_words(bits) * 2


def exl3_linear_overhead(out_features: int, in_features: int, *, bias: bool = False, marker: bool = True) -> int:
    """Bytes of a quantized Linear besides the trellis: suh fp16 (k,), svh fp16 (n,), codebook marker int32
    scalar (mul1/mcg; 3INST has none), optional fp16 bias (n,) (§1.4)."""
    k, n = pad128(in_features), pad128(out_features)
    return 2 * k + 2 * n + (4 if marker else 0) + (2 * n if bias else 0)


def exl3_linear_bytes(out_features: int, in_features: int, bits: float, *, bias: bool = False,
                      marker: bool = True) -> int:
    """All tensor bytes of one EXL3 Linear at ``bits`` (no safetensors header)."""
    return exl3_trellis_bytes(out_features, in_features, bits) + exl3_linear_overhead(
        out_features, in_features, bias=bias, marker=marker)


def rate_floor(b: float, half_steps: bool = True) -> float:
    """exllamav3's ``rate_floor``: ⌊2b⌋/2 below 4 with half steps, else ⌊b⌋, clamped to [1, 8] (§4.1)."""
    r = math.floor(2 * b) / 2 if (half_steps and b < 4) else math.floor(b)
    return float(min(8, max(1, r)))


@dataclass
class Unit:
    """One thing the solver gives a level to: a Linear, or a group of Linears that must share a rate
    (exllamav3 gives all routed experts of a layer one rate: qgroup ``block_gud``, §4.1).

    ``levels`` are the candidate rates (bits per weight, ascending); ``costs`` the budget bits each level
    costs (default ``numel * level``); ``errors`` the predicted error per level (default: the role model);
    ``fixed`` pins the unit to one level (overrides, head, NextN) - its cost still counts."""

    key: str
    role: str
    numel: int
    levels: tuple[float, ...] = EXL3_RATES
    costs: tuple[float, ...] | None = None
    errors: tuple[float, ...] | None = None
    fixed: float | None = None
    layer: int | None = None
    n_layers: int | None = None
    members: list[str] = field(default_factory=list)

    def cost_at(self, i: int) -> float:
        return self.costs[i] if self.costs is not None else self.numel * self.levels[i]


def role_errors(unit: Unit, default_bits: Mapping[str, float]) -> tuple[float, ...]:
    """The no-measurement error curve ``numel · 4^(d_role − b)`` (module docstring)."""
    d = default_bits.get(unit.role, 4.0)
    return tuple(unit.numel * 4.0 ** (d - b) for b in unit.levels)


def _lower_hull_step(costs: Sequence[float], errs: Sequence[float], i: int) -> tuple[int, float] | None:
    """From level i, the next level j on the lower convex hull of (cost, error): max error drop per cost."""
    best, best_r = None, -1.0
    for j in range(i + 1, len(costs)):
        dc = costs[j] - costs[i]
        de = errs[i] - errs[j]
        if dc <= 0:
            if de >= 0:  # free improvement
                return j, math.inf
            continue
        r = de / dc
        if r > best_r + 1e-15 * abs(best_r):
            best, best_r = j, r
    return None if best is None else (best, best_r)


def _end_distance(u: Unit) -> int:
    if u.layer is None or not u.n_layers:
        return 0
    return min(u.layer, u.n_layers - 1 - u.layer)


def allocate(units: Sequence[Unit], budget: float, *, default_bits: Mapping[str, float] = EXL3_ROLE_BITS,
             what: str = "budget") -> dict[str, float]:
    """Give every unit a level so that Σ cost ≤ ``budget`` and the predicted error is minimal.

    Greedy over the lower convex hull of each unit's (cost, error) curve, best error reduction per budget bit
    first; ties go to the higher-priority role, then to layers nearer either end of the stack (as exllamav3
    orders its groups). A step that no longer fits is dropped and smaller steps keep filling the budget.
    Raises PlanError when even the lowest levels (plus the fixed units) exceed the budget."""
    level_idx: dict[str, int] = {}
    spent = 0.0
    free: list[Unit] = []
    for u in units:
        if u.fixed is not None:
            if u.fixed not in u.levels:
                raise PlanError(f"{u.key}: {u.fixed} is not an allowed level {u.levels}")
            i = u.levels.index(u.fixed)
            level_idx[u.key] = i
            spent += u.cost_at(i)
        else:
            level_idx[u.key] = 0
            spent += u.cost_at(0)
            free.append(u)
    if spent > budget:
        raise PlanError(f"{what} too small: the lowest possible plan needs {spent / budget:.3f}x the budget "
                        f"({_fmt_bits(spent)} > {_fmt_bits(budget)})")
    curves: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {}
    heap: list[tuple] = []
    for n, u in enumerate(free):
        costs = tuple(u.cost_at(i) for i in range(len(u.levels)))
        errs = u.errors if u.errors is not None else role_errors(u, default_bits)
        if len(errs) != len(costs):
            raise PlanError(f"{u.key}: {len(errs)} error values for {len(costs)} levels")
        curves[u.key] = (costs, errs)
        step = _lower_hull_step(costs, errs, 0)
        if step:
            heapq.heappush(heap, (-step[1], -ROLE_PRIORITY.get(u.role, 0), _end_distance(u), u.layer or 0, n,
                                  step[0], u))
    remaining = budget - spent
    while heap:
        negr, pr, dist, layer, n, j, u = heapq.heappop(heap)
        costs, errs = curves[u.key]
        i = level_idx[u.key]
        dc = costs[j] - costs[i]
        if dc > remaining:
            continue  # this unit is done: its next hull step does not fit
        remaining -= dc
        level_idx[u.key] = j
        step = _lower_hull_step(costs, errs, j)
        if step:
            heapq.heappush(heap, (-step[1], pr, dist, layer, n, step[0], u))
    return {u.key: u.levels[level_idx[u.key]] for u in units}


def _fmt_bits(b: float) -> str:
    return f"{b / 8 / 1e9:.3f} GB" if b >= 8e9 else f"{b / 8:,.0f} bytes"


def achieved_bpw(units: Sequence[Unit], levels: Mapping[str, float]) -> float:
    """Σ level·numel / Σ numel (exllamav3's ``bits`` convention when numel is the padded k·n)."""
    num = sum(levels[u.key] * u.numel for u in units)
    den = sum(u.numel for u in units)
    return num / den if den else 0.0


def bpw_budget(units: Sequence[Unit], target_bpw: float) -> float:
    """The budget (in cost units = bits) that ``--bpw target`` allows for these units: ⌊target·Σ numel⌋ (§4.1)."""
    if not 1.0 <= target_bpw <= 16.0:
        raise PlanError(f"--bpw {target_bpw}: must be between 1 and 16")
    return math.floor(target_bpw * sum(u.numel for u in units))
