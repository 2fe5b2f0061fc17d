"""GGUF planning from measured curves: the ladder type per tensor that minimises the summed predicted error
within the budget (curves from measurement/gguf_errors and measurement/gguf_kld; this module only consumes them)."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping, Sequence

from mixq.errors import PlanError
from mixq.formats.gguf_names import gguf_tensors
from mixq.planning import allocator as al
from mixq.planning import gguf_mix as gm
from mixq.planning.budget import budget_bits, target_label
from mixq.planning.gguf import BUDGET_ROLES, gguf_metadata_bytes, gguf_mix_context, gguf_plan, outside_bytes
from mixq.planning.gguf_rules import TypeRules
from mixq.planning.types import DEFAULT_MTP_BITS

MEASURED_ROLES = ("embed", "lm_head")  # budgeted by a measured plan on top of the planner's budget roles


def measured_units(ckpt, include_mtp: bool = True, ladder: str = gm.DEFAULT_LADDER) -> dict[str, tuple]:
    """The GGUF tensors a measured plan budgets -> (spec, ladder types): what the planner budgets (its budget
    roles, not pinned to Q8_0, not NextN) plus token_embd and output.weight (large levers; the role plan pins them)."""
    out = {}
    for s in gguf_tensors(ckpt, include_mtp=include_mtp):
        if s.policy != "quant" or s.mtp or not gm.allows_quantization(s.name, s.shape):
            continue
        if s.role in BUDGET_ROLES or s.role in MEASURED_ROLES:
            out[s.name] = (s, gm.ladder(int(s.shape[-1]), kind=ladder))
    return out


def unit_errors(curves: Mapping[str, Mapping[float, float]], name: str, types: Sequence[str]) -> tuple[float, ...]:
    """The measured error of GGUF tensor `name` at each of `types` (its ladder), from curves {unit: {bpw: error}}."""
    c = {round(float(b), 6): float(e) for b, e in curves.get(name, {}).items()}
    missing = [t for t in types if round(gm.type_bpw(t), 6) not in c]
    if name not in curves or missing:
        raise PlanError(f"--measure: no measured error for {name} at {missing[0] if missing else 'any type'} "
                        "(measure with the same --gguf-ladder)")
    return tuple(c[round(gm.type_bpw(t), 6)] for t in types)


def predicted(units: Sequence, levels: Mapping[str, float]) -> float:
    """The summed predicted error of `units` at `levels` (units without a curve, pinned ones, add none)."""
    return sum(u.errors[u.levels.index(levels[u.key])] for u in units if u.errors is not None)


def never_worse(units: Sequence, levels: Mapping[str, float], budget: float,
                default_bits: Mapping[str, float]) -> tuple[dict[str, float], bool]:
    """`levels` unless the role-model plan of the same units and budget predicts a smaller total measured error
    (the greedy solver is not exact): (levels to use, whether the role plan was taken)."""
    def total(lv: Mapping[str, float]) -> float:
        return predicted(units, lv)

    role = al.allocate([replace(u, errors=None) for u in units], budget, default_bits=default_bits)
    if total(role) < total(levels):
        return dict(role), True
    return dict(levels), False


def fill_remaining(units: Sequence, levels: dict[str, float], remaining: float) -> dict[str, float]:
    """Spend what the hull-greedy solver left: repeatedly take the single step (any unit, any higher level) with
    the largest error drop per budget bit that still fits, so a --size plan lands close to its budget."""
    lv = dict(levels)
    while True:
        best = None
        for u in units:
            if u.fixed is not None or u.errors is None:
                continue
            i = u.levels.index(lv[u.key])
            for j in range(i + 1, len(u.levels)):
                dc = u.cost_at(j) - u.cost_at(i)
                de = u.errors[i] - u.errors[j]
                if 0 < dc <= remaining and de > 0 and (best is None or de / dc > best[0]):
                    best = (de / dc, u, j, dc)
        if best is None:
            return lv
        _, u, j, dc = best
        lv[u.key] = u.levels[j]
        remaining -= dc


def plan_gguf_measured(ckpt, curves: Mapping[str, Mapping[float, float]], *, bpw: float | None = None,
                       size: int | None = None, ladder: str = gm.DEFAULT_LADDER, include_mtp: bool = True,
                       mtp_bits: float = DEFAULT_MTP_BITS, type_rules: TypeRules | None = None,
                       pinned: Mapping[str, str] | None = None):
    """A GGUF --bpw/--size plan from measured curves (``gguf_kld_curves``): every budgeted tensor plus token_embd
    and output.weight get the ladder type that minimises the summed predicted KLD within the budget (the
    allocator's hull-greedy solver, then a fill of what it left). Never worse than the role-model plan of the
    same tensors and budget under the same curves (``never_worse``; the report says which was taken);
    ``type_rules`` then retype single tensors, as convert does. ``pinned``: {GGUF name: type} that those budgeted
    tensors keep (their bytes still count against the budget; planning/pin.py). Returns a ``Plan``."""
    if (bpw is None) == (size is None):
        raise PlanError("a measured GGUF plan needs exactly one of --bpw, --size")
    specs = gguf_tensors(ckpt, include_mtp=include_mtp)
    budgeted = measured_units(ckpt, include_mtp, ladder)
    kv = gguf_metadata_bytes(ckpt, gguf_mix_context(ckpt, include_mtp).n_layer_all)
    types: dict[str, str] = {}
    units = []
    for s in specs:
        ne0 = int(s.shape[-1])
        if s.name in budgeted and pinned and s.name in pinned:
            t = pinned[s.name]
            types[s.name] = t
            units.append(al.Unit(key=s.name, role=s.role, numel=math.prod(s.shape), levels=(gm.type_bpw(t),),
                                 costs=(8 * gm.stored_bytes(t, s.shape),), fixed=gm.type_bpw(t), layer=s.layer,
                                 n_layers=ckpt.num_hidden_layers))
        elif s.name in budgeted:
            lad = budgeted[s.name][1]
            units.append(al.Unit(key=s.name, role=s.role, numel=math.prod(s.shape),
                                 levels=tuple(gm.type_bpw(t) for t in lad),
                                 costs=tuple(8 * gm.stored_bytes(t, s.shape) for t in lad),
                                 errors=unit_errors(curves, s.name, lad), layer=s.layer,
                                 n_layers=ckpt.num_hidden_layers))
        elif s.policy == "q8_floor" and gm.allows_quantization(s.name, s.shape):
            types[s.name] = gm.fallback("Q8_0", ne0)
        elif s.mtp and s.policy == "quant" and gm.allows_quantization(s.name, s.shape) \
                and s.role in BUDGET_ROLES + MEASURED_ROLES:
            types[s.name] = gm.fallback(gm.bits_to_type(mtp_bits), ne0)
        else:
            types[s.name] = "F32" if s.policy == "f32" or len(s.shape) < 2 else "BF16"
    what = target_label(bpw, size, digits=6)
    outside = 0 if size is None else outside_bytes(specs, [types.get(s.name, "") for s in specs],
                                                   [s.name in budgeted for s in specs], kv)
    budget = budget_bits(units, bpw=bpw, size=size, outside_bytes=outside, what=what)
    role_bits = {**{r: gm.type_bpw(t) for r, t in gm.GGUF_ROLE_TYPES.items()}, "embed": gm.type_bpw("Q4_K")}
    levels = al.allocate(units, budget, default_bits=role_bits, what=what)
    levels, role_taken = never_worse(units, levels, budget, role_bits)
    spent = sum(u.cost_at(u.levels.index(levels[u.key])) for u in units)
    levels = fill_remaining(units, levels, budget - spent)
    by_bpw = {s: {gm.type_bpw(t): t for t in budgeted[s][1]} for s in budgeted}
    for u in units:
        if u.errors is not None:
            types[u.key] = by_bpw[u.key][levels[u.key]]
    written = [types[s.name] for s in specs]
    if type_rules:
        written = type_rules.apply(specs, written)
    plan = gguf_plan(specs, written, [s.name in budgeted for s in specs], kv)
    plan.measured = {"predicted_kld": predicted(units, levels),
                     "role_plan_taken": role_taken}
    return plan
