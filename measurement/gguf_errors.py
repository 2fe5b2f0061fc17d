"""`plan --format gguf --measure`: every budgeted GGUF tensor's error at every candidate ggml type, measured.

One calibration walk (measurement/hessians.py) gives each Linear's input Hessian; every budgeted tensor is encoded
in every type of its ladder (planning.gguf_mix.ladder: the types a --bpw/--size plan may give it), with the rounding
the conversion will use (`exact`: ggml's encoder with the imatrix or diag(H); `hessian`: quant/ggml/rounding/hessian),
and its layer-output error tr(ΔW·H·ΔWᵀ) is recorded. Routed experts: one unit per `*_exps` tensor (all experts of
the layer), the sum over experts with their routing-weighted Hessians. token_embd has no input Hessian and is
measured through the first layer (Σ_rows f_row·δ·M·δᵀ, f the calibration frequency of the token, M
measurement/hessians.embedding_hessian). Units become comparable with each other only through the end-to-end
rescaling of measurement/gguf_kld.py (one KLD measurement per unit). Result: {unit: {bits per weight of the type:
error}}, the curves format of `--measure-out` / `--measure FILE` (a ladder's types have distinct widths).

A family (conversion/gguf/family.py, `--measure kld`) passes its content-addressed encode cache: every exact encode the
measurement makes is stored under the key the conversion would compute for it (`MeasuredEncodes`), where the
conversion encodes the same thing -- the GGUF tensor is the HF tensor or the stack of its experts unchanged, the
importance vectors are the ones the conversion gives the encoder, the type is one of mixq's ggml encoders -- so each
member's encode of that (tensor, type) is a cache hit. The curves do not depend on whether a cache is given.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from mixq.measurement.encode_cache import EncodeCache
from mixq.measurement.hessians import DAMP, REFINE_PASSES, check_rounding, embedding_hessian, layer_hessians, token_frequency
from mixq.measurement.trellis import MEASURE_ROWS, MEASURE_SEQ_LEN  # one measurement default for EXL3 and GGUF
from mixq.errors import InputError
from mixq.formats.gguf_names import build_tensor
from mixq.planning import gguf_mix as gm
from mixq.planning.gguf_measured import measured_units
from mixq.quant.ggml import encoders
from mixq.quant.ggml.rounding import hessian as kh
from mixq.quant.device import pick_device
from mixq.runtime import profile
from mixq.runtime.calibration import calibration_rows, load_tokenizer

REFERENCE_BPW = 3.5  # the end-to-end rescaling measures each unit at its ladder type nearest this width


@dataclass
class GGUFMeasurement:
    """Measured curves {unit: {bpw: error}}, each unit's reference type, and ggml's own (exact) error there."""
    curves: dict[str, dict[float, float]]
    reference: dict[str, str] = field(default_factory=dict)
    reference_error: dict[str, float] = field(default_factory=dict)


def reference_type(types: Sequence[str]) -> str:
    """The ladder type whose width is nearest ``REFERENCE_BPW`` (the lower one on a tie)."""
    return min(types, key=lambda t: (abs(gm.type_bpw(t) - REFERENCE_BPW), gm.type_bpw(t)))


class MeasuredEncodes:
    """Keeps the measurement's exact encodes in `cache` under the conversion's keys (module docstring).

    `imatrix` is the conversion's importance mapping (GGUF name -> means, None without --imatrix): an encode is
    kept only when the importance the measurement gave the encoder is the one the conversion will give it."""

    def __init__(self, cache: EncodeCache, ckpt, imatrix: Mapping | None) -> None:
        self.cache, self.ckpt, self.imatrix = cache, ckpt, imatrix
        self.kept = 0

    def wants(self, spec, qtype: str) -> bool:
        """Whether the conversion's encode of `spec` in `qtype` can be the measurement's: the same source tensor
        and one of mixq's ggml encoders."""
        return spec.transform in ("stack", "none") and qtype in encoders.SUPPORTED

    def put(self, spec, qtype: str, used: np.ndarray | None, blocks: np.ndarray) -> None:
        """Store the ggml bytes `blocks` of `spec` in `qtype`, encoded with importance `used` (skipped when the
        conversion would give the encoder other importance vectors)."""
        conv = None if self.imatrix is None else self.imatrix.get(spec.name)
        if (used is None) != (conv is None) or (used is not None and not np.array_equal(
                np.asarray(used, np.float32).reshape(-1), np.asarray(conv, np.float32).reshape(-1))):
            return

        def load() -> tuple[np.ndarray, np.ndarray | None]:
            return build_tensor(spec, self.ckpt.get).numpy(), conv

        key = self.cache.key(str(self.ckpt.path), spec.name, qtype, tuple(spec.shape), load)
        self.cache.put(key, blocks.reshape(*spec.shape[:-1], -1))
        self.kept += 1


