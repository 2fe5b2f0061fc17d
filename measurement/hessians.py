"""Input Hessians of the GGUF tensors, layer by layer, from the calibration forward (runtime/calibration.py).

`layer_hessians(ckpt, specs, input_ids)` walks transformers' glm5_next decoder one layer at a time (full Σx·xᵀ
statistics) and yields, per stage, a `StageHessians`: `get(spec)` gives H = E[x·xᵀ] of the input of a GGUF
tensor, (n, n), or for a routed-expert stack `experts(spec, e0, e1)` gives one Hessian per expert, (e1-e0, n, n).

Routed experts: the calibrator sends every token through every expert, but the model feeds expert e only its
routed tokens, scaled by the gate g_te. The output error the model sees is therefore weighted by
R_e = Σ_t g_te²·x_t·x_tᵀ / N (x_t: the expert's input; for down_proj its activation); that is what `experts()`
returns, blended with the all-token Hessian (`ALL_TOKEN_SHARE` times its trace-normalised value) so that
an expert with few routed tokens still has a well-posed problem. Experts are formed in the caller's slices so
that memory stays bounded by one slice of per-expert Hessians (GLM-5.3: 288 experts of width 6144).

Tensors without a Hessian (token_embd, the split attn_k_b/attn_v_b, the NextN block: the calibration forward does
not form their inputs) are not covered; callers encode them the usual way.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from mixq.errors import InputError
from mixq.runtime import profile
from mixq.runtime.calibration import LayerCalibrator, RoutingCapture, capture_routing, expert_activation

# weight of the (trace-normalised) all-token Hessian in each routed expert's Hessian: per-expert routed statistics
# from a few thousand tokens over-fit (k256, held-out Hessians: down_exps error 1.08x exact at 0.05, 0.96x at 1)
# damping of H (relative to its mean diagonal) and coordinate-descent passes after the feedback walk: measured on
# k256 with held-out Hessians (bench/quality/gguf_quality.py), 0.1 and 3 generalise better than GPTQ's usual 0.01 and none
DAMP = 0.1
REFINE_PASSES = 3
ROUNDINGS = ("exact", "hessian")  # GGUF --rounding: ggml's encoder, or codes chosen by each layer's output error
ALL_TOKEN_SHARE = 1.0


def _normalised(h: torch.Tensor) -> torch.Tensor:
    """H / mean(diag H) (per matrix): the scale of H does not change the rounding, only the blend does."""
    tr = torch.diagonal(h, dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)
    return h / tr[..., None, None]


@dataclass
class StageHessians:
    """The Hessians of one calibrated stage (a decoder layer, or the head)."""

    layer: int | None
    stats: dict
    capture: RoutingCapture | None = None
    _routed: tuple | None = field(default=None, repr=False)
    module: torch.nn.Module | None = field(default=None, repr=False)  # the calibration's source layer

    @contextmanager
    def lent_layer(self) -> Iterator[torch.nn.Module | None]:
        """The calibration's decoder layer with its source weights, lent until the block exits (its routing capture
        paused, so the borrower's calls keep nothing): the borrower may overwrite its weights, which the walk does
        not read again. None for the head stage."""
        if self.capture is not None:
            self.capture.paused = True
        try:
            yield self.module
        finally:
            if self.capture is not None:
                self.capture.paused = False

    def get(self, spec) -> torch.Tensor | None:
        """H (n, n) float32 of a GGUF tensor made of one Linear, or None when the forward never formed its input."""
        if spec.transform != "none" or len(spec.hf_names) != 1:
            return None
        acc = self.stats.get(spec.hf_names[0])
        if acc is None or acc.dim != spec.shape[-1]:
            return None
        return acc.hessian()

    @torch.no_grad()
    def experts(self, spec, e0: int, e1: int) -> torch.Tensor | None:
        """Routing-weighted Hessians (e1-e0, n, n) of experts e0..e1-1 of a stacked `*_exps` tensor (see module)."""
        got = self._routed_pairs(spec, e0, e1)
        if got is None:
            return None
        out = []
        for e, r in zip(range(e0, e1), got):
            all_tok = self.stats[spec.hf_names[e]].hessian().to(r.device if r is not None else "cpu")
            out.append(_normalised(r) + ALL_TOKEN_SHARE * _normalised(all_tok) if r is not None else
                       _normalised(all_tok))
        return torch.stack(out)

    @torch.no_grad()
    def routed(self, spec, e0: int, e1: int) -> torch.Tensor | None:
        """R_e = Σ_t g_te²·x_t·x_tᵀ / N (e1-e0, n, n) of experts e0..e1-1 of a stacked `*_exps` tensor, unblended
        and unnormalised: the covariance an expert's output error is weighted with (zero for an expert no token
        was routed to)."""
        got = self._routed_pairs(spec, e0, e1)
        if got is None:
            return None
        n = int(spec.shape[-1])
        return torch.stack([r if r is not None else torch.zeros(n, n) for r in got])

    def _routed_pairs(self, spec, e0: int, e1: int) -> list[torch.Tensor | None] | None:
        """Each expert's R_e (None for an expert without routed tokens), or None when the stage cannot form them."""
        if spec.transform != "stack" or self.capture is None or not self.capture.x:
            return None
        acc = self.stats.get(spec.hf_names[e0])
        if acc is None or acc.dim != spec.shape[-1] or acc.hessian() is None:
            return None
        if self._routed is None:
            self._routed = self.capture.routed(len(spec.hf_names))
        x, g = self._routed
        down = spec.hf_names[0].endswith("down_proj.weight")
        mod = self.capture.module
        out: list[torch.Tensor | None] = []
        for e in range(e0, e1):
            rows = g[:, e].nonzero().squeeze(1)
            if not rows.numel():
                out.append(None)
                continue
            xe = x[rows].to(mod.gate_up_proj.device)
            if down:
                xe = expert_activation(mod, e, xe)
            xg = xe.double() * g[rows, e:e + 1].to(xe.device, torch.float64)
            out.append((xg.T @ xg / max(x.shape[0], 1)).float())
        return out


