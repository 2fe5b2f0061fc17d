"""`mixq plan --measure kld`: each budgeted unit's end-to-end KLD, the trellis curves rescaled to it, and the plan
command that uses them.

The per-Linear trellis loss alone mis-ranks units (on glm5next-mini o_proj/down_proj have a tiny proxy loss and a
large end-to-end KLD), so ``--measure kld`` perturbs one unit at a time with noise of the trellis's weight-space
error at ``ref_bits`` and scores the model against the source with the reference forward (runtime/reference.py) and
`mixq eval`'s KL statistics (runtime/kl_stats.py). ``run_plan`` is what ``mixq plan`` runs, resolving
``--measure kld`` here and everything else in ``measurement.plan_run.run_plan``.
"""
from __future__ import annotations

import time
from typing import Mapping, Sequence

import torch
from tqdm.auto import tqdm

from mixq.measurement.trellis import (DEFAULT_SAMPLE, END_TO_END, MEASURE_MODES, budget_units, measure_curves,
                                      parse_sample, resolve_measure, save_curves)
from mixq.formats.outputs import check_outputs
from mixq.measurement.options import MeasureOptions, PlanOptions
from mixq.measurement.plan_run import run_plan as plan
from mixq.measurement.streaming import stream_curves
from mixq.errors import InputError
from mixq.measurement.hessians import ROUNDINGS
from mixq.planning.gguf_mix import DEFAULT_LADDER
from mixq.measurement import gguf_kld  # gguf_kld.gguf_kld_curves looked up per call (tests replace it)
from mixq.quant.device import pick_device
from mixq.runtime import profile
from mixq.runtime.reference import KLD_ROWS, KLD_SEQ_LEN, PerturbedKLD
from mixq.formats.checkpoint import open_checkpoint
from mixq.formats.checkpoint_check import validate_checkpoint
from mixq.formats.gguf_names import gguf_tensors
from mixq.formats.imatrix_file import IMatrix, check_names, read_imatrix

REF_BITS = 3.0  # the trellis rate whose weight-space error perturbs each unit
TRELLIS_D = 1.1  # trellis MSE / (2^-2K · mean W²) on incoherent weights (1.09-1.14 measured for K = 2..4)


def run_plan(model: str | None, options: PlanOptions):
    """What ``mixq plan`` runs: ``measurement.plan_run.run_plan``, with ``--measure kld`` measured here first
    (EXL3: ``kld_curves``; GGUF: ``measurement.gguf_kld.gguf_kld_curves`` with the conversion's ``rounding`` and
    ``imatrix``; saved to ``measure_out`` when given). MODEL is checked against its config first, as convert
    checks it (``--from-config`` has no weights to check)."""
    o = options
    check_outputs({"--measure-out": o.measure_out, "--profile": o.profile},
                  {"MODEL": model, "--from-config": o.from_config, "--imatrix": _path_or_none(o.imatrix),
                   "--measure": _path_or_none(o.measure),
                   **{f"--calibration {i + 1}": c for i, c in enumerate(o.calibration)}},
                  overwrite=o.overwrite)
    with profile.recording(o.profile, "plan", o.fmt, table=o.progress):
        ckpt = None
        if model is not None:  # (with --from-config too, plan_run.run_plan refuses the pair)
            with profile.stage("open"):
                ckpt = open_checkpoint(model)
                profile.note_layers(ckpt.config)
                profile.note_device(pick_device(o.device))
                validate_checkpoint(ckpt)  # what convert refuses, plan refuses, before planning or measuring
        curves = None
        if o.measure in END_TO_END:
            if model is None:
                raise InputError(f"--measure {o.measure} runs MODEL: give MODEL, not --from-config")
            t0 = time.time()
            curves = measure_method(ckpt, o.fmt, o.measure, o.calibration, sample=o.measure_sample,
                                    device=o.device, rounding=o.rounding, imatrix=o.imatrix,
                                    gguf_ladder=o.gguf_ladder, progress=o.progress)
            if o.measure_out:
                save_curves(curves, o.measure_out, meta={"model": str(ckpt.path), "method": o.measure,
                                                         "seconds": round(time.time() - t0, 1)})
        # the checkpoint opened and checked here, not opened a second time (--measure trellis / proxy: measured
        # there, its stages recorded as they run)
        return plan(model if ckpt is None else ckpt, o, curves)