def _ggml_importance(qtype: str, h: torch.Tensor | None, importance: np.ndarray | None) -> np.ndarray | None:
    """The importance ggml's encoder gets: the conversion's, else diag(H) for the types that refuse none."""
    if importance is None and qtype in encoders.REQUIRES_IMATRIX and h is not None:
        return torch.diagonal(h, dim1=-2, dim2=-1).clamp_min(0).numpy().copy()
    return importance


def _ggml_blocks(w: torch.Tensor, qtype: str, importance: np.ndarray | None) -> np.ndarray:
    """ggml's encoder on w (rows, n) / (E, rows, n), one expert at a time with its own importance (E, n)."""
    if w.ndim == 3:
        return np.stack([encoders.quantize(w[e].numpy(), qtype, None if importance is None else importance[e])
                         for e in range(w.shape[0])])
    return encoders.quantize(w.numpy(), qtype, importance)


def _encode(w: torch.Tensor, qtype: str, h: torch.Tensor | None, importance: np.ndarray | None,
            rounding: str, dev, blocks: list | None = None) -> torch.Tensor:
    """Dequantized copy of w (rows, n) / (E, rows, n) encoded as qtype with the chosen rounding; `blocks`: the
    exact encoder's bytes and importance are appended to it (for `MeasuredEncodes`)."""
    if rounding == "hessian" and h is not None and qtype in kh.SUPPORTED:
        b = kh.quantize_hessian(w, h, qtype, importance, damp=DAMP, refine=REFINE_PASSES, device=dev)
        return torch.from_numpy(kh.dequantize_blocks(b, qtype)).reshape(w.shape)
    importance = _ggml_importance(qtype, h, importance)
    b = _ggml_blocks(w, qtype, importance)
    if blocks is not None:
        blocks.append((b, importance))
    return torch.from_numpy(kh.dequantize_blocks(b, qtype)).reshape(w.shape)


def _keep(store: MeasuredEncodes | None, spec, qtype: str, parts: list) -> None:
    """Hand a unit's exact encodes (one (bytes, importance) per expert chunk, in order) to `store`."""
    if store is None or not parts:
        return
    used = [u for _, u in parts]
    if any((u is None) != (used[0] is None) for u in used):
        return
    imp = None if used[0] is None else np.concatenate([np.asarray(u).reshape(-1) for u in used])
    store.put(spec, qtype, imp, np.concatenate([b.reshape(-1) for b, _ in parts]))


def _importance(imatrix: Mapping | None, name: str, shape) -> np.ndarray | None:
    """The conversion's importance for this tensor ((n,) or (E, n)): its --imatrix entry, or None."""
    if imatrix is None or imatrix.get(name) is None:
        return None
    im = np.asarray(imatrix[name], np.float32)
    return im.reshape(shape[0], shape[-1]) if len(shape) == 3 else im


def _parts(store: MeasuredEncodes | None, spec, types, rounding: str) -> dict[str, list] | None:
    """Per type, the list a unit's exact encodes are collected in for `store` (None: nothing to keep)."""
    if store is None or rounding != "exact":
        return None
    return {t: [] for t in types if store.wants(spec, t)}


