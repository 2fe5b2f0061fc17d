"""`mixq plan --measure`: measure every budgeted EXL3 unit's trellis loss at every candidate bitrate.

One calibration pass (``runtime/calibration.py``, full Hessians, source weights) walks the decoder layer by
layer; for every budgeted unit of the layer (the planner's units: one Linear, the fused KDA qkv, or all routed
experts of the layer) ``quant/trellis/loss.measure`` quantizes the weight with the trellis encoder at each rate
(LDLQ with the same Hessian the EXL3 pipeline uses) and returns tr(ΔW·H·ΔWᵀ). The result is the curves
``{unit key: {bits: loss}}`` that ``plan_model(measure=...)`` hands to the knapsack solver.

Routed experts: the calibrator sends every token through every expert (the pipeline's LDLQ Hessian), but the
model only feeds an expert its routed tokens, weighted by the gate. The loss of expert e therefore uses the
routing-weighted Hessian R_e = Σ_t g_te²·x_t·x_tᵀ / N (N = all calibration tokens; x_t the expert's input, for
down_proj its activation), captured here from the experts module's inputs. A few experts per layer are
measured (uniformly among the routed ones) and the layer's total is scaled by routing mass Σ_e Σ_t g_te².

Sampling (CPU default, ``SAMPLING["cpu"]``): per matrix 1 random rotated 16-column strip (plus a strip holding
an outlier, if any) and 2 experts per layer; on CUDA everything is encoded (exact). quant/trellis/loss.py has the
estimator, docs/planning.md §3 its accuracy and cost.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Mapping, Sequence

import torch
from tqdm.auto import tqdm

from mixq.runtime import profile
from mixq.runtime.calibration import (LayerCalibrator, RoutingCapture, calibrate, calibration_rows, capture_routing,
                                      expert_activation, load_tokenizer)
from mixq.errors import InputError
from mixq.formats.atomic import write_json
from mixq.formats.checkpoint import open_checkpoint
from mixq.formats.exl3_names import exl3_layout
from mixq.formats.glm5next import global_hf_name
from mixq.formats.model_files import read_json
from mixq.planning import allocator as al
from mixq.planning.exl3 import allocator_unit
from mixq.quant.trellis import loss as qs
from mixq.quant.device import pick_device

# the trellis measurement's calibration (also the proxy's and GGUF's layer errors): fewer rows than a
# conversion's (runtime/calibration.CALIBRATION_ROWS), as every unit is quantized at every rate
MEASURE_ROWS = 16
MEASURE_SEQ_LEN = 256
RATES: tuple[float, ...] = al.EXL3_RATES
# --measure modes: end to end, whole model (bare --measure; the oracle), end to end streamed (one layer in memory),
# the per-Linear trellis loss, the Hessian-trace proxy
MEASURE_MODES = ("kld", "stream", "trellis", "proxy")
END_TO_END = ("kld", "stream")  # the modes whose curves are in end-to-end KLD units (EXL3 and GGUF)
DEFAULT_SAMPLE = "auto"  # --measure-sample: see parse_sample
EXPERT_BATCH_ELEMS = 1 << 27  # elements of weights + Hessians per stacked expert call
# (strips per matrix, experts per layer): None = all
SAMPLING: dict[str, tuple[int | None, int | None]] = {"cpu": (1, 2), "cuda": (None, None),
                                                      # CUDA, models whose budgeted weights exceed BIG_MODEL:
                                                      # measuring all of them would cost one conversion per rate
                                                      "cuda-big": (8, 16)}
BIG_MODEL = 2_000_000_000


def budget_units(ckpt) -> dict[str, list]:
    """The planner's budgeted EXL3 units (``bits`` key) -> their Exl3Units (from formats/exl3_names)."""
    groups: dict[str, list] = {}
    for u in exl3_layout(ckpt, include_mtp=False):
        if u.kind == "trellis" and u.bits_key == "bits":
            n = u.hf_names[0]
            groups.setdefault(allocator_unit(ckpt.info(n), n), []).append(u)
    return groups


