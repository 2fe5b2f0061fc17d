"""Block-output tuning of the level codes inside ggml blocks: signed gradient descent through rounding.

Hessian rounding (:mod:`hessian_rounding`) minimises each Linear's own output error for the inputs the source model
gives it. What the quantized model computes differs in two ways that a per-Linear objective does not see: a
decoder layer's Linears act together, through attention, routing and the gated MLP, and the layer reads the
quantized model's hidden streams, not the source's. Tuning closes both gaps the way AutoRound (Cheng et al. 2023)
does: the codes of every tensor of a decoder layer move together to lower the mean squared error between the
layer's output on the *quantized* model's input and the *source* layer's output on the source input.

Each tensor keeps the scales, mins and super-scales its encoder chose (the grid ``step·value(c) + base`` of
:func:`ggml_levels.level_grid`), so the bytes stay a valid block of the same ggml type. Its codes are relaxed to a
real ``u`` (one per weight) that decodes through ``round`` with a straight-through gradient. ``u`` starts at the
encoded code, moved towards the source weight's own position on the grid but never across a rounding boundary
(``START_REACH`` of a step): the encoder's choice stands, and the codes that a small push flips first are those
the encoder chose against the weight's nearest level. :func:`sign_descent` then moves every ``u`` by
``lr·sign(grad)`` with a linearly decaying ``lr`` (AutoRound's schedule), so a code changes only where the loss
keeps asking for it; a held-out score picks the best of a few points along the way.

Numerics in torch on the device of the weights; nothing here reads or writes files.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from . import levels as gl
from .hessian_rounding import dequantize_blocks

TUNABLE = gl.SCALAR_TYPES      # one level per weight (affine or IQ4_NL's table); the lattice i-quants keep their codes
START_REACH = 0.499            # how far towards the source weight a code's relaxation starts (in steps)
# types whose fp16 scale is the only scale of a 32-weight block, at 4-5 bits: learning it moves every weight of the
# block (the K-quants' super-scale is shared by sub-blocks whose own scales the Hessian refit chose; Q8_0's steps are
# too fine for its scale to matter)
SCALE_TUNED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL")


class LevelCodes:
    """The codes of one encoded ggml tensor as a differentiable parameter on its fixed grid.

    blocks: the encoded tensor (..., bytes per row) of type `qtype` (one of ``TUNABLE``); weights: the source
    weights (..., row) it encodes, for the start of the relaxation. scales: also learn every block's fp16
    super-scales (d, and dmin / m), as a relative change ``scale`` per block and super-scale, rounded to fp16 in the
    forward pass (straight through) and written to the blocks; the packed sub-block scales stay."""

    def __init__(self, blocks: np.ndarray, qtype: str, weights: torch.Tensor, device: str | torch.device = "cpu",
                 *, scales: bool = False):
        self.qtype = qtype
        self.source = np.ascontiguousarray(blocks)
        self.lo, self.hi = gl.CODE_RANGE[qtype]
        step, base = gl.level_grid(self.source, qtype)
        decoded = dequantize_blocks(self.source, qtype)
        self.step = torch.from_numpy(step).to(device)
        self.base = torch.from_numpy(base).to(device)
        live = self.step != 0
        safe = torch.where(live, self.step, torch.ones_like(self.step))
        c0 = gl.nearest_codes((torch.from_numpy(decoded).to(device) - self.base) / safe, qtype)
        self.start = torch.where(live, c0, torch.zeros_like(c0))
        x = gl.code_positions((weights.to(device, torch.float32).reshape(self.step.shape) - self.base) / safe, qtype)
        reach = (x - self.start).clamp(-START_REACH, START_REACH)
        self.u = torch.where(live, self.start + reach, self.start).requires_grad_(True)
        self.scale = None
        if scales:
            sup = gl.super_scales(self.source, qtype)                          # (..., blocks, k)
            units = []  # the grid of each super-scale alone: step and base are linear in the super-scales
            for i in range(sup.shape[-1]):
                unit = np.zeros_like(sup)
                unit[..., i] = 1.0
                units.append(gl.level_grid(gl.set_super_scales(self.source, qtype, unit), qtype))
            self.unit_step = torch.from_numpy(np.stack([g[0] for g in units], -1)).to(device)  # (..., row, k)
            self.unit_base = torch.from_numpy(np.stack([g[1] for g in units], -1)).to(device)
            self.sup0 = torch.from_numpy(sup).to(device)
            self.block = self.unit_step.shape[-2] // sup.shape[-2]
            self.scale = torch.zeros_like(self.sup0, requires_grad=True)

    @property
    def params(self) -> list[torch.Tensor]:
        """The tensors the descent moves: the relaxed codes, and the relative super-scale changes when learned."""
        return [self.u] if self.scale is None else [self.u, self.scale]

    def super_scales(self) -> torch.Tensor:
        """The learned super-scales as the file holds them (fp16 values, float32 tensor; no gradient)."""
        s = (self.sup0 * (1.0 + self.scale.detach())).clamp(-65504.0, 65504.0)
        return s.to(torch.float16).to(torch.float32)

    def _grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scale is None:
            return self.step, self.base
        s = (self.sup0 * (1.0 + self.scale)).clamp(-65504.0, 65504.0)
        s = s + (s.to(torch.float16).to(torch.float32) - s).detach()          # the file holds fp16
        s = s.repeat_interleave(self.block, dim=-2)                             # (..., row, k)
        return (self.unit_step * s).sum(-1), (self.unit_base * s).sum(-1)

    def dequantized(self) -> torch.Tensor:
        """The decoded weights of the current codes; gradients reach ``u`` straight through the rounding (through
        the piecewise-linear interpolation of the level values where they are a table)."""
        step, base = self._grid()
        if self.qtype not in gl.LEVEL_TABLES:
            r = self.u + (torch.round(self.u) - self.u).detach()
            return step * r.clamp(self.lo, self.hi) + base
        soft = gl.interpolated_values(self.u, self.qtype)
        hard = gl.code_values(self.codes(), self.qtype)
        return step * (soft + (hard - soft).detach()) + base

    def codes(self) -> torch.Tensor:
        return torch.round(self.u.detach()).clamp(self.lo, self.hi)

    def changed(self) -> float:
        """Share of the codes that differ from the encoded ones."""
        return float((self.codes() != self.start).double().mean())

    def blocks(self) -> np.ndarray:
        """The encoded tensor with the current codes (and learned super-scales; sizes unchanged)."""
        src = self.source
        if self.scale is not None:
            src = gl.set_super_scales(src, self.qtype, self.super_scales().cpu().numpy())
        return gl.set_levels_on(src, self.qtype, self.codes())


def sign_descent(params: Sequence[torch.Tensor], loss: Callable[[object], torch.Tensor], batches: Sequence,
                 iters: int, lr: float | Sequence[float], *, score: Callable[[], float] | None = None,
                 checks: int = 4) -> tuple[float, float] | None:
    """``iters`` steps of u -= lr_t·sign(∂loss/∂u) over `batches` in turn, lr_t decaying linearly from
    ``lr / iters`` to 0 (so no parameter moves more than ``lr / 2`` in all). `lr`: one rate, or one per parameter.

    With `score` (a held-out loss of the current parameters, no gradient), it is taken at the start and after
    every ``iters / checks`` steps, and the parameters end at the point that scored best (the start included:
    a descent that over-fits the batches is undone). Returns (score at the start, best score) then."""
    marks = {round(iters * k / checks) for k in range(1, checks + 1)} if score is not None else set()
    best = first = score() if score is not None else None
    kept = [p.detach().clone() for p in params] if score is not None else None
    rates = [float(lr)] * len(params) if np.ndim(lr) == 0 else [float(r) for r in lr]
    for it in range(iters):
        value = loss(batches[it % len(batches)])
        for p in params:
            p.grad = None
        value.backward()
        with torch.no_grad():
            for p, rate in zip(params, rates):
                if p.grad is not None:
                    p.sub_(rate / iters * (1.0 - it / iters) * torch.sign(p.grad))
        if it + 1 in marks:
            now = score()
            if now < best:
                best = now
                for k, p in zip(kept, params):
                    k.copy_(p.detach())
    for p in params:
        p.grad = None
    if score is None:
        return None
    with torch.no_grad():
        for k, p in zip(kept, params):
            p.copy_(k)
    return first, best
