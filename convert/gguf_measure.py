"""`plan --format gguf --measure`: every budgeted GGUF tensor's error at every candidate ggml type, measured.

One calibration walk (convert/gguf_hessians.py) gives each Linear's input Hessian; every budgeted tensor is encoded
in every type of its ladder (quant.gguf_mix.ladder: the types a --bpw/--size plan may give it), with the rounding
the conversion will use (`exact`: ggml's encoder with the imatrix or diag(H); `hessian`: quant/kquants_hessian),
and its layer-output error tr(ΔW·H·ΔWᵀ) is recorded. Routed experts: one unit per `*_exps` tensor (all experts of
the layer), the sum over experts with their routing-weighted Hessians. token_embd has no input Hessian and is
measured through the first layer (Σ_rows f_row·δ·M·δᵀ, f the calibration frequency of the token, M
convert/gguf_hessians.embedding_hessian). Units become comparable with each other only through the end-to-end
rescaling of eval/gguf_kld.py (one KLD measurement per unit). Result: {unit: {bits per weight of the type:
error}}, the curves format of `--measure-out` / `--measure FILE` (a ladder's types have distinct widths).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

from mixq.errors import InputError
from mixq.quant import gguf_mix as gm
from mixq.quant import kquants
from mixq.quant import kquants_hessian as kh
from mixq.quant.device import pick_device

DEFAULT_ROWS = 16
DEFAULT_SEQ_LEN = 256
REFERENCE_BPW = 3.5  # the end-to-end rescaling measures each unit at its ladder type nearest this width
MEASURED_ROLES = ("embed", "lm_head")  # budgeted by a measured plan on top of the planner's budget roles


@dataclass
class GGUFMeasurement:
    """Measured curves {unit: {bpw: error}}, each unit's reference type, and ggml's own (exact) error there."""
    curves: dict[str, dict[float, float]]
    reference: dict[str, str] = field(default_factory=dict)
    reference_error: dict[str, float] = field(default_factory=dict)


def measured_units(ckpt, include_mtp: bool = True, ladder: str = "k") -> dict[str, tuple]:
    """The GGUF tensors a measured plan budgets -> (spec, ladder types): what the planner budgets (its budget
    roles, not pinned to Q8_0, not NextN) plus token_embd and output.weight (large levers; the role plan pins them)."""
    from mixq.convert.planning import BUDGET_ROLES
    from mixq.formats.gguf_names import gguf_tensors

    out = {}
    for s in gguf_tensors(ckpt, include_mtp=include_mtp):
        if s.policy != "quant" or s.mtp or not gm.allows_quantization(s.name, s.shape):
            continue
        if s.role in BUDGET_ROLES or s.role in MEASURED_ROLES:
            out[s.name] = (s, gm.ladder(int(s.shape[-1]), kind=ladder))
    return out


def reference_type(types: Sequence[str]) -> str:
    """The ladder type whose width is nearest ``REFERENCE_BPW`` (the lower one on a tie)."""
    return min(types, key=lambda t: (abs(gm.type_bpw(t) - REFERENCE_BPW), gm.type_bpw(t)))


def _encode(w: torch.Tensor, qtype: str, h: torch.Tensor | None, importance: np.ndarray | None,
            rounding: str, dev) -> torch.Tensor:
    """Dequantized copy of w (rows, n) / (E, rows, n) encoded as qtype with the chosen rounding."""
    if rounding == "hessian" and h is not None and qtype in kh.SUPPORTED:
        from mixq.convert.gguf_rounding import DAMP, REFINE_PASSES

        b = kh.quantize_hessian(w, h, qtype, importance, damp=DAMP, refine=REFINE_PASSES, device=dev)
        return torch.from_numpy(kh.dequantize_blocks(b, qtype)).reshape(w.shape)
    if importance is None and qtype in kquants.REQUIRES_IMATRIX and h is not None:
        importance = torch.diagonal(h, dim1=-2, dim2=-1).clamp_min(0).numpy().copy()  # ggml refuses none
    if w.ndim == 3:
        b = np.stack([kquants.quantize(w[e].numpy(), qtype, None if importance is None else importance[e])
                      for e in range(w.shape[0])])
    else:
        b = kquants.quantize(w.numpy(), qtype, importance)
    return torch.from_numpy(kh.dequantize_blocks(b, qtype)).reshape(w.shape)


def _importance(imatrix: Mapping | None, name: str, shape) -> np.ndarray | None:
    """The conversion's importance for this tensor ((n,) or (E, n)): its --imatrix entry, or None."""
    if imatrix is None or imatrix.get(name) is None:
        return None
    im = np.asarray(imatrix[name], np.float32)
    return im.reshape(shape[0], shape[-1]) if len(shape) == 3 else im