def _pick(n: int, count: int | None, seed: int, candidates: torch.Tensor) -> list[int]:
    """Deterministic uniform sample of ``count`` indices among ``candidates`` (all when count is None)."""
    c = candidates.tolist()
    if count is None or count >= len(c):
        return c
    gen = torch.Generator().manual_seed(seed)
    return sorted(c[i] for i in torch.randperm(len(c), generator=gen)[:count].tolist())


def measure_curves(ckpt, calibration: Sequence[str] | None = None, *, rows: int | None = None,
                   seq_len: int | None = None, rates: Sequence[float] | None = None,
                   device: str | None = None, strips: int | None | str = "auto",
                   experts: int | None | str = "auto", scale_tiles: int = 4, seed: int = 0,
                   weights: Mapping[str, float] | None = None,
                   progress: bool = True) -> dict[str, dict[float, float]]:
    """Measured curves {unit key: {bits: proxy loss}} of every budgeted EXL3 unit of ``ckpt`` (module docstring).
    ``weights``: HF name -> the factor each matrix's loss is weighted with (``measurement/streaming.py``: ½·mean
    of its output-gradient second moments); a unit's matrices share one.

    rows / seq_len / rates: None = ``MEASURE_ROWS`` / ``MEASURE_SEQ_LEN`` / ``RATES`` (read at call time).
    strips / experts: "auto" = ``SAMPLING`` for the device; None = all; an int = that many rotated 16-column
    strips per matrix / experts per layer."""
    rows = MEASURE_ROWS if rows is None else rows
    seq_len = MEASURE_SEQ_LEN if seq_len is None else seq_len
    rates = tuple(RATES if rates is None else rates)
    if isinstance(ckpt, (str, Path)):
        ckpt = open_checkpoint(ckpt)
    dev = pick_device(device)
    groups = budget_units(ckpt)
    if dev.type == "cuda":
        numel = sum(math.prod(ckpt.shape(n)) for us in groups.values() for u in us for n in u.hf_names)
        auto = SAMPLING["cuda-big" if numel > BIG_MODEL else "cuda"]
    else:
        auto = SAMPLING["cpu"]
    strips = auto[0] if strips == "auto" else strips
    experts = auto[1] if experts == "auto" else experts
    if not groups:
        raise InputError(f"{ckpt.path}: no budgeted EXL3 Linears to measure")
    by_layer: dict[int, list[str]] = {}
    for key, us in groups.items():
        by_layer.setdefault(ckpt.info(us[0].hf_names[0]).layer, []).append(key)
    ids = calibration_rows(load_tokenizer(ckpt.path), calibration, rows=rows, seq_len=seq_len,
                           vocab_size=ckpt.shape(global_hf_name("embed"))[0])
    cal = LayerCalibrator(ckpt, ids, device=dev, full=True)
    captures = capture_routing(cal)
    fetch = lambda n: ckpt.get(n, dtype=torch.float32)  # noqa: E731
    curves: dict[str, dict[float, float]] = {}
    bar = tqdm(total=len(groups), desc="measure", unit="unit", disable=not progress)
    n_layers = ckpt.num_hidden_layers
    for stage in profile.timed("calibrate", cal.stages(), lambda st: profile.walk_label(st.layer, n_layers)):
        if stage.layer is None:
            break  # the head is not budgeted (head_bits)
        cap = captures.get(stage.layer)
        with profile.stage("measure", profile.layer_label(stage.layer, n_layers)):
            for key in by_layer.get(stage.layer, []):
                us = groups[key]
                if key.endswith(".experts"):
                    loss = _measure_experts(stage, us, cap, fetch, rates, strips, experts, scale_tiles,
                                            seed + 1000 * stage.layer, dev, weights)
                else:
                    (u,) = us
                    acc = stage.stats.get(u.hf_names[0])
                    h = acc.hessian() if acc is not None else None
                    if h is None:
                        raise InputError(f"{u.hf_names[0]}: calibration saw no input for this Linear; cannot "
                                         "measure")
                    w = u.assemble(fetch).to(dev)
                    loss = qs.measure(w, h.to(dev), rates, strips=strips, scale_tiles=scale_tiles,
                                      seed=seed)[:, 0]
                    if weights is not None:
                        loss = loss * float(weights[u.hf_names[0]])
                curves[key] = {float(b): float(v) for b, v in zip(rates, loss.tolist())}
                bar.update(1)
        if cap is not None:
            cap.clear()
        stage.advance()
    bar.close()
    missing = set(groups) - set(curves)
    if missing:
        raise InputError(f"--measure: calibration did not reach {sorted(missing)[0]}")
    return curves


