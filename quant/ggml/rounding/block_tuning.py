"""Block-output tuning of the level codes inside ggml blocks: signed gradient descent through rounding.

Hessian rounding (:mod:`rounding.hessian`) minimises each Linear's own output error for the inputs the source model
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

The IQ2 types (:class:`IQ2Codes`) have no grid per weight: a group of 8 weights takes one of 1024 (IQ2_S) or 512
(IQ2_XS) magnitude tuples (each magnitude one of 8, 25, 43) and 8 signs (IQ2_XS: an even count of negatives).
Each weight's sign and magnitude is one position on the signed table (-43, -25, -8, 8, 25, 43), relaxed like
IQ4_NL's levels; a group decodes to its rounded positions where they form a
codebook tuple, else to the codebook entry nearest to its relaxed values; an IQ2_XS group with an odd count of
negatives flips the weight whose relaxed value lies nearest to zero (weighted by its magnitude).

Numerics in torch on the device of the weights (the IQ2 decode in one Triton kernel where it serves:
:mod:`triton_kernels.iq2_decode`); nothing here reads or writes files.
"""
from __future__ import annotations

import warnings
from functools import lru_cache
from typing import Callable, Sequence

import numpy as np
import torch

from mixq.errors import InputError
from mixq.quant.ggml.rounding import levels as gl
from mixq.quant.ggml.triton_kernels import iq2_decode as triton_iq2_decode, iq2s as triton_iq2s
from mixq.quant.ggml.triton_kernels.search import use_fused

# one level per weight (affine or the IQ4 table), and the IQ2 types' codebook groups; the other lattice i-quants
# keep their codes
TUNABLE = gl.SCALAR_TYPES + gl.IQ2_TYPES
DEFAULT_CHECKS = 4             # held-out checks of a descent with a score, evenly spaced, the last at its end
START_REACH = 0.499            # how far towards the source weight a code's relaxation starts (in steps)
# types whose fp16 scale is the only scale of a 32-weight block, at 4-5 bits: learning it moves every weight of the
# block (the K-quants' super-scale is shared by sub-blocks whose own scales the Hessian refit chose; Q8_0's steps are
# too fine for its scale to matter)
SCALE_TUNED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL")
IQ2_SEARCH_GROUPS = 1 << 15    # groups per codebook search: a (groups, 1024) float32 score table of 128 MiB at most
# the IQ2 types whose decode searches the codebook near each group's best tuple first on the CPU
# (IQ2Codes.neighbour_entries): on the CPU it made IQ2_S's decode faster (bench/speed/iq2_tuning_decode.py).
# IQ2_XS's codebook (512 entries) is cheaper to score whole, and the bound leaves a third of its groups to that full
# search (no faster either way), so it scores them. On a GPU the neighbour search was slower than the score table,
# and the fused search streams the codebook through registers instead (IQ2Codes.fused_entries)
IQ2_NEIGHBOUR_TYPES = ("IQ2_S",)
IQ2_NEIGHBOUR_GROUPS = 1 << 19  # groups per neighbour search: about a kilobyte of transients a group at most
# how far below the bound of the entries two or more magnitudes away the best neighbour must score to be taken
# without the full search (the scores are sums of squares up to about 8·43²: float32 rounds them to about 1e-3)
IQ2_NEIGHBOUR_MARGIN = 1e-2
# (IQ2 type, device) -> whether the one-kernel decode (triton_iq2_decode) serves there: decided on first use, by
# checking it beside the eager decode on random groups (IQ2Codes.fused_decode_ok)
FUSED_DECODE: dict[tuple[str, str], bool] = {}
FUSED_DECODE_CHECK_GROUPS = 1 << 14
# how far a group's squared distance to its interpolated values may lie from the eager decode's (float32 rounding of
# sums up to about 8·43²; an exact tie between codebook entries gives the same distance either way)
FUSED_DECODE_TOLERANCE = 1e-2


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
        # on the tuning device: reading a 288-expert layer's Q2_K experts off on the host is slow
        self.step, self.base = gl.level_grid_on(self.source, qtype, device)
        decoded = gl.decode_blocks(self.source, qtype, device)
        live = self.step != 0
        safe = torch.where(live, self.step, torch.ones_like(self.step))
        c0 = gl.nearest_codes((decoded - self.base) / safe, qtype)
        del decoded
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
                units.append(gl.level_grid_on(gl.set_super_scales(self.source, qtype, unit), qtype, device))
            self.unit_step = torch.stack([g[0] for g in units], -1)               # (..., row, k)
            self.unit_base = torch.stack([g[1] for g in units], -1)
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