def row_error(w: torch.Tensor, wq: torch.Tensor, h: torch.Tensor, rows: torch.Tensor | None) -> float:
    """Σ_j rows_j·(ΔW·H·ΔWᵀ)_jj over the rows of W (rows, n) / (E, rows, n), H (n, n) / (E, n, n), `rows` the
    matching (rows,) / (E, rows) weights; tr(ΔW·H·ΔWᵀ) summed when `rows` is None."""
    if rows is None:
        return float(kh.layer_error(w, wq, h).sum())
    d = w.double() - wq.double()
    return float((((d @ h.double()) * d).sum(-1) * rows.double()).sum())


def _linear_curve(spec, types, stage, fetch, imatrix, rounding, dev, store: MeasuredEncodes | None = None,
                  rows: torch.Tensor | None = None) -> tuple[dict[float, float], float] | None:
    """({bpw: Σ tr(ΔW·H·ΔWᵀ)}, ggml's own error at the reference type) of one budgeted Linear or expert stack;
    None without a Hessian. `store`: where the exact encodes are kept for the conversion. `rows`: per-row weights
    of the output error ((rows,) or (E, rows)); routed experts are then weighted with their routing-weighted
    covariance (StageHessians.routed) instead of the rounding's blended Hessian."""
    errs = dict.fromkeys((gm.type_bpw(t) for t in types), 0.0)
    ref, ref_err = reference_type(types), 0.0
    parts = _parts(store, spec, types, rounding)
    if spec.transform == "stack":
        E, n = len(spec.hf_names), int(spec.shape[-1])
        step = max(1, (1 << 30) // (8 * n * n))
        for e0 in range(0, E, step):
            e1 = min(E, e0 + step)
            h = stage.experts(spec, e0, e1)
            if h is None:
                return None
            lh, rw = (h, None) if rows is None else (stage.routed(spec, e0, e1), rows[e0:e1])
            w = torch.stack([fetch(spec.hf_names[e]) for e in range(e0, e1)])
            im = _importance(imatrix, spec.name, (E, 0, n))
            im = None if im is None else im[e0:e1]
            for t in types:
                wq = _encode(w, t, h, im, rounding, dev, None if parts is None else parts.get(t))
                errs[gm.type_bpw(t)] += row_error(w, wq, lh, rw)
            if rounding != "exact":
                ref_err += row_error(w, _encode(w, ref, h, im, "exact", dev), lh, rw)
        for t, p in (parts or {}).items():
            _keep(store, spec, t, p)
        return errs, (ref_err if rounding != "exact" else errs[gm.type_bpw(ref)])
    h = stage.get(spec)
    if h is None:
        return None
    w = fetch(spec.hf_names[0])
    im = _importance(imatrix, spec.name, spec.shape)
    for t in types:
        wq = _encode(w, t, h, im, rounding, dev, None if parts is None else parts.get(t))
        errs[gm.type_bpw(t)] = row_error(w, wq, h, rows)
    for t, p in (parts or {}).items():
        _keep(store, spec, t, p)
    if rounding == "exact":
        return errs, errs[gm.type_bpw(ref)]
    return errs, row_error(w, _encode(w, ref, h, im, "exact", dev), h, rows)


def _embedding_curve(spec, types, fetch, stage, ckpt, ids: torch.Tensor, rounding: str, dev,
                     store: MeasuredEncodes | None = None, weights: tuple | None = None) -> tuple[dict, float]:
    """({bpw: Σ_rows f_row·δ_row·M·δ_rowᵀ}, exact error at the reference type) of token_embd: rows weighted by
    how often the calibration text uses the token (+1), M the first layer's embedding metric (else identity).
    `weights`: (row weights (vocab,), column weights (hidden,)) in place of f and M: Σ_v r_v·Σ_k c_k·δ_vk²."""
    w = fetch(spec.hf_names[0])
    freq = token_frequency(ids, w.shape[0]) + 1.0
    m = embedding_hessian(stage, ckpt, w, freq)
    metric = m.double() if m is not None else torch.eye(w.shape[1], dtype=torch.float64)
    parts = _parts(store, spec, types, rounding)

    def err(t: str, how: str) -> float:
        d = _encode(w, t, m, None, how, dev, None if parts is None else parts.get(t)).double() - w.double()
        if weights is not None:
            return float(((d.square() * weights[1].double()[None, :]).sum(1) * weights[0].double()).sum())
        return float((((d @ metric) * d).sum(1) * freq).sum())

    ref = reference_type(types)
    curve = {gm.type_bpw(t): err(t, rounding) for t in types}
    for t, p in (parts or {}).items():
        _keep(store, spec, t, p)
    return curve, (curve[gm.type_bpw(ref)] if rounding == "exact" else err(ref, "exact"))


def measure_gguf_errors(ckpt, calibration: Sequence[str] | None = None, *, ladder: str = gm.DEFAULT_LADDER,
                        rounding: str = "exact", imatrix: Mapping[str, np.ndarray] | None = None,
                        rows: int | None = None, seq_len: int | None = None, include_mtp: bool = True,
                        only: Sequence[str] | None = None, device: str | None = None,
                        cache: EncodeCache | None = None, row_weights: Mapping | None = None,
                        progress: bool = True) -> GGUFMeasurement:
    """Measured error curves {GGUF tensor: {bpw: error}} of every budgeted tensor (module docstring).

    `rounding`: "exact" or "hessian" (as the conversion will encode); `imatrix`: GGUF name -> importance (the
    --imatrix the conversion will use; default: ggml's reference path, diag(H) for the types that need one).
    Errors of different units are not comparable until rescaled end to end (measurement/gguf_kld.py). `only`: measure
    just these GGUF tensors (default: every budgeted one). `cache`: a family's encode cache, where the exact
    encodes are kept for the members' conversions (`MeasuredEncodes`). `row_weights`: GGUF name -> per-row
    weights of the output error (measurement/streaming.py: ½ the output-gradient second moments, which puts the
    curves in nats per token; token_embd: a (rows, columns) pair)."""
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
    ids = calibration_rows(load_tokenizer(ckpt.path), calibration, rows=rows or MEASURE_ROWS,
                           seq_len=seq_len or MEASURE_SEQ_LEN, vocab_size=int(ckpt.text_config["vocab_size"]))
    fetch = lambda n: ckpt.get(n, dtype=torch.float32)  # noqa: E731
    by_layer: dict[int | None, list[str]] = {}
    for name, (spec, _) in units.items():
        if spec.role != "embed":
            by_layer.setdefault(spec.layer, []).append(name)
    store = MeasuredEncodes(cache, ckpt, imatrix) if cache is not None else None
    res = GGUFMeasurement({})
    curves = res.curves
    bar = tqdm(total=sum(math.prod(s.shape) * len(t) for s, t in units.values()), desc="measure", unit="w",
               unit_scale=True, disable=not progress)
    embed = [n for n, (s, _) in units.items() if s.role == "embed"]
    for stage in layer_hessians(ckpt, ids, device=dev):
        for name in embed:  # the first stage: its Linears read the embedding
            spec, types = units[name]
            curves[name], res.reference_error[name] = _embedding_curve(
                spec, types, fetch, stage, ckpt, ids, rounding, dev, store,
                None if row_weights is None else row_weights[name])
            res.reference[name] = reference_type(types)
            bar.update(math.prod(spec.shape) * len(types))
        embed = []
        with profile.stage("measure", profile.walk_label(stage.layer, ckpt.num_hidden_layers)):
            for name in by_layer.get(stage.layer, []):
                spec, types = units[name]
                c = _linear_curve(spec, types, stage, fetch, imatrix, rounding, dev, store,
                                  None if row_weights is None else row_weights[name])
                if c is None:
                    raise InputError(f"{name}: the calibration forward never forms this tensor's input; cannot "
                                     "measure")
                curves[name], res.reference_error[name] = c
                res.reference[name] = reference_type(types)
                bar.update(math.prod(spec.shape) * len(types))
    bar.close()
    missing = sorted(set(units) - set(curves))
    if missing:
        raise InputError(f"--measure: calibration did not reach {missing[0]}")
    return res
