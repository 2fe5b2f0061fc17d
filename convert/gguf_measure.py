"""`plan --format gguf --measure`: every budgeted GGUF tensor's error at every candidate ggml type, measured.

One calibration walk (convert/gguf_hessians.py) gives each Linear's input Hessian; every budgeted tensor is encoded
in every type of its ladder (quant.gguf_mix.ladder: the types a --bpw/--size plan may give it), with the rounding
the conversion will use (`exact`: ggml's encoder with the imatrix or diag(H); `hessian`: quant/kquants_hessian),
and its layer-output error tr(ΔW·H·ΔWᵀ) is recorded. Routed experts: one unit per `*_exps` tensor (all experts of
the layer), the sum over experts with their routing-weighted Hessians. Two units have no input Hessian and are
measured in weight space: token_embd (Σ_rows f_row·|Δrow|², f the calibration frequency of the token, +1) and,
like every unit, they become comparable with the others only through the end-to-end rescaling of
eval/gguf_kld.py (one KLD measurement per unit). Result: {unit: {bits per weight of the type: error}} — the curves
format of `--measure-out` / `--measure FILE` (the GGUF ladder's types have distinct bits per weight).
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
EMBED = "token_embd.weight"
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
    from mixq.convert.planning import _BUDGET_ROLES
    from mixq.formats.gguf_names import gguf_tensors

    out = {}
    for s in gguf_tensors(ckpt, include_mtp=include_mtp):
        if s.policy != "quant" or s.mtp or not gm.allows_quantization(s.name, s.shape):
            continue
        if s.role in _BUDGET_ROLES or s.role in MEASURED_ROLES:
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


def _embedding_curve(spec, types, fetch, ids: torch.Tensor) -> dict[float, float]:
    """{bpw: Σ_rows f_row·|Δrow|²}: rows weighted by how often the calibration text uses the token (+1)."""
    w = fetch(spec.hf_names[0])
    freq = torch.bincount(ids.reshape(-1), minlength=w.shape[0])[:w.shape[0]].double() + 1.0
    out = {}
    for t in types:
        d = _encode(w, t, None, None, "exact", "cpu").double() - w.double()
        out[gm.type_bpw(t)] = float((d.square().sum(1) * freq).sum())
    return out


def measure_gguf_errors(ckpt, calibration: Sequence[str] | None = None, *, ladder: str = "k",
                        rounding: str = "exact", imatrix: Mapping[str, np.ndarray] | None = None,
                        rows: int | None = None, seq_len: int | None = None, include_mtp: bool = True,
                        device: str | None = None, progress: bool = True) -> GGUFMeasurement:
    """Measured error curves {GGUF tensor: {bpw: error}} of every budgeted tensor (module docstring).

    `rounding`: "exact" or "hessian" (as the conversion will encode); `imatrix`: GGUF name -> importance (the
    --imatrix the conversion will use; default diag(H)). Errors of different units are not comparable until
    rescaled end to end (eval/gguf_kld.py)."""
    from tqdm.auto import tqdm

    from mixq.convert.calibration import calibration_rows, load_tokenizer
    from mixq.convert.gguf_hessians import layer_hessians
    from mixq.convert.gguf_rounding import check_rounding

    rounding = check_rounding(rounding)
    units = measured_units(ckpt, include_mtp, ladder)
    if not units:
        raise InputError(f"{ckpt.path}: no budgeted GGUF tensors to measure")
    dev = pick_device(device)
    ids = calibration_rows(load_tokenizer(ckpt.path), calibration, rows=rows or DEFAULT_ROWS,
                           seq_len=seq_len or DEFAULT_SEQ_LEN, vocab_size=int(ckpt.text_config["vocab_size"]))
    fetch = lambda n: ckpt.get(n, dtype=torch.float32)  # noqa: E731
    by_layer: dict[int | None, list[str]] = {}
    for name, (spec, _) in units.items():
        if name != EMBED:
            by_layer.setdefault(spec.layer, []).append(name)
    res = GGUFMeasurement({})
    curves = res.curves
    bar = tqdm(total=sum(math.prod(s.shape) * len(t) for s, t in units.values()), desc="measure", unit="w",
               unit_scale=True, disable=not progress)
    if EMBED in units:
        spec, types = units[EMBED]
        curves[EMBED] = _embedding_curve(spec, types, fetch, ids)
        res.reference[EMBED] = reference_type(types)
        res.reference_error[EMBED] = curves[EMBED][gm.type_bpw(res.reference[EMBED])]
        bar.update(math.prod(spec.shape) * len(types))
    for stage in layer_hessians(ckpt, ids, device=dev):
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
