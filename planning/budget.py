"""The one budget rule of every planner: a ``--bpw`` or ``--size`` target as bits for the allocator to spend."""
from __future__ import annotations

from typing import Sequence

from mixq.errors import PlanError
from mixq.planning.allocator import Unit, bpw_budget


def budget_bits(units: Sequence[Unit], *, bpw: float | None, size: int | None, outside_bytes: int,
                what: str) -> float:
    """Bits the budgeted ``units`` may take: ``bpw`` over their weights, or ``size`` bytes less what lies outside
    the budget (``outside_bytes``: fixed-precision tensors, headers, per-tensor overhead). A size that the fixed
    part alone fills is a PlanError naming ``what`` (the target as the user gave it)."""
    if bpw is not None:
        return bpw_budget(units, bpw)
    budget = (size - outside_bytes) * 8
    if budget <= 0:
        raise PlanError(f"{what}: the fixed-type tensors alone take {outside_bytes / 1e9:.3f} GB (headers included)")
    return budget


def target_label(bpw: float | None, size: int | None, *, digits: int = 3) -> str:
    """The target as the user gave it, for messages: ``--bpw 3.05`` or ``--size 108.000 GB``."""
    return f"--bpw {bpw}" if bpw is not None else f"--size {size / 1e9:.{digits}f} GB"