def token_frequency(input_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """(vocab,) float64 count of each token id in the calibration rows."""
    return torch.bincount(input_ids.reshape(-1), minlength=vocab)[:vocab].double()


# weight of the residual path in the embedding metric, relative to the first layer's Linears (k256, Q4_K_M with
# llama.cpp's logits: 0 / 1 / 4 gave KLD 0.01464 / 0.01412 / 0.01390; exact ggml rounding of the embedding 0.01415)
EMBED_RESIDUAL = 4.0


@torch.no_grad()
def embedding_hessian(stage: StageHessians, ckpt, embed: torch.Tensor, freq: torch.Tensor) -> torch.Tensor | None:
    """A metric (hidden, hidden) for the rows of the token embedding, from the first decoder layer's stage.

    An embedding row has no input Hessian; what its error costs is what the first layer's Linears make of it. Every
    group of first-layer Linears that reads one normalised copy of the residual stream (one shared input
    accumulator of the hidden width: the attention projections, the FFN's gate/up) adds Dᵀ·WᵀW·D (normalised),
    where W stacks the group's weights and D maps an embedding error into that input: x = γ⊙h/rms(h), and γ² is
    read from the data as E[x²] / E[(h/rms)²] (h: the embedding rows, weighted by calibration frequency) instead of
    being looked up by name. Routed experts are left out (their routing would weigh them). The embedding error also
    flows on in the residual stream to every later layer, which the first layer's Linears do not see: an identity
    term (``EMBED_RESIDUAL`` times the mean diagonal) stands for it. None when the stage has no such group."""
    hidden = embed.shape[1]
    groups: dict[int, tuple] = {}
    for name, acc in stage.stats.items():
        if acc.dim != hidden or acc.hessian() is None or ckpt.info(name).role == "routed_expert":
            continue
        groups.setdefault(id(acc), (acc, []))[1].append(name)
    if not groups:
        return None
    e = embed.double()
    u = e * torch.rsqrt(e.square().mean(1, keepdim=True).clamp_min(1e-30))      # h / rms(h) per token
    w = freq.double().to(u.device)
    s = (u.square() * w[:, None]).sum(0) / w.sum().clamp_min(1.0)              # E[(h/rms)²] per dimension
    metric = torch.zeros(hidden, hidden, dtype=torch.float64)
    for acc, names in groups.values():
        d = torch.sqrt(torch.diagonal(acc.hessian()).double().cpu().clamp_min(0) / s.clamp_min(1e-30))
        wd = torch.cat([ckpt.get(n, dtype=torch.float32).double() for n in names]) * d[None, :]
        g = wd.T @ wd
        metric += g / torch.diagonal(g).mean().clamp_min(1e-30)
    metric += EMBED_RESIDUAL * torch.diagonal(metric).mean() * torch.eye(hidden, dtype=torch.float64)
    return metric.float()


def layer_hessians(ckpt, input_ids: torch.Tensor, *, device: str | torch.device = "cpu",
                   expert_group: int | None = None) -> Iterator[StageHessians]:
    """Walk the calibration forward (source weights) and yield each stage's Hessians (module docstring).
    `expert_group`: routed experts per group on the device (runtime/calibration.LayerCalibrator; the same
    Hessians).

    A stage's tensors must be consumed before the next item is requested: the layer's weights and captured
    routing are released when the walk moves on."""
    cal = LayerCalibrator(ckpt, input_ids, device=device, full=True, expert_group=expert_group)
    captures = capture_routing(cal)
    for stage in profile.timed("calibrate", cal.stages(),
                               lambda st: profile.walk_label(st.layer, ckpt.num_hidden_layers)):
        cap = captures.get(stage.layer) if stage.layer is not None else None
        yield StageHessians(stage.layer, stage.stats, cap, module=stage.module)
        if cap is not None:
            cap.clear()

def check_rounding(rounding: str) -> str:
    """The rounding mode, validated: one of ``ROUNDINGS``."""
    r = str(rounding).lower()
    if r not in ROUNDINGS:
        raise InputError(f"--rounding {rounding!r}: expected one of {', '.join(ROUNDINGS)}")
    return r