@lru_cache(maxsize=None)
def _iq2_tables(qtype: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An IQ2 type's (grid (entries, 8), signed levels (6,), entry (3^8,) int64 of every magnitude tuple: -1 where
    it is not in the codebook) on `device`. A tuple's key is Σ_i m_i·3^i, m_i the magnitude's rank (0: 8, 1: 25,
    2: 43)."""
    grid = gl.iq2_grid(qtype)
    mags = np.unique(grid)
    keys = np.searchsorted(mags, grid) @ (len(mags) ** np.arange(8))
    entry = np.full(len(mags) ** 8, -1, np.int64)
    entry[keys] = np.arange(len(grid))
    return tuple(torch.from_numpy(a).to(device) for a in (grid, gl.iq2_levels(qtype), entry))


class IQ2Codes:
    """The codebook groups of one encoded IQ2 tensor (IQ2_S, IQ2_XS) as a differentiable parameter; scales fixed.

    Same interface as :class:`LevelCodes`. ``u`` (one per weight, in positions of the signed table
    ``gl.iq2_levels``, so a learning rate reaches as many level steps as for a scalar type) starts at the
    encoded group's sign and magnitude, moved towards the source weight by at most ``START_REACH``. A group decodes
    to its rounded positions where their magnitudes form a codebook tuple (then the nearest codebook point), else
    to the codebook entry nearest to its interpolated values with their signs (IQ2_XS: made even by flipping the
    weight of least |value|·magnitude); gradients reach ``u`` straight through. blocks: (..., bytes per row) of
    `qtype`; weights: the source weights (..., row)."""

    def __init__(self, blocks: np.ndarray, qtype: str, weights: torch.Tensor, device: str | torch.device = "cpu",
                 *, scales: bool = False):
        if qtype not in gl.IQ2_LAYOUTS or scales:
            raise InputError(f"IQ2Codes tunes IQ2 codes only (no scales), not {qtype!r} (scales={scales})")
        self.qtype = qtype
        self.source = np.ascontiguousarray(blocks)
        dev = torch.device(device)
        self.parity = gl.IQ2_LAYOUTS[qtype].parity
        self.grid, self.levels, self.entry = _iq2_tables(qtype, dev)
        self.mags = self.levels.shape[0] // 2   # magnitudes per sign (3); positions below it are negative
        self.rank_key = self.mags ** torch.arange(8, device=dev)             # a tuple's key: Σ rank_i·3^i
        self.norms = (self.grid * self.grid).sum(-1)                       # Σc² of each entry, for the searches
        self.magnitudes = self.levels[self.mags:]                          # (8, 25, 43), ascending
        self.bits = 2 ** torch.arange(8, device=dev)
        self.unit_metric = torch.ones(1, 8, device=dev)
        self.index0, self.signs0 = gl.iq2_groups_on(self.source, qtype, dev)
        self.db = gl.iq2_group_scales_on(self.source, qtype, dev).unsqueeze(-1)        # (..., groups, 1)
        self.shape = tuple(self.db.shape[:-2]) + (self.db.shape[-2] * 8,)
        start = self._positions(self.index0, self.signs0)                          # (..., groups, 8)
        live = self.db != 0
        safe = torch.where(live, self.db, torch.ones_like(self.db))
        x = gl.table_positions(weights.to(dev, torch.float32).reshape(start.shape) / safe, self.levels)
        # kept on the table: past an end the interpolation has no gradient, and a u there could never move back
        u = (start + (x - start).clamp(-START_REACH, START_REACH)).clamp(0, self.levels.shape[0] - 1)
        self.u = torch.where(live, u, start).reshape(self.shape).requires_grad_(True)

    @property
    def params(self) -> list[torch.Tensor]:
        """The tensors the descent moves: the relaxed positions."""
        return [self.u]

    def _positions(self, index: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
        """(..., groups, 8) float positions on the signed table of the groups' (codebook index, sign byte)."""
        neg = (signs.unsqueeze(-1) & self.bits) != 0
        signed = torch.where(neg, -self.grid[index], self.grid[index])
        return gl.table_nearest(signed, self.levels)

    def _grouped(self) -> torch.Tensor:
        return self.u.view(*self.db.shape[:-1], 8)

    def nearest_entries(self, target: torch.Tensor) -> torch.Tensor:
        """Codebook index (n,) nearest to |target| (n, 8): smallest Σc² − 2·Σ|t|·c (the unit-metric case of
        ``rounding.hessian.nearest_iq2_entries``). Most groups take it at every step once the codes move (their
        rounded magnitudes are no codebook tuple), and scoring every entry was most of the decode. Where the fused
        Triton kernels run, one kernel streams the codebook (:meth:`fused_entries`); on the CPU the types of
        ``IQ2_NEIGHBOUR_TYPES`` search near each group's best tuple first (:meth:`neighbour_entries`); elsewhere
        every entry is scored (:meth:`scored_entries`)."""
        if use_fused(target):
            return self.fused_entries(target)
        if target.device.type == "cpu" and self.qtype in IQ2_NEIGHBOUR_TYPES:
            return self.neighbour_entries(target)
        return self.scored_entries(target)

    def fused_entries(self, target: torch.Tensor) -> torch.Tensor:
        """:meth:`nearest_entries` in one Triton kernel that keeps each group's best entry in registers as it
        streams the codebook (``triton_iq2s``, the Hessian rounding's search in a unit metric): no score table.
        Its sums run in index order, so near-ties (within float32 rounding) may go to the other entry."""
        if not target.shape[0]:
            return torch.zeros(0, dtype=torch.long, device=target.device)
        n = target.shape[0]
        one = torch.ones(1, n, 1, dtype=torch.float32, device=target.device)
        return triton_iq2s.nearest_entries(one, self.unit_metric, target.reshape(1, n, 8), self.grid, 1).view(n)

    def neighbour_entries(self, target: torch.Tensor) -> torch.Tensor:
        """:meth:`nearest_entries` searched near each group's best tuple, in chunks. The score is a sum over the 8
        weights, so the tuple of each weight's nearest magnitude scores least, and every other tuple scores more by
        the sum of its weights' excesses. The codebook entries that differ from that tuple in at most one weight's
        magnitude are scored from those excesses; every other entry scores at least the two smallest excesses
        more, so where the best near entry scores below that bound (by ``IQ2_NEIGHBOUR_MARGIN``) it is the
        nearest entry; the groups that bound leaves open are scored against every entry. Ties go to the lower
        index, as in a full search; the answer differs from :meth:`scored_entries` only where two entries' scores
        tie within float32 rounding. (Searching the open groups again two magnitudes out took longer on the CPU
        than scoring them.)"""
        if not target.shape[0]:
            return torch.zeros(0, dtype=torch.long, device=target.device)
        return torch.cat([self._neighbour_chunk(t) for t in target.split(IQ2_NEIGHBOUR_GROUPS)])

    def _neighbour_chunk(self, target: torch.Tensor) -> torch.Tensor:
        score = self.magnitudes * self.magnitudes - 2 * target.abs().unsqueeze(-1) * self.magnitudes  # (n, 8, 3)
        low, rank = score.min(-1)
        excess = score - low.unsqueeze(-1)                               # 0 at each weight's best magnitude
        key = (rank * self.rank_key).sum(-1)                             # the best tuple's
        ranks = torch.arange(self.mags, device=target.device)
        near = self.entry[key[:, None, None] + (ranks - rank.unsqueeze(-1)) * self.rank_key[:, None]]
        index, best = _lowest(excess.flatten(1), near.flatten(1), self.grid.shape[0])
        others = excess.masked_fill(ranks == rank.unsqueeze(-1), float("inf")).min(-1).values
        open_ = ~(best < others.topk(2, -1, largest=False).values.sum(-1) - IQ2_NEIGHBOUR_MARGIN)
        if bool(open_.any()):
            index[open_] = self.scored_entries(target[open_])
        return index

    def scored_entries(self, target: torch.Tensor) -> torch.Tensor:
        """:meth:`nearest_entries` by scoring every entry, as one addmm per chunk that bounds the score table."""
        return torch.cat([torch.addmm(self.norms, t.abs(), self.grid.T, alpha=-2).argmin(-1)
                          for t in target.split(IQ2_SEARCH_GROUPS)])

    def _rounded_entries(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The codebook index (..., groups) of the rounded positions of `u` (-1 where their magnitudes form no
        codebook tuple) and their negative weights (..., groups, 8)."""
        r = torch.round(u).clamp_(0, self.levels.shape[0] - 1)
        neg = r < self.mags
        rank = torch.where(neg, self.mags - 1 - r, r - self.mags)
        return self.entry[(rank.long() * self.rank_key).sum(-1)], neg

    @torch.no_grad()
    def missing(self) -> torch.Tensor:
        """(..., groups) bool: the groups whose rounded positions are no codebook tuple, which the decode searches
        the codebook for (:meth:`nearest_entries`) at every step."""
        return self._rounded_entries(self._grouped())[0] < 0

    def _groups(self, values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The codebook index (..., groups) int64, the negative weights (..., groups, 8) and the entries'
        magnitudes (..., groups, 8) of the current ``u``, as the file will hold them. `values`: the interpolated
        signed levels of ``u`` when the caller has them (detached), else computed here where needed. Where the
        one-kernel decode serves, the groups are read off its values, so that the file holds what the loss saw."""
        u = self._grouped().detach()
        if self._one_kernel(u):
            with torch.no_grad():
                hard = self._fused_hard(u, gl.table_values(u, self.levels) if values is None else values)
                mags = hard.abs()
                rank = (mags.unsqueeze(-1) > self.magnitudes[:-1]).sum(-1)       # 0, 1, 2: 8, 25, 43
                return self.entry[(rank * self.rank_key).sum(-1)], hard < 0, mags
        return self._eager_groups(u, values)

    def _eager_groups(self, u: torch.Tensor, values: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`_groups` of relaxed positions `u` (..., groups, 8) in torch ops."""
        with torch.no_grad():
            u = u.detach()
            index, neg = self._rounded_entries(u)
            miss = index < 0
            if bool(miss.any()):  # the rounded magnitudes are no codebook tuple: the entry nearest to the relaxation
                index[miss] = self.nearest_entries(gl.table_values(u[miss], self.levels) if values is None
                                                   else values[miss])
            mags = self.grid[index]
            if self.parity:
                neg = gl.even_sign_flip(neg, (gl.table_values(u, self.levels) if values is None else values).abs()
                                        * mags)[0]
            return index, neg, mags

    def dequantized(self) -> torch.Tensor:
        """The decoded weights of the current groups (..., row); gradients reach ``u`` straight through, along the
        interpolated signed levels. The values are exactly the file's: the relaxation enters as soft − soft. Where
        the fused Triton kernels run and pass their check, one kernel decodes the groups
        (:mod:`triton_kernels.iq2_decode`)."""
        u = self._grouped()
        soft = gl.table_values(u, self.levels)
        detached = soft.detach()
        if self._one_kernel(detached):
            hard = self._fused_hard(u.detach(), detached)
        else:
            _, neg, mags = self._eager_groups(u, detached)
            hard = torch.where(neg, -mags, mags)
        return (self.db * (hard + (soft - detached))).reshape(self.shape)

    def _one_kernel(self, x: torch.Tensor) -> bool:
        """Whether the one-kernel decode serves the groups (on the device of `x`)."""
        return use_fused(x) and self.fused_decode_ok()

    def _fused_hard(self, u: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return triton_iq2_decode.decode(u.reshape(-1, 8), values.reshape(-1, 8), self.entry, self.grid, self.norms,
                                        self.mags, self.parity).view(values.shape)

    def fused_decode_ok(self) -> bool:
        """Whether the one-kernel decode serves this type on this device: decided on its first use there, beside
        the eager decode on random groups (about half of them codebook tuples, the rest searched): each group's
        decoded values must lie as near its interpolated values as the eager decode's (within
        ``FUSED_DECODE_TOLERANCE``: tied entries may differ). A compile error or a farther group keeps the eager
        decode (with a warning)."""
        key = (self.qtype, str(self.u.device))
        if key not in FUSED_DECODE:
            FUSED_DECODE[key] = False
            try:
                with torch.no_grad():
                    g = torch.Generator().manual_seed(0)
                    n = FUSED_DECODE_CHECK_GROUPS
                    tuples = self._positions(torch.randint(0, self.grid.shape[0], (n,), generator=g).to(self.u.device),
                                             torch.randint(0, 256, (n,), generator=g).to(self.u.device))
                    anywhere = torch.rand(n, 8, generator=g).to(self.u.device) * (2 * self.mags) - 0.5
                    u = torch.cat([tuples + (torch.rand(n, 8, generator=g).to(tuples.device) - 0.5) * 0.9, anywhere])
                    values = gl.table_values(u, self.levels)
                    _, neg, mags = self._eager_groups(u, values)
                    eager = torch.where(neg, -mags, mags)
                    fused = self._fused_hard(u, values)
                    gap = float(((values.double() - fused.double()).square().sum(-1)
                                 - (values.double() - eager.double()).square().sum(-1)).abs().max())
                ok = gap <= FUSED_DECODE_TOLERANCE
                if not ok:
                    warnings.warn(f"block tuning: the fused {self.qtype} decode lies {gap:.3g} farther from a group's "
                                  f"values than the eager one on {self.u.device}; using the eager decode")
                FUSED_DECODE[key] = ok
            except Exception as exc:  # noqa: BLE001 - a compile or launch failure: the eager decode is always right
                warnings.warn(f"block tuning: the fused {self.qtype} decode is unavailable on {self.u.device} "
                              f"({exc!r}); using the eager decode")
        return FUSED_DECODE[key]

    def codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codebook index, sign byte) (..., groups) of the current ``u``."""
        index, neg, _ = self._groups()
        return index, (neg.long() * self.bits).sum(-1)

    def changed(self) -> float:
        """Share of the groups whose codebook index or signs differ from the encoded ones."""
        index, signs = self.codes()
        return float(((index != self.index0) | (signs != self.signs0)).double().mean())

    def blocks(self) -> np.ndarray:
        """The encoded tensor with the current groups (scales and size unchanged)."""
        return gl.set_iq2_groups_on(self.source, self.qtype, *self.codes())


def _lowest(cost: torch.Tensor, entries: torch.Tensor, none: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the lowest entry index among the candidates of least cost, and that cost; candidates whose entry is
    -1 (no codebook tuple) do not count (index `none`, cost inf where a row has none)."""
    valid = entries >= 0
    cost = torch.where(valid, cost, torch.full_like(cost, float("inf")))
    best = cost.min(-1, keepdim=True).values
    index = torch.where((cost == best) & valid, entries, torch.full_like(entries, none)).min(-1).values
    return index, best.squeeze(-1)


def tunable_codes(blocks: np.ndarray, qtype: str, weights: torch.Tensor, device: str | torch.device = "cpu", *,
                  scales: bool = False) -> LevelCodes | IQ2Codes:
    """The differentiable codes of an encoded tensor of a ``TUNABLE`` type: the IQ2 types' codebook groups, else
    one level per weight (arguments as :class:`LevelCodes`)."""
    if qtype in gl.IQ2_LAYOUTS:
        return IQ2Codes(blocks, qtype, weights, device, scales=scales)
    return LevelCodes(blocks, qtype, weights, device, scales=scales)


def sign_descent(params: Sequence[torch.Tensor], loss: Callable[[object], torch.Tensor], batches: Sequence,
                 iters: int, lr: float | Sequence[float], *, score: Callable[[], float] | None = None,
                 checks: int = DEFAULT_CHECKS, start: float | None = None) -> tuple[float, float] | None:
    """``iters`` steps of u -= lr_t·sign(∂loss/∂u) over `batches` in turn, lr_t decaying linearly from
    ``lr / iters`` to 0 (so no parameter moves more than ``lr / 2`` in all). `lr`: one rate, or one per parameter.

    With `score` (a held-out loss of the current parameters, no gradient), it is taken at the start and after
    every ``iters / checks`` steps, and the parameters end at the point that scored best (the start included:
    a descent that over-fits the batches is undone). `start`: the start's score when the caller has it (a stage
    that begins where the one before ended), in place of the first call. Returns (score at the start, best score)
    then."""
    marks = {round(iters * k / checks) for k in range(1, checks + 1)} if score is not None else set()
    best = first = (score() if start is None else float(start)) if score is not None else None
    kept = [p.detach().clone() for p in params] if score is not None else None
    rates = [float(lr)] * len(params) if np.ndim(lr) == 0 else [float(r) for r in lr]
    for it in range(iters):
        value = loss(batches[it % len(batches)])
        for p in params:
            p.grad = None
        if value.requires_grad:  # else nothing moving reaches this batch's loss (no token routed to an expert group)
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