def measure_method(ckpt, fmt: str, method: str, calibration: Sequence[str] = (), *,
                   sample: str = DEFAULT_SAMPLE, device: str | None = None, rounding: str = ROUNDINGS[0],
                   imatrix=None, gguf_ladder: str = DEFAULT_LADDER, cache=None,
                   progress: bool = True) -> dict[str, dict[float, float]]:
    """End-to-end curves {unit: {bits or type: KLD}} by `method`: "stream" (measurement/streaming.py: one layer
    in memory) or "kld" (`measure_kld`: the whole model, one forward per unit; the oracle)."""
    if method == "kld":
        return measure_kld(ckpt, fmt, calibration, sample=sample, device=device, rounding=rounding, imatrix=imatrix,
                           gguf_ladder=gguf_ladder, cache=cache, progress=progress)
    if method != "stream":
        raise InputError(f"--measure {method!r}: not an end-to-end measurement ({', '.join(END_TO_END)})")
    return stream_curves(ckpt, fmt, calibration or None, sample=sample, device=device, rounding=rounding,
                         imatrix=_means(ckpt, imatrix) if fmt == "gguf" else None, gguf_ladder=gguf_ladder,
                         cache=cache, progress=progress)


def _means(ckpt, imatrix):
    """The GGUF importance vectors of `imatrix` (a file, an IMatrix, means or None), by GGUF tensor name."""
    if isinstance(imatrix, (str, bytes)) or hasattr(imatrix, "__fspath__"):
        im = check_names(read_imatrix(imatrix), [s.name for s in gguf_tensors(ckpt)], f"--imatrix {imatrix}")
        return im.means()
    if isinstance(imatrix, IMatrix):
        return imatrix.means()
    return imatrix


def run_measure(model, options: MeasureOptions) -> dict[str, dict[float, float]]:
    """What `mixq.measure` runs: the outputs and inputs checked, MODEL opened and checked against its config, then
    the curves of `options.method` (``measure_method`` end to end, or ``trellis.resolve_measure``), saved at
    `options.out`."""
    o = options
    check_outputs({"--measure-out": o.out}, {"MODEL": model, **{f"--calibration {i + 1}": c
                                                              for i, c in enumerate(o.calibration)}},
                  overwrite=o.overwrite)
    ckpt = open_checkpoint(model)
    validate_checkpoint(ckpt)
    if o.method in END_TO_END:
        curves = measure_method(ckpt, o.fmt, o.method, o.calibration, sample=o.sample, device=o.device,
                                rounding=o.rounding, imatrix=o.imatrix, gguf_ladder=o.gguf_ladder,
                                progress=o.progress)
    else:
        curves = resolve_measure(ckpt, o.method, o.fmt, calibration=o.calibration, device=o.device, sample=o.sample,
                                 progress=o.progress)
    if o.out is not None:
        save_curves(curves, o.out, meta=_curves_meta(ckpt, o.method))
    return curves


def family_curves(ckpt, out, *, calibration, imatrix, ladder: str, rounding: str, device, cache,
                  progress: bool, method: str = MEASURE_MODES[0]) -> None:
    """A GGUF family's `measure="kld"` or `"stream"` (conversion/gguf/family.CurveMeasurer): the curves
    `run_measure` makes with `method`, saved at `out`, the exact encodes kept in the family's `cache`."""
    curves = measure_method(ckpt, "gguf", method, calibration or (), device=device, rounding=rounding,
                            imatrix=imatrix, gguf_ladder=ladder, cache=cache, progress=progress)
    save_curves(curves, out, meta=_curves_meta(ckpt, method))


def _curves_meta(ckpt, method: str) -> dict:
    """What a curves file records of its measurement (the same for `run_measure` and a family's)."""
    return {"model": str(ckpt.path), "method": method}


