"""The human view of a plan: one row per tensor pattern, the per-role summary and the one bpw figure."""
from __future__ import annotations

import re

from mixq.planning.types import Plan, numel


_NUM = re.compile(r"(?<=\.)\d+(?=\.)")


def collapse(name: str) -> str:
    """Layer and expert numbers -> ``*`` (one row per tensor pattern in ``mixq plan``'s table)."""
    return _NUM.sub("*", name)


def pattern_table(plan: Plan) -> list[dict]:
    """Rows per collapsed name: role, count, bits/type histogram, params, bytes (the per-tensor view of
    ``mixq plan``)."""
    rows: dict[str, dict] = {}
    for t in plan.tensors:
        k = collapse(t.name)
        r = rows.setdefault(k, {"pattern": k, "role": t.role, "count": 0, "levels": {}, "params": 0, "bytes": 0})
        r["count"] += 1
        lv = (f"{t.bits:g}" if t.bits is not None else t.type) if plan.format == "exl3" else t.type
        r["levels"][lv] = r["levels"].get(lv, 0) + 1
        r["params"] += numel(t.shape)
        r["bytes"] += t.bytes
    return list(rows.values())


def format_plan(plan: Plan, *, per_tensor: bool = True) -> str:
    """The human view of ``mixq plan``: with ``per_tensor`` one row per tensor pattern (layer and expert numbers
    collapsed) and its bits/type mix, then always the per-role summary, the file size and the one bpw figure."""
    lines = []
    if per_tensor:
        lines.append(f"{'tensor (layers/experts collapsed)':<64} {'role':<14} {'n':>6} {'bits/type':<22} {'GB':>9}")
        for r in pattern_table(plan):
            lv = " ".join(f"{k}x{v}" if len(r["levels"]) > 1 else k for k, v in sorted(r["levels"].items()))
            lines.append(f"{r['pattern'][:64]:<64} {r['role']:<14} {r['count']:>6} {lv[:22]:<22} "
                         f"{r['bytes'] / 1e9:>9.4f}")
        lines.append("")
    lines.append(f"{'role':<14} {'tensors':>8} {'params':>16} {'bytes':>16} {'GB':>9} {'bits/param':>10}")
    for role, r in plan.roles.items():
        lines.append(f"{role:<14} {r['tensors']:>8} {r['params']:>16,} {r['bytes']:>16,} {r['bytes'] / 1e9:>9.3f} "
                     f"{r['bpw']:>10.3f}")
    lines.append(f"{'total':<14} {len(plan.tensors):>8} {plan.params:>16,} {plan.total_bytes:>16,} "
                 f"{plan.total_bytes / 1e9:>9.3f}")
    lines.append("")
    lines.extend(plan_totals(plan))
    return "\n".join(lines)


def plan_totals(plan: Plan) -> list[str]:
    """The closing lines of ``mixq plan``: file size, the one bpw figure and what ``--bpw`` counted."""
    conv = ("exllamav3's bits: the budgeted Linears" if plan.format == "exl3"
            else "bits per weight of the budgeted tensors")
    params = plan.ref_params or plan.params
    gb, gib = plan.total_bytes / 1e9, plan.total_bytes / 2**30
    return [f"{plan.format} file  {gb:.3f} GB ({gib:.3f} GiB), headers included",
            f"bpw        {plan.file_bpw:.3f} = file bytes x 8 / {params:,} model parameters "
            "(the figure convert and eval report)",
            f"--bpw      counts {plan.bpw:.3f} ({conv})"]