@torch.no_grad()
def _measure_experts(stage, us, cap: RoutingCapture | None, fetch, rates, strips, experts, scale_tiles, seed,
                     dev, weights: Mapping[str, float] | None = None) -> torch.Tensor:
    """Summed loss of all routed experts of one layer, from a routing-mass-scaled sample of experts (each expert's
    matrices weighted by ``weights``, and the sample scaled by the weighted mass, when given)."""
    by = {}
    for u in us:  # Exl3Units "...experts.{e}.{gate,up,down}_proj"
        parts = u.key.rsplit(".", 2)
        by.setdefault(int(parts[-2]), {})[parts[-1]] = u
    n_exp = max(by) + 1
    if cap is None or not cap.x:
        raise InputError(f"{us[0].hf_names[0]}: no routing captured for this layer's experts")
    x, g = cap.routed(n_exp)
    n_tok = x.shape[0]
    mass = g.square().sum(0).double()  # Σ_t g_te² per expert
    picked = _pick(n_exp, experts, seed, (mass > 0).nonzero().squeeze(1))
    if not picked:
        return torch.zeros(len(rates), dtype=torch.float64)
    total = torch.zeros(len(rates), dtype=torch.float64)
    gu_w, gu_h, gu_l, dn_w, dn_h, dn_l = [], [], [], [], [], []
    gu_f, dn_f = [], []  # each matrix's loss weight
    wt = (lambda n: 1.0) if weights is None else (lambda n: float(weights[n]))  # noqa: E731
    for e in picked:
        rows = g[:, e].nonzero().squeeze(1)
        xe, ge = x[rows], g[rows, e:e + 1]
        xg = (xe * ge).double()
        r_gu = (xg.T @ xg / n_tok).float()
        a = expert_activation(cap.module, e, xe).double() * ge.double()
        r_dn = (a.T @ a / n_tok).float()
        for proj in ("gate_proj", "up_proj"):
            u = by[e][proj]
            gu_w.append(u.assemble(fetch))
            gu_h.append(stage.stats[u.hf_names[0]].hessian())
            gu_l.append(r_gu)
            gu_f.append(wt(u.hf_names[0]))
        u = by[e]["down_proj"]
        dn_w.append(u.assemble(fetch))
        dn_h.append(stage.stats[u.hf_names[0]].hessian())
        dn_l.append(r_dn)
        dn_f.append(wt(u.hf_names[0]))
    for ws, hs, ls, fs in ((gu_w, gu_h, gu_l, gu_f), (dn_w, dn_h, dn_l, dn_f)):
        per = ws[0].numel() + 2 * hs[0].numel()  # weight + LDLQ and loss Hessians per matrix
        step = max(1, min(len(ws), EXPERT_BATCH_ELEMS // per))
        for i in range(0, len(ws), step):  # stacked calls of bounded size (288 experts on GLM-5.3)
            st = lambda t: torch.stack(t[i:i + step]).to(dev)  # noqa: E731
            f = torch.tensor(fs[i:i + step], dtype=torch.float64)
            total += (qs.measure(st(ws), st(hs), rates, loss_hessian=st(ls), strips=strips,
                                 scale_tiles=scale_tiles, seed=seed + i) * f).sum(1)
    if weights is None:
        return total * float(mass.sum() / mass[picked].sum())
    # the sample stands for every expert in proportion to its weighted routing mass
    w_e = torch.tensor([wt(by[e]["down_proj"].hf_names[0]) + 2 * wt(by[e]["gate_proj"].hf_names[0])
                        for e in range(n_exp)], dtype=torch.float64)
    wm = mass * w_e
    return total * float(wm.sum() / wm[picked].sum().clamp_min(1e-300))


def predicted_loss(plan, curves: Mapping[str, Mapping[float, float]], ckpt) -> float:
    """Σ over the budgeted units of ``plan`` (EXL3) of the curve value at the unit's planned bits: the total
    error the solver predicts for that plan under ``curves``."""
    levels: dict[str, float] = {}
    for t in plan.tensors:
        info = ckpt.info(t.name)
        if t.bits is not None and info.exl3 == "trellis" and info.exl3_bits_key == "bits" and not info.mtp:
            levels.setdefault(allocator_unit(info, t.name), t.bits)
    missing = [k for k in levels if k not in curves]
    if missing:
        raise InputError(f"no curve for unit {missing[0]!r}")
    return float(sum(curves[k][float(b)] for k, b in levels.items()))


# --- curves files ----------------------------------------------------------------------------------------------
def save_curves(curves: Mapping[str, Mapping[float, float]], path: str | Path, meta: dict | None = None) -> None:
    """Write {unit: {bits: loss}} as JSON (bits as strings), under a temporary name renamed at the end.
    ``meta`` goes under the key "_meta" (ignored by ``load_curves``)."""
    path = Path(path)
    d = {k: {f"{float(b):g}": float(v) for b, v in sorted(c.items())} for k, c in curves.items()}
    if meta:
        d = {"_meta": meta, **d}
    try:
        write_json(path, d, indent=1)
    except OSError as e:
        raise InputError(f"--measure-out {path}: cannot write ({e})") from None


def curves_meta(path: str | Path) -> dict:
    """The "_meta" record `save_curves` wrote into a curves JSON ({} when there is none or it cannot be read)."""
    try:
        meta = read_json(path, "curves file").get("_meta")
    except (InputError, AttributeError):
        return {}
    return meta if isinstance(meta, dict) else {}


def load_curves(path: str | Path) -> dict[str, dict[float, float]]:
    """Read a curves JSON {unit: {bits: error}} (a "_meta" entry is skipped)."""
    raw = read_json(path, "--measure curves file")
    try:
        return {k: {float(b): float(e) for b, e in v.items()} for k, v in raw.items() if k != "_meta"}
    except (ValueError, AttributeError, TypeError) as e:
        raise InputError(f"--measure {path}: expected JSON {{unit: {{bits: error}}}} ({e})") from None


def parse_sample(text: str) -> tuple[int | None | str, int | None | str]:
    """``--measure-sample``: "auto" (``SAMPLING`` for the device), "all" (every tile of every expert: on GLM-5.3
    that costs about one conversion per rate), or "STRIPS,EXPERTS" (rotated 16-column strips per matrix, experts per
    layer; either may be "all"). A pair already parsed (`PlanOptions.measure_sample`) is returned as it is."""
    if isinstance(text, tuple):
        return text
    t = str(text).strip().lower()
    if t in ("auto", "all"):
        return (t, t) if t == "auto" else (None, None)
    parts = t.split(",")
    try:
        if len(parts) != 2:
            raise ValueError
        out = tuple(None if p.strip() == "all" else int(p) for p in parts)
        if any(v is not None and v < 1 for v in out):
            raise ValueError
    except ValueError:
        raise InputError(f"--measure-sample {text!r}: use auto, all, or STRIPS,EXPERTS such as 4,8") from None
    return out  # type: ignore[return-value]


def resolve_measure(ckpt, measure: str | Mapping[str, Mapping[float, float]] | None, fmt: str, *,
                    calibration: Sequence[str] | None = None, measure_out: str | None = None,
                    device: str | None = None, sample: str = DEFAULT_SAMPLE,
                    progress: bool = True) -> dict[str, dict[float, float]] | None:
    """``--measure`` of ``mixq plan``: None -> None; "trellis" -> ``measure_curves``; "proxy" -> the
    Hessian-trace proxy (``planning.measure_proxy``); curves already measured (a mapping, e.g. the end-to-end KLD
    curves of ``mixq.measurement.kld``) -> themselves; anything else -> a curves JSON file. "kld" runs the model end
    to end and is resolved by ``mixq.measurement.kld.run_plan`` before planning. ``measure_out`` saves measured
    curves for a later ``--measure FILE``; ``sample``: see ``parse_sample``."""
    if measure is None:
        if measure_out:
            raise InputError("--measure-out needs --measure")
        return None
    if isinstance(measure, Mapping):
        return {k: {float(b): float(v) for b, v in c.items()} for k, c in measure.items()}
    if measure in MEASURE_MODES:
        if measure in END_TO_END:
            raise InputError(f"--measure {measure} measures end-to-end curves: use mixq.measurement.kld.run_plan "
                             "(what `mixq plan` runs)")
        if fmt != "exl3":
            raise InputError(f"--measure {measure} is EXL3's trellis measurement")
        t0 = time.time()
        if measure == "proxy":

            curves = measure_proxy(ckpt, calibration or None)
        else:
            strips, experts = parse_sample(sample)
            curves = measure_curves(ckpt, calibration or None, device=device, strips=strips, experts=experts,
                                    progress=progress)
        if measure_out:
            save_curves(curves, measure_out, meta={"model": str(ckpt.path), "method": measure,
                                                   "seconds": round(time.time() - t0, 1)})
        return curves
    if measure_out:
        raise InputError("--measure-out saves measured curves; it does not apply to --measure FILE")
    return load_curves(measure)


def measure_proxy(ckpt, calibration: Sequence[str] | None = None, *, rows: int = MEASURE_ROWS, seq_len: int = MEASURE_SEQ_LEN,
                  device: str = "cpu") -> dict[str, dict[float, float]]:
    """Per-unit error curves {unit key: {bits: error}} for the EXL3 sensitivity solver, from one calibration pass.

    Proxy of the Hessian-weighted loss E[tr(ΔW·H·ΔWᵀ)]: after the random-Hadamard incoherence transform the
    trellis error is close to i.i.d. with variance D(K)·mean(W²), so the loss is D(K)·mean(W²)·out·tr(H) with
    tr(H) = Σx² / N over all N calibration tokens (the calibrator sends every token through every expert, so
    routing is not reflected) and D(K) = 2^(−2K), the rate–distortion slope the trellis tracks (quant/trellis). Not a
    per-rate trellis measurement: every unit's curve has the same shape, only its weight is measured. This is
    ``--measure proxy``; ``--measure`` alone measures with the trellis (``measurement/trellis.py``)."""
    tok = load_tokenizer(ckpt.path)
    ids = calibration_rows(tok, calibration, rows=rows, seq_len=seq_len)
    n_tokens = int(ids.numel())
    weight: dict[str, float] = {}
    n_layers = ckpt.num_hidden_layers
    walk = profile.timed("calibrate", calibrate(ckpt, ids, full=False, device=device),
                         lambda st: profile.walk_label(st.layer, n_layers))
    for stage in walk:
        with profile.stage("measure", profile.walk_label(stage.layer, n_layers)):
            for name, acc in stage.stats.items():
                info = ckpt.info(name)
                if info.exl3 != "trellis" or info.exl3_bits_key != "bits":
                    continue
                w = ckpt.get(name)
                tr_h = float(acc.sum_sq.sum()) / max(1, n_tokens)
                key = allocator_unit(info, name)
                weight[key] = weight.get(key, 0.0) + float(w.square().mean()) * w.shape[0] * tr_h
        stage.advance()
    return {k: {b: v * 2.0 ** (-2 * b) for b in al.EXL3_RATES} for k, v in weight.items()}