def measure_kld(ckpt, fmt: str, calibration: Sequence[str] = (), *, sample: str = DEFAULT_SAMPLE,
                device: str | None = None, rounding: str = ROUNDINGS[0], imatrix=None,
                gguf_ladder: str = DEFAULT_LADDER, cache=None, progress: bool = True) -> dict[str, dict[float, float]]:
    """End-to-end KLD curves {unit: {bits or type: KLD}} of every budgeted unit: EXL3 (``kld_curves``) or GGUF
    (``eval.gguf_kld.gguf_kld_curves`` with the conversion's ``rounding`` and ``imatrix``, a file, an IMatrix or
    means; ``cache``: a family's EncodeCache, given the exact encodes)."""
    if fmt == "gguf":
        return gguf_kld.gguf_kld_curves(ckpt, calibration or None, ladder=gguf_ladder, rounding=rounding,
                                        imatrix=_means(ckpt, imatrix), device=device, cache=cache,
                                        progress=progress)
    return kld_curves(ckpt, calibration or None, device=device, sample=sample, progress=progress)


def _path_or_none(value):
    """A value that names a file (str or path-like), else None (a mode name such as 'kld', a mapping, None)."""
    if isinstance(value, str) and value in MEASURE_MODES:
        return None
    return value if isinstance(value, (str, bytes)) or hasattr(value, "__fspath__") else None


def kld_curves(ckpt, calibration: Sequence[str] | None = None, *, device: str | None = None,
               sample: str = DEFAULT_SAMPLE, progress: bool = True) -> dict[str, dict[float, float]]:
    """The measured trellis curves of every budgeted unit (``trellis.measure_curves``) in KLD units."""
    strips, experts = parse_sample(sample)
    curves = measure_curves(ckpt, calibration, device=device, strips=strips, experts=experts, progress=progress)
    with profile.stage("kld_gains"):  # every unit perturbed in turn, the whole model scored each time
        gains = kld_gains(ckpt, list(curves), calibration, device=device, progress=progress)
    return kld_weighted(curves, gains)


def kld_gains(ckpt, units: Sequence[str], calibration: Sequence[str] | None = None, *, rows: int = KLD_ROWS,
              seq_len: int = KLD_SEQ_LEN, ref_bits: float = REF_BITS, device: str | None = None, seed: int = 0,
              progress: bool = True) -> dict[str, float]:
    """Each unit's end-to-end cost: the KLD (model with that unit perturbed ‖ source model, mean over calibration
    tokens, `mixq eval`'s KLD) after adding i.i.d. Gaussian noise of the trellis's weight-space error at ``ref_bits``
    (TRELLIS_D·2^(−2·ref_bits)·mean(W²) per tensor) to that unit alone. Holds the whole model in memory: for
    models that fit (fixtures, drafters); a per-layer variant for 320B models is not built."""
    groups = budget_units(ckpt)
    scorer = PerturbedKLD(ckpt, calibration, rows=rows, seq_len=seq_len, seed=seed, device=device)
    base = scorer.base
    gen = torch.Generator().manual_seed(seed)
    gains: dict[str, float] = {}
    for key in tqdm(list(units), desc="kld gains", unit="unit", disable=not progress):
        w = dict(base)
        for u in groups[key]:
            for n in u.hf_names:
                t = base[n]
                sigma = (TRELLIS_D * 2.0 ** (-2 * ref_bits) * float(t.square().mean())) ** 0.5
                w[n] = t + sigma * torch.randn(t.shape, generator=gen)
        gains[key] = scorer.kld(w)
    return gains


def kld_weighted(curves: Mapping[str, Mapping[float, float]], gains: Mapping[str, float],
                 ref_bits: float = REF_BITS) -> dict[str, dict[float, float]]:
    """Curves in KLD units: each unit's measured trellis curve keeps its shape and is scaled so that its value at
    ``ref_bits`` is the unit's measured end-to-end KLD (``kld_gains``)."""
    out = {}
    for k, c in curves.items():
        if k.startswith("_"):
            continue
        c = {float(b): float(v) for b, v in c.items()}
        if k not in gains or ref_bits not in c or c[ref_bits] <= 0:
            raise InputError(f"--measure kld: no gain or no {ref_bits}-bit point for unit {k!r}")
        s = gains[k] / c[ref_bits]
        out[k] = {b: v * s for b, v in c.items()}
    return out
