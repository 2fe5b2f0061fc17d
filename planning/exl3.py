"""The EXL3 planner: trellis bits per allocator unit (role model or measured curves) to a --bpw or --size target."""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from mixq.errors import PlanError
from mixq.formats.exl3_layout import shard_count
from mixq.formats.exl3_names import storage_dtype
from mixq.planning import allocator as al
from mixq.planning.budget import budget_bits, target_label
from mixq.planning.overrides import check_unused, exl3_override_bits, first_override
from mixq.planning.types import Plan, PlannedTensor, numel, role_summary

STORAGE_LABEL = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}  # the plan JSON's "storage" values


def stored_tensor(ckpt, name: str, policy: str) -> tuple[str, int]:
    """(storage label, bytes) of an unquantized tensor, stored as formats/exl3_names stores it."""
    dt = storage_dtype(policy, ckpt.source_dtype(name), name)
    return STORAGE_LABEL[dt], getattr(torch, dt).itemsize * numel(ckpt.shape(name))


def safetensors_header_bytes(names_shapes: Iterable[tuple[str, int]], n_shards: int) -> int:
    """safetensors header estimate: 8-byte length + per tensor ``"name":{"dtype":"I16","shape":[..],
    "data_offsets":[a,b]},`` (measured ~69 bytes besides the name on the fixtures) (exl3-format.md §1.1)."""
    per = sum(len(n) + 53 + 8 * nd for n, nd in names_shapes)
    return per + n_shards * 10


def allocator_unit(info, name: str) -> str:
    """The allocator unit of a trellis tensor (the table's group: a layer's routed experts share one rate, a fused
    EXL3 Linear is one unit, anything else is its own)."""
    return info.exl3_group


def plan_exl3(ckpt, *, bpw, size, overrides, head_bits, mtp_bits, vision_bits, include_mtp, measure,
              pinned: Mapping[str, float] | None = None) -> Plan:
    """Every tensor of ``ckpt`` as EXL3 stores it: trellis bits per allocator unit to the target, the rest at
    its storage dtype (``plan_model`` validates the arguments). ``pinned``: {HF name: bits} that a unit made
    only of such tensors keeps (its cost still counts; planning/pin.py)."""
    nl = ckpt.num_hidden_layers
    fixed: dict[str, tuple[float | None, str, int]] = {}  # name -> (bits, storage, bytes) of non-budgeted tensors
    members: dict[str, list[str]] = {}
    unit_info: dict[str, tuple[str, int | None, float | None]] = {}
    linears: dict[str, tuple[int, int]] = {}
    order = []
    for name in ckpt.names():
        info = ckpt.info(name)
        if info.mtp and not include_mtp:
            continue
        order.append(name)
        shape = tuple(ckpt.shape(name))
        ov = first_override(overrides, info.role, [name]) if info.exl3 == "trellis" else None
        if info.exl3 != "trellis":
            dt, nb = stored_tensor(ckpt, name, info.exl3)
            fixed[name] = (None, dt, nb)
            continue
        out_f, in_f = shape[0], numel(shape[1:])
        linears[name] = (out_f, in_f)
        key = info.exl3_bits_key
        bits = exl3_override_bits(ov) if ov else None
        if key != "bits" or bits == 16:
            if bits is None:
                bits = {"head_bits": head_bits, "mtp_bits": mtp_bits, "vision_bits": vision_bits}[key]
            if bits is None:  # vision tower kept at source precision
                dt, nb = stored_tensor(ckpt, name, "native")
                fixed[name] = (None, dt, nb)
            elif bits >= 16:
                fixed[name] = (None, "fp16", 2 * al.exl3_padded_numel(out_f, in_f))
            else:
                if bits not in al.EXL3_RATES:
                    raise PlanError(f"{key.replace('_', '-')} {bits}: EXL3 bits must be one of {al.EXL3_RATES} or 16")
                fixed[name] = (bits, "trellis", al.exl3_linear_bytes(out_f, in_f, bits))
            continue
        g = allocator_unit(info, name) + (f"@{bits:g}" if bits is not None else "")
        members.setdefault(g, []).append(name)
        unit_info.setdefault(g, (info.role, info.layer, bits))
    check_unused(overrides)
    units = []
    for g, names in members.items():
        role, layer, bits = unit_info[g]
        if bits is None and pinned and all(n in pinned for n in names):
            bits = pinned[names[0]]
        units.append(al.Unit(key=g, role=role, numel=sum(al.exl3_padded_numel(*linears[n]) for n in names),
                             fixed=bits, layer=layer, n_layers=nl, members=names))
    if measure is not None:
        apply_curves(units, measure)
    overhead = {}
    for g, names in members.items():
        for j, n in enumerate(names):
            o, i = linears[n]
            fused = g.split("@")[0].endswith("qkv_proj")
            overhead[n] = 2 * al.pad128(o) + ((2 * al.pad128(i) + 4) if (j == 0 or not fused) else 0)
    # stored tensors for the header estimate: trellis/suh/svh/marker per quantized Linear, one per other tensor
    n_stored = [(n, 2) for n in linears for _ in range(4)] + [(n, 2) for n in fixed if n not in linears]
    fixed_bytes = sum(b for _, _, b in fixed.values()) + sum(overhead.values())
    if bpw is not None or size is not None:
        outside = 0 if size is None else fixed_bytes + safetensors_header_bytes(n_stored, shard_count(size))
        what = target_label(bpw, size)
        levels = al.allocate(units, budget_bits(units, bpw=bpw, size=size, outside_bytes=outside, what=what),
                             what=what)
    else:
        levels = {u.key: (u.fixed if u.fixed is not None else al.EXL3_ROLE_BITS.get(u.role, 4.0)) for u in units}
    tensors = []
    level_of = {n: levels[g] for g, names in members.items() for n in names}
    for name in order:
        info = ckpt.info(name)
        shape = tuple(ckpt.shape(name))
        if name in level_of:
            o, i = linears[name]
            b = level_of[name]
            tensors.append(PlannedTensor(name, info.role, [name], shape, b, "trellis",
                                         al.exl3_trellis_bytes(o, i, b) + overhead[name]))
        else:
            b, dt, nb = fixed[name]
            tensors.append(PlannedTensor(name, info.role, [name], shape, b, dt, nb))
    data = sum(t.bytes for t in tensors)
    shards = shard_count(data)
    total = data + safetensors_header_bytes(n_stored, shards)
    return Plan("exl3", total, al.achieved_bpw(units, levels), tensors, role_summary(tensors))


def apply_curves(units: Sequence[al.Unit], measure: Mapping[str, Mapping[float, float]]) -> None:
    """Sensitivity mode: replace the role model by measured error curves {unit key: {bits: error}}."""
    missing = [u.key for u in units if u.fixed is None and u.key not in measure]
    if missing:
        raise PlanError(f"--measure: no error curve for {len(missing)} budgeted units, e.g. {missing[0]!r}")
    for u in units:
        if u.fixed is not None:
            continue
        curve = {float(b): float(e) for b, e in measure[u.key].items() if float(b) in al.EXL3_RATES}
        if len(curve) < 1:
            raise PlanError(f"--measure: the curve of {u.key!r} has no valid EXL3 bitrate")
        u.levels = tuple(sorted(curve))
        u.errors = tuple(curve[b] for b in u.levels)
