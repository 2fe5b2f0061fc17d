"""`mixq plan --format gguf --measure`: measured GGUF error curves in end-to-end KLD units.

measurement/gguf_errors.py measures every budgeted GGUF tensor's error at every candidate type (layer-output error
tr(ΔW·H·ΔWᵀ), or weighted weight error for token_embd). Those numbers rank types within a tensor, not tensors
against each other (a small layer error in an attention output can cost more KLD than a large one in an expert).
So each unit is also quantized alone, with ggml's own encoder at its reference type (the ladder type nearest
3.5 bpw), the rest of the model left at full precision, and scored against the source model on calibration tokens
with `mixq eval`'s KLD; the unit's curve is scaled so that its exact-encoder error at the reference type equals
that KLD. With --rounding hessian the curve keeps the Hessian-rounded errors, so the plan sees what the rounding
gains per type. This runs the model end to end (one forward per unit), which is why it lives in eval; it holds
the model in memory, so it suits models that fit (the fixtures); a per-layer variant for 320B models is not built.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from mixq.measurement.encode_cache import EncodeCache
from mixq.measurement.gguf_errors import GGUFMeasurement, measure_gguf_errors
from mixq.measurement.hessians import ROUNDINGS
from mixq.planning.gguf_measured import measured_units
from mixq.planning.gguf_mix import DEFAULT_LADDER
from mixq.errors import InputError
from mixq.runtime.reference import KLD_ROWS, KLD_SEQ_LEN, PerturbedKLD
from mixq.quant.ggml import encoders
from mixq.quant.ggml.rounding import hessian as kh


def _dequantized(x: torch.Tensor, qtype: str, imatrix: np.ndarray | None) -> torch.Tensor:
    """x (rows, n) encoded by ggml's encoder (imatrix (n,) or None) and decoded again."""
    b = encoders.quantize(x.numpy(), qtype, imatrix)
    return torch.from_numpy(kh.dequantize_blocks(b, qtype)).reshape(x.shape)


def unit_klds(ckpt, measurement: GGUFMeasurement, calibration: Sequence[str] | None = None, *,
              imatrix: Mapping[str, np.ndarray] | None = None, rows: int = KLD_ROWS, seq_len: int = KLD_SEQ_LEN,
              device: str | None = None, seed: int = 0, progress: bool = True) -> dict[str, float]:
    """Each unit's KLD (model with that unit alone at its reference type ‖ source model), mean over calibration
    tokens. Experts are encoded one by one with their own imatrix slice, as the converter does."""
    units = measured_units(ckpt)
    scorer = PerturbedKLD(ckpt, calibration, rows=rows, seq_len=seq_len, seed=seed, device=device)
    base = scorer.base
    out: dict[str, float] = {}
    for name in tqdm(list(measurement.reference), desc="unit kld", unit="unit", disable=not progress):
        if name not in units:
            raise InputError(f"--measure: {name} is not a budgeted GGUF tensor of {ckpt.path}")
        spec, _ = units[name]
        qtype = measurement.reference[name]
        im = None if imatrix is None or imatrix.get(name) is None else np.asarray(imatrix[name], np.float32)
        w = dict(base)
        if spec.transform == "stack":
            n = int(spec.shape[-1])
            for e, h in enumerate(spec.hf_names):
                w[h] = _dequantized(base[h], qtype, None if im is None else im.reshape(-1, n)[e])
        else:
            h = spec.hf_names[0]
            w[h] = _dequantized(base[h], qtype, im)
        out[name] = scorer.kld(w)
    return out


def kld_scaled(measurement: GGUFMeasurement, klds: Mapping[str, float]) -> dict[str, dict[float, float]]:
    """The measured curves in KLD units: unit curve × KLD(reference type) / exact error(reference type)."""
    out = {}
    for name, curve in measurement.curves.items():
        e = measurement.reference_error.get(name, 0.0)
        if name not in klds or not e > 0:
            raise InputError(f"--measure: no end-to-end KLD or no reference error for {name!r}")
        s = max(klds[name], 0.0) / e
        out[name] = {float(b): float(v) * s for b, v in curve.items()}
    return out


def gguf_kld_curves(ckpt, calibration: Sequence[str] | None = None, *, ladder: str = DEFAULT_LADDER,
                    rounding: str = ROUNDINGS[0], imatrix: Mapping[str, np.ndarray] | None = None,
                    device: str | None = None, cache: EncodeCache | None = None,
                    progress: bool = True) -> dict[str, dict[float, float]]:
    """Measured GGUF curves {unit: {bpw: predicted KLD}} for `plan_model(..., measure=)` (module docstring).
    `cache`: a family's encode cache, given the measurement's exact encodes (measurement/gguf_errors)."""
    m = measure_gguf_errors(ckpt, calibration, ladder=ladder, rounding=rounding, imatrix=imatrix, device=device,
                            cache=cache, progress=progress)
    return kld_scaled(m, unit_klds(ckpt, m, calibration, imatrix=imatrix, device=device, progress=progress))
