"""`--measure stream`: each budgeted unit's error curve in units of end-to-end KLD, measured one layer at a time.

The whole-model measurement (measurement/kld.py) perturbs one unit at a time and runs the model end to end; it
needs the model in memory and one forward per unit. This one needs one layer in memory and three streamed passes:

1. A forward over the calibration rows (transformers' decoder layers through `runtime.layer_stream`), keeping each
   layer's input streams (and the DSA top-k it receives) in a spill directory on disk.
2. A backward from the head to layer 0 of the model's own output distribution: for each token a label y is drawn
   from the source model's p, and −log q_y is differentiated. Its gradient g has E[g·gᵀ] = diag(p) − p·pᵀ, the
   Hessian of KL(p‖q) at q = p (the Fisher), so the squared gradients pushed back through the network are the
   curvature of the end-to-end KLD. Layer by layer (from its stored input, grad enabled, one calibration row per
   call) every Linear is tapped: one weight error moves every token of a sequence, so what its error costs is
   the row's weight gradient Σ_t g_t·x_tᵀ (cross-token terms included; per-token second moments alone put
   mini's early units 2-5x too low), whose squared norm per output row j, summed over rows, is F_j. With
   C the input covariance the format's error is measured with (all tokens; for a routed expert the
   routing-weighted R_e = Σ_t gate_t²·x_t·x_tᵀ / N that measurement/trellis.py and measurement/hessians.py
   already form, the gate carried by the gradient), G_j = F_j / (N·tr C) makes ½·Σ_j G_j·Δw_j·C·Δw_jᵀ the
   predicted KLD, exact for i.i.d. noise on the weight.
3. The per-unit error machinery the formats already have, weighted by G (diagonal in the output):
   cost(Ŵ) ≈ ½ Σ_j G_j·Δw_j·C·Δw_jᵀ nats per token. EXL3's Hadamard-rotated trellis error is close to isotropic
   over the rows, so the EXL3 curve is ½·mean(G)·tr(ΔW·C·ΔWᵀ), the trellis curve scaled
   (`exl3_stream_curves`); GGUF's rows are quantized on their own, so its curve keeps the row weights
   (`gguf_stream_curves`, measurement/gguf_errors.py with `row_weights`). token_embd: a row's error enters the
   first layer's input wherever the token occurs, so its weight is count/N per row times the mean squared
   gradient of the embedding output per column. The head is tapped as a Linear. The DSA indexer's Linears only
   choose keys (no gradient): they take their layer's median weight. Routing and key choices that a weight error
   flips are beyond a gradient; on mini the predicted KLD of the oracle's noise is 0.2-1.3x its measured value,
   lowest in the early layers, and ranks the units as the oracle does (tests/measurement/test_streaming.py).

One measurement of G serves both formats and every size of a family; the curves are in nats/token, as the
whole-model measurement's are, so the two are comparable (tests compare them on the fixtures).
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from tqdm.auto import tqdm

from mixq.errors import InputError
from mixq.formats.glm5next import global_hf_name
from mixq.measurement.gguf_errors import measure_gguf_errors
from mixq.measurement import trellis  # MEASURE_ROWS / MEASURE_SEQ_LEN read at call time, as measure_curves does
from mixq.measurement.trellis import budget_units, measure_curves, parse_sample
from mixq.planning.gguf_measured import measured_units
from mixq.quant.device import pick_device
from mixq.runtime.calibration import calibration_rows, load_tokenizer
from mixq.runtime.layer_stream import DecoderStream, module_sources, module_to_hf

EMBED_NAME = global_hf_name("embed")
HEAD_NAME = global_hf_name("lm_head")
NORM_NAME = global_hf_name("norm")


@dataclass
class Sensitivity:
    """Output-gradient second moments of every Linear (module docstring), the statistics one streamed backward
    gives. `noise`: HF name -> Σ_rows ‖Σ_t g_t·x_tᵀ‖² / N, twice the predicted KLD of unit i.i.d. noise on that
    weight (the sequence Fisher's trace; no factorisation); `rows`: HF name -> (out,) float64 G, that Fisher's
    mass per output row divided by tr(C) of the covariance C the weight's error is measured with, so that
    ½·Σ_j G_j·Δw_j·C·Δw_jᵀ is exact for i.i.d. noise; `embed_rows` (vocab,) and `embed_cols` (hidden,):
    token_embd's row and column weights; `tokens`: N."""

    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    noise: dict[str, float] = field(default_factory=dict)
    embed_rows: torch.Tensor | None = None
    embed_cols: torch.Tensor | None = None
    tokens: int = 0

    def add(self, fisher: Mapping[str, torch.Tensor], trace: Mapping[str, float]) -> None:
        """Record the sums one layer's (or the head's) tap gathered (`_LinearTap`)."""
        for n, f in fisher.items():
            self.noise[n] = float(f.sum()) / self.tokens
            tr = trace.get(n, 0.0)
            self.rows[n] = f / tr if tr > 0 else torch.zeros_like(f)

    def mean(self, names: Sequence[str]) -> float:
        """½ · mean of G over the rows of `names` (concatenated): the EXL3 weight of a unit made of them."""
        g = torch.cat([self.rows[n] for n in names])
        return 0.5 * float(g.mean())


class _LinearTap(TorchFunctionMode):
    """For every `F.linear` whose weight is one of a layer's tapped tensors, over one calibration row (one sequence
    per call): the squared norm of each output row of the row's weight gradient Σ_t g_t·x_tᵀ (the Fisher of the
    whole sequence, cross-token terms included: one weight error moves every token), and the trace Σ_t a_t·‖x_t‖²
    of the input covariance the error machinery weighs with (a_t = 1, or gate² for a routed expert). `where`:
    data_ptr of a weight (a Linear's, or one routed expert's row of a stacked tensor) -> (expert index or None,
    [(HF name, first row, rows)] of the checkpoint tensors it holds)."""

    def __init__(self, where: dict[int, tuple], fisher: dict[str, torch.Tensor], trace: dict[str, float],
                 gates: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.where, self.fisher, self.trace, self.gates = where, fisher, trace, gates

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is F.linear and isinstance(out, torch.Tensor) and out.requires_grad:
            x = args[0] if args else kwargs["input"]
            w = args[1] if len(args) > 1 else kwargs["weight"]
            hit = self.where.get(w.data_ptr())
            if hit is not None:
                expert, parts = hit
                x = x.detach().double().reshape(-1, x.shape[-1])
                a = self.gates[expert] if expert is not None else None
                tr = float(x.square().sum(1) @ a) if a is not None else float(x.square().sum())
                for name, _, _ in parts:
                    self.trace[name] = self.trace.get(name, 0.0) + tr
                out.register_hook(self._hook(parts, x @ x.T))
        return out

    def _hook(self, parts, gram: torch.Tensor):
        def hook(g: torch.Tensor) -> None:
            g = g.detach().double().reshape(-1, g.shape[-1])
            rows = (g * (gram @ g)).sum(0).cpu()  # ‖(Σ_t g_t·x_tᵀ)_j‖² per output row j
            for name, r0, n in parts:
                acc = self.fisher.get(name)
                self.fisher[name] = rows[r0:r0 + n].clone() if acc is None else acc + rows[r0:r0 + n]
        return hook


def _routing(module: nn.Module, gates: dict[int, torch.Tensor]):
    """Forward pre-hook of a routed-experts module: each expert's gate² per routed token, in the order
    transformers' per-expert loop feeds the expert its tokens (top-k slot, then token)."""
    def hook(m, args) -> None:
        idx, w = args[1], args[2]
        n = m.gate_up_proj.shape[0]
        mask = F.one_hot(idx.long(), num_classes=n + 1).permute(2, 1, 0)
        gates.clear()
        for e in range(n):
            pos, tok = torch.where(mask[e])
            gates[e] = w[tok, pos].detach().double().square()
    return module.register_forward_pre_hook(hook)


def _tap_map(mod: nn.Module, layer: int, shape) -> tuple[dict[int, list], str | None]:
    """(data_ptr -> parts, the routed experts' module path or None) for decoder layer `layer` (see _LinearTap)."""
    where: dict[int, list] = {}
    experts_path = None
    for local, sub in mod.named_modules():
        if isinstance(sub, nn.Linear):
            name = module_to_hf(layer, local + ".weight")
            where[sub.weight.data_ptr()] = (None, [(name, 0, int(sub.weight.shape[0]))])
        elif hasattr(sub, "gate_up_proj") and hasattr(sub, "down_proj"):
            experts_path = local
            for key in ("gate_up_proj", "down_proj"):
                ref = getattr(sub, key)
                for e, parts in enumerate(module_sources(layer, f"{local}.{key}", ref.shape[0])):
                    r0, lst = 0, []
                    for n in parts:
                        k = int(shape(n)[0])
                        lst.append((n, r0, k))
                        r0 += k
                    where[ref[e].data_ptr()] = (e, lst)
    return where, experts_path


def _head_grad(stream: DecoderStream, ckpt, hidden: torch.Tensor, gen: torch.Generator, dev: torch.device,
               out: Sensitivity) -> torch.Tensor:
    """∂/∂streams of Σ_t −log q_{y_t}, y_t drawn from the model's own p_t, over all rows (one row per call); the
    head's statistics go into `out`."""
    skel = stream.skeleton
    skel.norm.to_empty(device=dev)
    skel.norm.load_state_dict({"weight": ckpt.get(NORM_NAME, dtype=torch.float32).to(dev)})
    skel.norm.requires_grad_(False)
    head = ckpt.get(HEAD_NAME, dtype=torch.float32).to(dev)
    where = {head.data_ptr(): (None, [(HEAD_NAME, 0, int(head.shape[0]))])}
    fisher: dict[str, torch.Tensor] = {}
    trace: dict[str, float] = {}
    grad = torch.empty_like(hidden)
    for r in range(hidden.shape[0]):
        h = hidden[r:r + 1].to(dev).requires_grad_(True)
        with torch.enable_grad(), _LinearTap(where, fisher, trace, {}):
            logits = F.linear(skel.norm(skel.hc_head(h)), head).float()
            logp = torch.log_softmax(logits, -1).reshape(-1, logits.shape[-1])
            y = torch.multinomial(logp.detach().exp().cpu(), 1, generator=gen).to(dev)
            loss = -logp.gather(1, y).sum()
            loss.backward()
        grad[r:r + 1] = h.grad.to(grad.dtype).cpu()
    skel.norm.to("meta")
    out.add(fisher, trace)
    return grad


@torch.no_grad()
def _forward(stream: DecoderStream, ckpt, ids: torch.Tensor, spill: Path, progress: bool) -> torch.Tensor:
    """Stream the calibration rows through every layer, each layer's input (streams, DSA top-k) saved to `spill`.
    Returns the last layer's output streams."""
    fetch = lambda n: ckpt.get(n, dtype=None)  # noqa: E731 - as stored: the stream widens it on its device
    hidden = stream.embed(ids, lambda n: ckpt.get(n, dtype=torch.float32), out_device="cpu")
    topk = None
    for i in tqdm(range(stream.num_layers), desc="stream forward", unit="layer", disable=not progress):
        torch.save({"hidden": hidden, "topk": topk}, spill / f"{i}.pt")
        mod = stream.materialize(i, fetch)
        hidden, topk = stream.run_layer(mod, hidden, topk)
        stream.release(i)
    return hidden


def stream_sensitivity(ckpt, calibration: Sequence[str] | None = None, *, rows: int | None = None,
                       seq_len: int | None = None, device: str | None = None, seed: int = 0,
                       spill_dir: str | Path | None = None, progress: bool = True) -> Sensitivity:
    """The output-gradient statistics of every Linear of `ckpt` (module docstring), one decoder layer in memory at
    a time; each layer's input streams wait on disk (`spill_dir`, default a temporary directory) between the
    forward and the backward, so host memory does not grow with the depth."""
    dev = pick_device(device)
    ids = calibration_rows(load_tokenizer(ckpt.path), calibration, rows=rows or trellis.MEASURE_ROWS,
                           seq_len=seq_len or trellis.MEASURE_SEQ_LEN, vocab_size=ckpt.shape(EMBED_NAME)[0])
    n_tok = int(ids.numel())
    stream = DecoderStream(ckpt.config, device=dev, dtype=torch.float32)
    # transformers' own per-expert loop: each expert's Linears are separate F.linear calls the tap can see
    stream.text_config._experts_implementation = "eager"
    gen = torch.Generator().manual_seed(seed)
    out = Sensitivity(tokens=n_tok)
    with tempfile.TemporaryDirectory(dir=spill_dir, prefix="mixq-stream-") as tmp:
        spill = Path(tmp)
        last = _forward(stream, ckpt, ids, spill, progress)
        grad = _head_grad(stream, ckpt, last, gen, dev, out)
        del last
        fetch = lambda n: ckpt.get(n, dtype=None)  # noqa: E731
        for i in tqdm(reversed(range(stream.num_layers)), total=stream.num_layers, desc="stream backward",
                      unit="layer", disable=not progress):
            state = torch.load(spill / f"{i}.pt")
            (spill / f"{i}.pt").unlink()
            grad = _layer_backward(stream, ckpt, i, state["hidden"], state["topk"], grad, fetch, dev, out)
            del state
    emb = grad.double().sum(2).reshape(-1, grad.shape[-1])  # the embedding feeds every stream
    out.embed_cols = emb.square().sum(0) / n_tok
    counts = torch.bincount(ids.reshape(-1), minlength=ckpt.shape(EMBED_NAME)[0]).double()
    out.embed_rows = counts / n_tok  # the calibration's token distribution: the cost's expectation over it
    return out


def _layer_backward(stream: DecoderStream, ckpt, i: int, hidden: torch.Tensor, topk: torch.Tensor | None,
                    grad_out: torch.Tensor, fetch, dev: torch.device, out: Sensitivity) -> torch.Tensor:
    """Layer i recomputed from its stored input with grad enabled, one calibration row at a time, `grad_out`
    pushed through it: its Linears' statistics go into `out`; returns the gradient of its input streams."""
    mod = stream.materialize(i, fetch)
    mod.requires_grad_(False)
    where, experts_path = _tap_map(mod, i, ckpt.shape)
    fisher: dict[str, torch.Tensor] = {}
    trace: dict[str, float] = {}
    gates: dict[int, torch.Tensor] = {}
    handle = _routing(mod.get_submodule(experts_path), gates) if experts_path is not None else None
    grad_in = torch.empty_like(hidden)
    try:
        for r in range(hidden.shape[0]):  # one sequence per call: the tap's weight gradient is that row's
            sl = slice(r, r + 1)
            x = hidden[sl].to(dev, stream.dtype).requires_grad_(True)
            prev = None if topk is None else topk[sl].to(dev)
            with torch.enable_grad(), _LinearTap(where, fisher, trace, gates):
                y, _ = stream.call_layer(mod, x, prev)
                torch.autograd.backward(y, grad_out[sl].to(dev, y.dtype))
            grad_in[sl] = x.grad.to(grad_in.dtype).cpu()
    finally:
        if handle is not None:
            handle.remove()
        stream.release(i)
    for expert, parts in where.values():  # an expert no calibration token was routed to costs nothing here
        for n, _, k in parts if expert is not None else ():
            fisher.setdefault(n, torch.zeros(k, dtype=torch.float64))
    out.add(fisher, trace)
    return grad_in


# ------------------------------------------------------------------------------------------------ the curves

def unit_weight(ckpt, sens: Sensitivity, names: Sequence[str]) -> float:
    """½·mean(G) over the rows of `names`. A Linear the gradient never reaches (the DSA indexer's: its scores only
    choose the top-k keys, which has no gradient) takes the median weight of its layer's reached Linears."""
    if all(n in sens.rows for n in names):
        return sens.mean(names)
    layer = ckpt.info(names[0]).layer
    peers = [sens.mean([n]) for n in sens.rows if n != HEAD_NAME and ckpt.info(n).layer == layer]
    if not peers:
        raise InputError(f"--measure stream: the backward never reached {names[0]}")
    return float(torch.tensor(peers).median())


def exl3_weights(ckpt, sens: Sensitivity) -> dict[str, float]:
    """{HF name: ½·mean(G)} of every budgeted EXL3 Linear: the factor its trellis loss tr(ΔW·C·ΔWᵀ) is weighted
    with (routed experts: with their routing-weighted C, as `measure_curves` measures them)."""
    out = {}
    for us in budget_units(ckpt).values():
        for u in us:
            w = unit_weight(ckpt, sens, u.hf_names)
            for n in u.hf_names:
                out[n] = w
    return out


def exl3_stream_curves(ckpt, sens: Sensitivity, calibration: Sequence[str] | None = None, *,
                       device: str | None = None, strips="auto", experts="auto",
                       progress: bool = True) -> dict[str, dict[float, float]]:
    """EXL3 curves {unit: {bits: predicted KLD}}: the trellis curves (`measure_curves`) with every matrix's loss
    weighted by ½·mean(G) of its rows."""
    return measure_curves(ckpt, calibration, device=device, strips=strips, experts=experts,
                          weights=exl3_weights(ckpt, sens), progress=progress)


def gguf_row_weights(ckpt, sens: Sensitivity, include_mtp: bool = True,
                     ladder: str = "k") -> dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    """{GGUF name: ½·G per row} ((rows,), or (E, rows) for an expert stack) of every budgeted GGUF tensor;
    token_embd: (½·row weights (vocab,), column weights (hidden,))."""
    out: dict = {}
    for name, (spec, _) in measured_units(ckpt, include_mtp, ladder).items():
        if spec.role == "embed":
            out[name] = (0.5 * sens.embed_rows, sens.embed_cols)
            continue
        g = [0.5 * sens.rows[n] if n in sens.rows else
             torch.full((int(ckpt.shape(n)[0]),), unit_weight(ckpt, sens, [n]), dtype=torch.float64)
             for n in spec.hf_names]
        out[name] = torch.stack(g) if spec.transform == "stack" else g[0]
    return out


def gguf_stream_curves(ckpt, sens: Sensitivity, calibration: Sequence[str] | None = None, *, ladder: str = "k",
                       rounding: str = "exact", imatrix: Mapping | None = None, device: str | None = None,
                       cache=None, progress: bool = True) -> dict[str, dict[float, float]]:
    """GGUF curves {unit: {bpw: predicted KLD}}: every budgeted tensor encoded at every ladder type with the
    conversion's rounding and imatrix (measurement/gguf_errors.py), its error weighted per row by ½·G."""
    m = measure_gguf_errors(ckpt, calibration, ladder=ladder, rounding=rounding, imatrix=imatrix, device=device,
                            cache=cache, row_weights=gguf_row_weights(ckpt, sens, ladder=ladder),
                            progress=progress)
    return m.curves


def stream_curves(ckpt, fmt: str, calibration: Sequence[str] | None = None, *, sample="auto",
                  device: str | None = None, rounding: str = "exact", imatrix: Mapping | None = None,
                  gguf_ladder: str = "k", cache=None, seed: int = 0,
                  progress: bool = True) -> dict[str, dict[float, float]]:
    """`--measure stream`: the sensitivity (`stream_sensitivity`), then the format's weighted curves."""
    sens = stream_sensitivity(ckpt, calibration, device=device, seed=seed, progress=progress)
    if fmt == "gguf":
        return gguf_stream_curves(ckpt, sens, calibration, ladder=gguf_ladder, rounding=rounding, imatrix=imatrix,
                                  device=device, cache=cache, progress=progress)
    strips, experts = parse_sample(sample)
    return exl3_stream_curves(ckpt, sens, calibration, device=device, strips=strips, experts=experts,
                              progress=progress)