def _linear_curve(spec, types, stage, fetch, imatrix, rounding, dev) -> tuple[dict[float, float], float] | None:
    """({bpw: Σ tr(ΔW·H·ΔWᵀ)}, ggml's own error at the reference type) of one budgeted Linear or expert stack;
    None without a Hessian."""
    errs = dict.fromkeys((gm.type_bpw(t) for t in types), 0.0)
    ref, ref_err = reference_type(types), 0.0
    if spec.transform == "stack":
        E, n = len(spec.hf_names), int(spec.shape[-1])
        step = max(1, (1 << 30) // (8 * n * n))
        for e0 in range(0, E, step):
            e1 = min(E, e0 + step)
            h = stage.experts(spec, e0, e1)
            if h is None:
                return None
            w = torch.stack([fetch(spec.hf_names[e]) for e in range(e0, e1)])
            im = _importance(imatrix, spec.name, (E, 0, n))
            im = None if im is None else im[e0:e1]
            for t in types:
                errs[gm.type_bpw(t)] += float(kh.layer_error(w, _encode(w, t, h, im, rounding, dev), h).sum())
            if rounding != "exact":
                ref_err += float(kh.layer_error(w, _encode(w, ref, h, im, "exact", dev), h).sum())
        return errs, (ref_err if rounding != "exact" else errs[gm.type_bpw(ref)])
    h = stage.get(spec)
    if h is None:
        return None
    w = fetch(spec.hf_names[0])
    im = _importance(imatrix, spec.name, spec.shape)
    for t in types:
        errs[gm.type_bpw(t)] = float(kh.layer_error(w, _encode(w, t, h, im, rounding, dev), h))
    if rounding == "exact":
        return errs, errs[gm.type_bpw(ref)]
    return errs, float(kh.layer_error(w, _encode(w, ref, h, im, "exact", dev), h))


def _embedding_curve(spec, types, fetch, stage, ckpt, ids: torch.Tensor, rounding: str, dev) -> tuple[dict, float]:
    """({bpw: Σ_rows f_row·δ_row·M·δ_rowᵀ}, exact error at the reference type) of token_embd: rows weighted by
    how often the calibration text uses the token (+1), M the first layer's embedding metric (else identity)."""
    from mixq.convert.gguf_hessians import embedding_hessian, token_frequency

    w = fetch(spec.hf_names[0])
    freq = token_frequency(ids, w.shape[0]) + 1.0
    m = embedding_hessian(stage, ckpt, w, freq)
    metric = m.double() if m is not None else torch.eye(w.shape[1], dtype=torch.float64)

    def err(t: str, how: str) -> float:
        d = _encode(w, t, m, None, how, dev).double() - w.double()
        return float((((d @ metric) * d).sum(1) * freq).sum())

    ref = reference_type(types)
    return {gm.type_bpw(t): err(t, rounding) for t in types}, err(ref, "exact")


def measure_gguf_errors(ckpt, calibration: Sequence[str] | None = None, *, ladder: str = "k",
                        rounding: str = "exact", imatrix: Mapping[str, np.ndarray] | None = None,
                        rows: int | None = None, seq_len: int | None = None, include_mtp: bool = True,
                        only: Sequence[str] | None = None, device: str | None = None,
                        progress: bool = True) -> GGUFMeasurement:
    """Measured error curves {GGUF tensor: {bpw: error}} of every budgeted tensor (module docstring).

    `rounding`: "exact" or "hessian" (as the conversion will encode); `imatrix`: GGUF name -> importance (the
    --imatrix the conversion will use; default: ggml's reference path, diag(H) for the types that need one).
    Errors of different units are not comparable until rescaled end to end (eval/gguf_kld.py). `only`: measure
    just these GGUF tensors (default: every budgeted one)."""
    from tqdm.auto import tqdm

    from mixq.runtime.calibration import calibration_rows, load_tokenizer
    from mixq.convert.gguf_hessians import layer_hessians
    from mixq.convert.options import check_rounding

    rounding = check_rounding(rounding)
    units = measured_units(ckpt, include_mtp, ladder)
    if only is not None:
        unknown = sorted(set(only) - set(units))
        if unknown:
            raise InputError(f"--measure: {unknown[0]} is not a budgeted GGUF tensor of {ckpt.path}")
        units = {n: units[n] for n in only}
    if not units:
        raise InputError(f"{ckpt.path}: no budgeted GGUF tensors to measure")
    dev = pick_device(device)
    ids = calibration_rows(load_tokenizer(ckpt.path), calibration, rows=rows or DEFAULT_ROWS,
                           seq_len=seq_len or DEFAULT_SEQ_LEN, vocab_size=int(ckpt.text_config["vocab_size"]))
    fetch = lambda n: ckpt.get(n, dtype=torch.float32)  # noqa: E731
    by_layer: dict[int | None, list[str]] = {}
    for name, (spec, _) in units.items():
        if spec.role != "embed":
            by_layer.setdefault(spec.layer, []).append(name)
    res = GGUFMeasurement({})
    curves = res.curves
    bar = tqdm(total=sum(math.prod(s.shape) * len(t) for s, t in units.values()), desc="measure", unit="w",
               unit_scale=True, disable=not progress)
    embed = [n for n, (s, _) in units.items() if s.role == "embed"]
    for stage in layer_hessians(ckpt, ids, device=dev):
        for name in embed:  # the first stage: its Linears read the embedding
            spec, types = units[name]
            curves[name], res.reference_error[name] = _embedding_curve(spec, types, fetch, stage, ckpt, ids,
                                                                      rounding, dev)
            res.reference[name] = reference_type(types)
            bar.update(math.prod(spec.shape) * len(types))
        embed = []
        for name in by_layer.get(stage.layer, []):
            spec, types = units[name]
            c = _linear_curve(spec, types, stage, fetch, imatrix, rounding, dev)
            if c is None:
                raise InputError(f"{name}: the calibration forward never forms this tensor's input; cannot measure")
            curves[name], res.reference_error[name] = c
            res.reference[name] = reference_type(types)
            bar.update(math.prod(spec.shape) * len(types))
    bar.close()
    missing = sorted(set(units) - set(curves))
    if missing:
        raise InputError(f"--measure: calibration did not reach {missing[0]}")
    return res


# --- planning with measured curves (convert/planning.py calls these for GGUF --measure) -------------------------
def unit_errors(curves: Mapping[str, Mapping[float, float]], name: str, types: Sequence[str]) -> tuple[float, ...]:
    """The measured error of GGUF tensor `name` at each of `types` (its ladder), from curves {unit: {bpw: error}}."""
    from mixq.errors import PlanError

    c = {round(float(b), 6): float(e) for b, e in curves.get(name, {}).items()}
    missing = [t for t in types if round(gm.type_bpw(t), 6) not in c]
    if name not in curves or missing:
        raise PlanError(f"--measure: no measured error for {name} at {missing[0] if missing else 'any type'} "
                        "(measure with the same --gguf-ladder)")
    return tuple(c[round(gm.type_bpw(t), 6)] for t in types)


def never_worse(units: Sequence, levels: Mapping[str, float], budget: float,
                default_bits: Mapping[str, float]) -> tuple[dict[str, float], bool]:
    """`levels` unless the role-model plan of the same units and budget predicts a smaller total measured error
    (the greedy solver is not exact): (levels to use, whether the role plan was taken)."""
    from dataclasses import replace

    from mixq.quant import allocator as al

    def total(lv: Mapping[str, float]) -> float:
        return sum(u.errors[u.levels.index(lv[u.key])] for u in units if u.errors is not None)

    role = al.allocate([replace(u, errors=None) for u in units], budget, default_bits=default_bits)
    if total(role) < total(levels):
        return dict(role), True
    return dict(levels), False


def _fill(units: Sequence, levels: dict[str, float], remaining: float) -> dict[str, float]:
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
                       size: int | None = None, ladder: str = "k", include_mtp: bool = True, mtp_bits: float = 4):
    """A GGUF --bpw/--size plan from measured curves (``gguf_kld_curves``): every budgeted tensor plus token_embd
    and output.weight get the ladder type that minimises the summed predicted KLD within the budget (the
    allocator's hull-greedy solver, then a fill of what it left). Never worse than the role-model plan of the
    same tensors and budget under the same curves (``never_worse``; the report says which was taken).
    Returns a ``planning.Plan``."""
    from mixq.convert.planning import BUDGET_ROLES, Plan, PlannedTensor, gguf_mix_context, gguf_metadata_bytes, role_summary
    from mixq.errors import PlanError
    from mixq.formats.gguf_names import gguf_tensors
    from mixq.quant import allocator as al

    if (bpw is None) == (size is None):
        raise PlanError("a measured GGUF plan needs exactly one of --bpw, --size")
    specs = gguf_tensors(ckpt, include_mtp=include_mtp)
    budgeted = measured_units(ckpt, include_mtp, ladder)
    kv = gguf_metadata_bytes(ckpt, gguf_mix_context(ckpt, include_mtp).n_layer_all)
    types: dict[str, str] = {}
    units = []
    for s in specs:
        ne0 = int(s.shape[-1])
        if s.name in budgeted:
            lad = budgeted[s.name][1]
            units.append(al.Unit(key=s.name, role=s.role, numel=math.prod(s.shape),
                                 levels=tuple(gm.type_bpw(t) for t in lad),
                                 costs=tuple(8 * gm._pad(gm.tensor_nbytes(t, s.shape)) for t in lad),
                                 errors=unit_errors(curves, s.name, lad), layer=s.layer,
                                 n_layers=ckpt.num_hidden_layers))
        elif s.policy == "q8_floor" and gm.allows_quantization(s.name, s.shape):
            types[s.name] = gm.fallback("Q8_0", ne0)
        elif s.mtp and s.policy == "quant" and gm.allows_quantization(s.name, s.shape) \
                and s.role in BUDGET_ROLES + MEASURED_ROLES:
            types[s.name] = gm.fallback(gm.bits_to_type(mtp_bits), ne0)
        else:
            types[s.name] = "F32" if s.policy == "f32" or len(s.shape) < 2 else "BF16"
    if bpw is not None:
        budget = al.bpw_budget(units, bpw)
        what = f"--bpw {bpw}"
    else:
        fixed = sum(gm._pad(gm.tensor_nbytes(t, next(s.shape for s in specs if s.name == n)))
                    for n, t in types.items())
        header = gm._pad(24 + kv + sum(gm.tensor_info_bytes(s.name, len(s.shape)) for s in specs))
        budget = (size - fixed - header) * 8
        what = f"--size {size / 1e9:.6f} GB"
        if budget <= 0:
            raise PlanError(f"{what}: the fixed-type tensors alone take {(fixed + header) / 1e9:.6f} GB")
    role_bits = {**{r: gm.type_bpw(t) for r, t in gm.GGUF_ROLE_TYPES.items()}, "embed": gm.type_bpw("Q4_K")}
    levels = al.allocate(units, budget, default_bits=role_bits, what=what)
    levels, role_taken = never_worse(units, levels, budget, role_bits)
    spent = sum(u.cost_at(u.levels.index(levels[u.key])) for u in units)
    levels = _fill(units, levels, budget - spent)
    by_bpw = {s: {gm.type_bpw(t): t for t in budgeted[s][1]} for s in budgeted}
    for u in units:
        types[u.key] = by_bpw[u.key][levels[u.key]]
    tensors = [PlannedTensor(s.name, s.role, list(s.hf_names), tuple(s.shape), None, types[s.name],
                             gm.tensor_nbytes(types[s.name], s.shape)) for s in specs]
    total, _ = gm.gguf_file_bytes([(t.name, t.shape, t.type) for t in tensors], kv)
    bud = [t for t in tensors if t.name in budgeted]
    plan = Plan("gguf", total, sum(t.bytes * 8 for t in bud) / max(1, sum(math.prod(t.shape) for t in bud)),
                tensors, role_summary(tensors))
    plan.measured = {"predicted_kld": sum(u.errors[u.levels.index(levels[u.key])] for u in units),
                     "role_plan_taken": role_taken}
    return plan
