"""GGUF `--rounding hessian`, second stage: block-output tuning of the encoded codes, one decoder layer at a time.

After a layer's tensors are Hessian-rounded (conversion/gguf/rounding.py), `LayerTuner.layer` moves the codes of
every tensor of that layer together (quant/ggml/rounding/block_tuning.py) so that the layer, run on the *quantized*
model's hidden streams, reproduces the *source* layer's output on the source streams (mean squared error over the
streams, calibration rows in batches). Two streams are carried from layer to layer: the source model's, and the
quantized model's as llama.cpp will run it (every tensor of the layer at its planned type: tuned codes, IQ2_S's
codebook groups among them, ggml's own encoding of the tensors Hessian rounding does not cover, floats rounded
to F16/BF16). The token embedding is tuned with the first layer (its error enters that layer's output through the
residual path); the output head with the KL divergence of the logits, after the last layer.

A held-out share of the rows (``CHECK_SHARE``) guards each stage: the codes end at the point of the descent where
their loss was lowest, the Hessian-rounded start included. Types and byte counts never change: the file's types
and bytes are those of the exact path. Sub-block scales and the K-quants' super-scales stay as the Hessian rounding
set them; the types whose only scale is one fp16 per 32 weights at 4-5 bits (Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL, where
128-wide rows send the K-quants) learn that scale with the codes (``SCALE_LR``), as AutoRound tunes its scales.

Routed experts that do not fit the memory budget beside the rest are tuned a group of experts at a time after the
layer's first stage, `group_iters` steps a group (fewer than the first stage's by default: a 288-expert layer has
several groups, and a group's step costs several of the first stage's).

Cost: `iters` forward and backward passes of one layer over `batch_rows` rows, per layer; memory:
``BYTES_PER_TUNED_WEIGHT`` per tuned weight of the layer besides the layer itself, and two hidden streams.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from mixq.conversion.gguf.workers import encode
from mixq.conversion.options import DEFAULT_TUNE_ITERS
from mixq.formats.gguf_layout import FLOAT_TYPES, block_shape
from mixq.formats.gguf_names import build_tensor, merge_kv_b, unbuild_tensor
from mixq.quant.device import same_device
from mixq.quant.ggml.rounding import block_tuning as bt
from mixq.quant.ggml.rounding import levels as gl
from mixq.runtime.layer_stream import (BATCH_ROWS, EMBED_NAME, HEAD_NAME, NORM_NAME, DecoderStream, layer_params,
                                       stack_rows, stacked_block, stacked_parts, write_values)
from mixq.runtime.overlap import ahead, host_empty

TUNE_LR = 1.0           # total reach of a code's relaxation: lr / 2 steps
SCALE_LR = 0.2          # total reach of a block scale's relative change (types in SCALE_TUNED): scale_lr / 2
CHECK_SHARE = 8         # one row in CHECK_SHARE is held out for the keep-the-best check (at least one batch)
# an expert group's stage takes iters / GROUP_ITERS_SHARE steps unless told: a 108 GB plan's MoE layer, its IQ2_S
# experts tuned, has 6 groups of about 1.2 G weights, and a group's step costs several of the first stage's
GROUP_ITERS_SHARE = 8
# held-out checks of an expert group's stage: its end only, against its start. On k256's 16 experts in 8 groups of
# 25 steps (IQ2_S), the end scored best of 4 checks in 7 groups and within 0.3% of the best in the other; at 288
# experts a check costs as much as one or two of its group's 25 steps
GROUP_CHECKS = 1
# per tuned weight: u, its gradient, the best point, the grid (step, base), the start, the decoded value and the
# rounding's transients, float32 each; a weight whose block scale is learned too counts twice (the grid of each
# scale alone, and the grid rebuilt at every step)
BYTES_PER_TUNED_WEIGHT = 40
DECODE_ROWS_WEIGHTS = 1 << 26  # weights decoded on the device at a time (bounds the decoder's transients)
_TORCH_FLOAT = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass
class StageReport:
    """What tuning did to one stage: the held-out loss before and after, whether it was kept, codes changed, the
    weights left at their Hessian rounding because the stage's tensors did not fit the memory budget, and the
    seconds of the descent (its held-out checks included)."""

    layer: int | None
    check_before: float
    check_after: float
    kept: bool
    changed: float
    held_weights: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        """One line for the progress output."""
        held = f", {self.held_weights:,} weights left at Hessian rounding for memory" if self.held_weights else ""
        return (f"tuned {'head' if self.layer is None else f'layer {self.layer}'}: held-out loss "
                f"{self.check_before:.4g} -> {self.check_after:.4g} ({'kept' if self.kept else 'reverted'}, "
                f"{100 * self.changed:.1f}% of codes changed{held})")


def tuning_budget(device: torch.device) -> int:
    """How many weights one stage may tune at once: a third of the free memory of `device` (host memory for the
    CPU), at ``BYTES_PER_TUNED_WEIGHT`` each."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(free // 3 // BYTES_PER_TUNED_WEIGHT)


def stored_values(qtype: str, weights: torch.Tensor, imatrix: np.ndarray | None,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    """float32 host values of a tensor as the file will hold it when ggml's own encoder writes it: floats rounded to
    their type, quantized types through :func:`stored_blocks` and the torch decoder on `device`
    (:func:`decoded_on_host`)."""
    if qtype in FLOAT_TYPES:
        return weights.to(_TORCH_FLOAT[qtype]).float()
    b = stored_blocks(qtype, weights, imatrix, device)
    return decoded_on_host(b, qtype, torch.device(device)).reshape(weights.shape)


def stored_blocks(qtype: str, weights: torch.Tensor, imatrix: np.ndarray | None,
                  device: str | torch.device = "cpu") -> np.ndarray:
    """The ggml blocks the file will hold for a quantized tensor that ggml's own encoder writes: the exact path's
    encoder (conversion/gguf/workers; on `device`, the same bytes). On the CPU the encoder is numpy's: IQ2_XS experts
    of a 288-expert layer would take it hours."""
    x = weights.detach().to("cpu", torch.float32).numpy()
    dev = torch.device(device)
    return encode(x, qtype, None if imatrix is None else np.asarray(imatrix, np.float32),
                  device=None if dev.type == "cpu" else str(dev))


def decoded_on_host(blocks: np.ndarray, qtype: str, device: torch.device) -> torch.Tensor:
    """float32 host values (..., weights per row) of encoded ggml `blocks` (..., bytes per row), decoded on `device`
    by the torch decoder (gguf-py's values bit for bit on the CPU), ``DECODE_ROWS_WEIGHTS`` weights at a time,
    into one host tensor (pinned for a CUDA device, as the layer streams are)."""
    bs, ts = block_shape(qtype)
    flat = blocks.reshape(-1, blocks.shape[-1])
    per_row = blocks.shape[-1] // ts * bs
    out = host_empty((flat.shape[0], per_row), torch.float32, pinned=torch.device(device).type == "cuda")
    step = max(1, DECODE_ROWS_WEIGHTS // per_row)
    for r0 in range(0, flat.shape[0], step):
        out[r0:r0 + step].copy_(gl.decode_blocks(flat[r0:r0 + step], qtype, device))
    return out.reshape(*blocks.shape[:-1], per_row)


class AttentionCache:
    """A decoder layer's attention output per calibration batch, computed once and then served again while only
    routed experts move (nothing the attention reads changes then: the layer's input, its norms, mixing and
    attention weights): the expert-group stages of a layer run the attention once per batch, not once per step.
    `batch` names the batch of the next call; the same tensors the attention would return are returned."""

    def __init__(self, attention: torch.nn.Module) -> None:
        self.attention = attention
        self.batch: tuple | None = None
        self.outputs: dict[tuple, object] = {}

    def __enter__(self) -> "AttentionCache":
        compute = self.attention.forward

        def forward(*args, **kwargs):
            if self.batch not in self.outputs:
                self.outputs[self.batch] = compute(*args, **kwargs)
            return self.outputs[self.batch]
        self.attention.forward = forward  # the instance attribute shadows the class's forward until __exit__
        return self

    def __exit__(self, *exc) -> None:
        del self.attention.forward
        self.outputs.clear()


class RoutedSums:
    """Per calibration batch, what a MoE block's expert-group stages share: its input, the router's choice, the
    shared expert's output and the routed experts' weighted sum at their current values. Nothing the block reads
    moves while only its routed experts do, so these are formed once per batch for the layer, not once per group
    (at 288 experts, every group ran all 288 experts over every batch for its others' sum); as a group ends
    (:meth:`ExpertGroupMoE.commit`), the sum takes its experts' tuned terms in place of their start terms."""

    def __init__(self, moe: torch.nn.Module) -> None:
        self.moe = moe
        self.batches: dict[tuple, tuple] = {}  # batch -> (x, weight, index, shared, total)

    @torch.no_grad()
    def get(self, batch: tuple, hidden: torch.Tensor) -> tuple:
        """(x, weight, index, shared, total) of `batch` (its MoE input `hidden`), formed by the block's own modules
        from the weights it holds when the batch is first asked for (or again after :meth:`drop`)."""
        if batch not in self.batches:
            moe = self.moe
            _, weight, index = moe.gate(hidden)
            x = hidden.view(-1, hidden.shape[-1])
            self.batches[batch] = (x, weight, index, moe.shared_experts(hidden), moe.experts(x, index, weight))
        return self.batches[batch]

    def set_total(self, batch: tuple, total: torch.Tensor) -> None:
        """The routed sum of `batch` after a group's experts changed."""
        x, weight, index, shared, _ = self.batches[batch]
        self.batches[batch] = (x, weight, index, shared, total)

    def drop(self, batch: tuple) -> None:
        """Forget `batch`'s routed sum (formed again from the block's weights when next asked for)."""
        self.batches.pop(batch, None)


class ExpertGroupMoE:
    """A MoE block while only its routed experts e0..e1 move (an expert-group stage of block-output tuning).

    Per calibration batch the moving experts' token slots and the other experts' weighted sum (the layer's routed
    sum, `sums`, less the moving experts' start terms) are formed once. A step then runs only the moving experts,
    on the token slots routed to them, through the block's own expert implementation over those experts. At
    GLM-5.3-Flash's count a group of about 40 of 288 experts sees a seventh of the slots, and no step copies or
    differentiates the other experts' weights. The output is the same terms as the block's own, summed in another
    order. `batch` names the batch of the next call; `weights()` gives the moving experts' (gate_up, down) stacks,
    (e1 - e0, ...) each; the block holds their start values until the group is committed."""

    def __init__(self, moe: torch.nn.Module, e0: int, e1: int, weights, sums: RoutedSums | None = None) -> None:
        self.moe, self.e0, self.e1, self.weights = moe, e0, e1, weights
        self.sums = RoutedSums(moe) if sums is None else sums
        self.batch: tuple | None = None
        self.fixed: dict[tuple, tuple] = {}

    def __enter__(self) -> "ExpertGroupMoE":
        self.moe.forward = self._forward  # the instance attribute shadows the class's forward until __exit__
        return self

    def __exit__(self, *exc) -> None:
        del self.moe.forward
        self.fixed.clear()

    def _moving(self, fixed: tuple, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """(tokens, hidden) weighted sum of the moving experts' terms, at the given weights."""
        x, _, _, slots, top_k, index, weight = fixed
        experts = self.moe.experts
        count = experts.num_experts
        experts.num_experts = self.e1 - self.e0  # the expert implementation sizes its groups by this
        try:
            out = functional_call(experts, {"gate_up_proj": gate_up, "down_proj": down},
                                  (x[slots // top_k], index, weight))
        finally:
            experts.num_experts = count
        per_slot = x.new_zeros(x.shape[0] * top_k, x.shape[1]).index_put((slots,), out)  # unique slots: no atomics
        return per_slot.view(x.shape[0], top_k, -1).sum(1)

    @torch.no_grad()
    def _fixed(self, hidden: torch.Tensor) -> tuple:
        x, weight, index, shared, total = self.sums.get(self.batch, hidden)
        moving = (index >= self.e0) & (index < self.e1)
        slots = moving.flatten().nonzero().squeeze(1)  # token * top_k + k
        fixed = (x, total, shared, slots, index.shape[-1], (index.flatten()[slots] - self.e0)[:, None],
                 weight.flatten()[slots][:, None])
        if slots.numel() == 0:
            return fixed
        experts = self.moe.experts  # the block holds the moving experts' start values
        start = self._moving(fixed, experts.gate_up_proj[self.e0:self.e1], experts.down_proj[self.e0:self.e1])
        return (x, total - start, *fixed[2:])

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.batch not in self.fixed:
            self.fixed[self.batch] = self._fixed(hidden)
        fixed = self.fixed[self.batch]
        rest, shared, slots = fixed[1], fixed[2], fixed[3]
        if slots.numel() == 0:  # no token of this batch chose a moving expert
            return rest.view(hidden.shape) + shared
        return (rest + self._moving(fixed, *self.weights())).view(hidden.shape) + shared

    @torch.no_grad()
    def commit(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """The group's experts end at these weights (as `weights()` gives them): the layer's routed sums take their
        terms at those (a batch this group never ran is formed again from the block's weights, once they hold
        them)."""
        for batch in list(self.sums.batches):
            fixed = self.fixed.get(batch)
            if fixed is None:
                self.sums.drop(batch)
            elif fixed[3].numel():
                self.sums.set_total(batch, fixed[1] + self._moving(fixed, gate_up, down))


class LayerTuner:
    """Carries the source and the quantized hidden streams over the calibration rows and tunes each layer's codes.

    specs/types: every GGUF tensor of the conversion with its planned type (tensors of a layer that are not among
    them keep their source values in the quantized stream). imatrix: GGUF name -> importance, for ggml's encoding
    of the tensors Hessian rounding leaves to it. max_weights: weights one stage may tune at once (None: from the
    device's free memory, `tuning_budget`); the other tensors come first, then whole routed-expert stacks while
    they fit; the stacks left over are tuned after them in groups of experts that fit the budget (every stack of
    the layer over the same experts at once, all else frozen at its tuned or encoded values), so every expert is
    tuned; an expert that alone is over the budget keeps its Hessian rounding. iters: descent steps of a layer's
    first stage; group_iters: of each expert group's stage (None: ``iters // GROUP_ITERS_SHARE``, at least one)."""

    def __init__(self, ckpt, input_ids: torch.Tensor, specs: Sequence, types: Sequence[str], *,
                 imatrix: Mapping[str, np.ndarray] | None = None, iters: int = DEFAULT_TUNE_ITERS,
                 lr: float | None = None, scale_lr: float | None = None, batch_rows: int = BATCH_ROWS,
                 device: str | torch.device = "cpu", max_weights: int | None = None,
                 group_iters: int | None = None) -> None:
        self.ckpt, self.ids = ckpt, input_ids.long()
        self.iters, self.lr = int(iters), float(TUNE_LR if lr is None else lr)
        if group_iters is None:
            group_iters = max(1, self.iters // GROUP_ITERS_SHARE) if self.iters > 0 else 0
        self.group_iters = int(group_iters)
        self.scale_lr = float(SCALE_LR if scale_lr is None else scale_lr)
        self.imatrix = imatrix or {}
        self.stream = DecoderStream(ckpt.config, device=device, batch_rows=batch_rows)
        self.device = self.stream.device
        self.max_weights = tuning_budget(self.device) if max_weights is None else int(max_weights)
        self.held = 0
        self.by_layer: dict[int | None, list] = {}
        for s, t in zip(specs, types):
            if not s.mtp:
                self.by_layer.setdefault(s.layer, []).append((s, t))
        batches = list(self.stream.batches(self.ids.shape[0]))
        n_check = max(1, len(batches) // CHECK_SHARE) if len(batches) > 1 else 0
        self.fit = batches[:len(batches) - n_check]
        self.check = batches[len(batches) - n_check:] or batches
        self.source: torch.Tensor | None = None   # source streams entering the next layer
        self.quant: torch.Tensor | None = None    # quantized streams entering the next layer
        self.topk_source = self.topk_quant = None
        self.embed: tuple | None = None           # (spec, tuned codes) of token_embd, tuned with the first layer
        self.reports: list[StageReport] = []
        # the codes' decoded values while a held-out check runs (id of the codes -> values): its batches read the
        # same values, and at 288 experts the decode is most of a group's forward
        self.check_values: dict[int, torch.Tensor] | None = None
        # ggml blocks this tuner encoded for tensors Hessian rounding leaves to ggml: the file's own bytes, handed
        # to the writer (take_encoded) so that it does not encode them a second time
        self.encoded: dict[str, np.ndarray] = {}

    # -- values of one stage's tensors
    def _fetch(self, name: str) -> torch.Tensor:
        return self.ckpt.get(name, dtype=torch.float32)

    def _values(self, layer: int | None, encoded: Mapping[str, np.ndarray], only: set[str] | None = None):
        """({HF name: fixed float32 value}, [(spec, LevelCodes or IQ2Codes)]) of the GGUF tensors of `layer`."""
        members = [(spec, qtype) for spec, qtype in self.by_layer.get(layer, [])
                   if only is None or spec.name in only]
        tunable = [(spec, qtype) for spec, qtype in members if encoded.get(spec.name) is not None
                   and qtype in bt.TUNABLE and spec.transform in ("none", "stack")]
        room, chosen, over = self.max_weights, set(), []
        for spec, qtype in sorted(tunable, key=lambda m: m[0].transform == "stack"):  # stacks last
            n = int(np.prod(spec.shape))
            cost = n * (2 if self._scales(qtype) else 1)
            if cost <= room:
                chosen.add(spec.name)
                room -= cost
            elif spec.transform == "stack":
                over.append((spec, qtype))  # tuned after the rest, a group of experts at a time
            else:
                self.held += n
        fixed_parts: dict[str, torch.Tensor] = {}
        tuned = []
        later = {spec.name for spec, _ in over}  # decoded into the layer's module after the source pass
        for spec, qtype in members:
            blocks = encoded.get(spec.name)
            if spec.name in later:
                continue
            if spec.name in chosen:
                tuned.append((spec, bt.tunable_codes(blocks, qtype, build_tensor(spec, self._fetch), self.device,
                                                     scales=self._scales(qtype))))
                continue
            if blocks is not None:  # encoded, not tuned: the source is not read
                v = decoded_on_host(np.asarray(blocks), qtype, self.device)
            elif qtype in FLOAT_TYPES:
                v = stored_values(qtype, build_tensor(spec, self._fetch), None, self.device)
            else:
                b = self.encoded[spec.name] = stored_blocks(qtype, build_tensor(spec, self._fetch),
                                                            self.imatrix.get(spec.name), self.device)
                v = decoded_on_host(b, qtype, self.device)
            fixed_parts.update(unbuild_tensor(spec, v.reshape(spec.shape)))
        # a kv_b half without its partner (a partial spec list) cannot rebuild kv_b: that tensor keeps its source
        halves = {k for k in fixed_parts if "#" in k}
        for k in halves:
            base, half = k.rsplit("#", 1)
            if f"{base}#{'v' if half == 'k' else 'k'}" not in halves:
                del fixed_parts[k]
        return merge_kv_b(fixed_parts), tuned, over

    @torch.no_grad()
    def _decode_into(self, parts: Mapping[str, torch.Tensor], over: list, encoded: Mapping[str, np.ndarray]) -> None:
        """Decode the routed-expert stacks `over` (encoded, not tuned with the layer's first stage) on the device
        straight into the module's tensors (`parts`: checkpoint name -> the view that holds it), one expert at a
        time: the layer's experts never pass through host memory."""
        for spec, qtype in over:
            blocks = np.asarray(encoded[spec.name])
            for e, name in enumerate(spec.hf_names):
                view = parts[name]
                view.copy_(gl.decode_blocks(blocks[e], qtype, self.device).reshape(view.shape))

    def _expert_ranges(self, over: list) -> list[tuple[int, int]]:
        """The routed-expert stacks `over` (that did not fit with the rest) cut into expert ranges that each fit the
        budget, every stack over the same experts. When one expert alone is over it, none: those weights are
        counted in `held` and keep their rounding."""
        if not over:
            return []
        experts = min(int(spec.shape[0]) for spec, _ in over)
        per_expert = sum(int(np.prod(spec.shape[1:])) * (2 if self._scales(q) else 1) for spec, q in over)
        size = self.max_weights // per_expert
        if size < 1:
            self.held += sum(int(np.prod(spec.shape)) for spec, _ in over)
            return []
        return [(e0, min(experts, e0 + size)) for e0 in range(0, experts, size)]

    def _group_sources(self, over: list, e0: int, e1: int) -> list[torch.Tensor]:
        """The source weights of every stack in `over` over experts e0..e1, in the order of `over` (the codes of a
        group start from them): read on a worker thread while the group before is tuned."""
        return [build_tensor(replace(spec, hf_names=spec.hf_names[e0:e1], shape=(e1 - e0, *spec.shape[1:])),
                             self._fetch) for spec, _ in over]

    def _group(self, over: list, encoded: Mapping[str, np.ndarray], e0: int, e1: int,
               sources: Sequence[torch.Tensor]) -> list[tuple]:
        """[(full spec, (e0, e1), tuned codes of experts e0..e1)] of every stack in `over` (`sources`: their source
        weights, :meth:`_group_sources`): one group's codes, made when its stage starts so that one group at a time
        is in memory."""
        return [(spec, (e0, e1), bt.tunable_codes(np.asarray(encoded[spec.name])[e0:e1], qtype, source, self.device,
                                                  scales=self._scales(qtype)))
                for (spec, qtype), source in zip(over, sources)]

    def _scales(self, qtype: str) -> bool:
        """Whether a tensor of `qtype` has its block scales learned with its codes."""
        return self.scale_lr > 0 and qtype in bt.SCALE_TUNED

    def _decoded(self, codes) -> torch.Tensor:
        """The codes' current values: decoded once per held-out check (its batches read the same values)."""
        if self.check_values is None:
            return codes.dequantized()
        if id(codes) not in self.check_values:
            self.check_values[id(codes)] = codes.dequantized()
        return self.check_values[id(codes)]

    def _tuned_values(self, tuned) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for spec, codes in tuned:
            out.update(unbuild_tensor(spec, self._decoded(codes).reshape(spec.shape)))
        return out

    def _group_stacks(self, group) -> dict[tuple[str, ...], torch.Tensor]:
        """{the checkpoint names of a stack's experts e0..e1: their values (e1 - e0, ...)} of a group."""
        return {tuple(spec.hf_names[e0:e1]): self._decoded(codes).reshape(e1 - e0, *spec.shape[1:])
                for spec, (e0, e1), codes in group}

    # -- the stages
    def _start(self, encoded: Mapping[str, np.ndarray]) -> None:
        self.source = self.stream.embed(self.ids, self._fetch)
        fixed, tuned, _ = self._values(None, encoded, only={s.name for s, _ in self.by_layer.get(None, [])
                                                           if s.hf_names == [EMBED_NAME] and s.role == "embed"})
        self.embed = tuned[0] if tuned else None
        self.embed_fixed = None  # read only when the embedding is not tuned (it is the largest tensor)
        if self.embed is None:
            self.embed_fixed = (fixed[EMBED_NAME] if EMBED_NAME in fixed else self._fetch(EMBED_NAME)).to(self.device)

    def _embedded(self, sl: slice) -> torch.Tensor:
        w = self._decoded(self.embed[1]) if self.embed is not None else self.embed_fixed
        e = F.embedding(self.ids[sl].to(self.device), w)
        return e.unsqueeze(2).expand(-1, -1, self.stream.hc_mult, -1).contiguous()

    def _tune(self, layer, tuned, loss, iters: int, start: float | None = None,
              checks: int = bt.DEFAULT_CHECKS) -> float | None:
        """Tune `tuned` ([(spec, codes)]) for `loss`, `checks` held-out checks on the way; `start`: the held-out loss
        of the start when the stage before ended at this point (not checked again). Returns the held-out loss
        where the codes end (None: no stage)."""
        if not tuned or iters <= 0:
            return None

        def held_out() -> float:
            self.check_values = {}
            try:
                with torch.no_grad():
                    return sum(float(loss(sl)) for sl in self.check)
            finally:
                self.check_values = None

        t0 = time.perf_counter()
        params = [(p, self.lr if k == 0 else self.scale_lr) for _, c in tuned for k, p in enumerate(c.params)]
        before, after = bt.sign_descent([p for p, _ in params], loss, self.fit, iters, [r for _, r in params],
                                        score=held_out, start=start, checks=checks)  # the score reads losses back
        self.reports.append(StageReport(layer, before, after, after < before,
                                        float(np.mean([c.changed() for _, c in tuned])), self.held,
                                        time.perf_counter() - t0))
        return after

    def layer(self, layer: int, encoded: Mapping[str, np.ndarray], source: torch.nn.Module | None = None
              ) -> dict[str, np.ndarray]:
        """Tune decoder layer `layer` (`encoded`: GGUF name -> Hessian-rounded blocks of its covered tensors, and
        token_embd's for the first layer), advance both streams past it, and return the tuned blocks. `source`: the
        layer already built with its source weights on the tuner's device (the calibration's), which the tuner
        then overwrites; else the tuner builds its own (at 288 experts, 30 GB read in and moved a second time)."""
        self.held = 0
        first = self.source is None
        if first:
            self._start(encoded)
        fixed, tuned, over = self._values(layer, encoded)
        tuned_all = tuned + [self.embed] if first and self.embed is not None else tuned
        own = source is None or any(not same_device(p.device, self.device) or p.dtype != self.stream.dtype
                                    for p in source.parameters())
        mod = self.stream.materialize(layer, self._fetch) if own else source
        target, topk_next = self.stream.run_layer(mod, self.source, self.topk_source)
        # From here the module holds the quantized layer's current values (the routed experts' too, so that a stage
        # moving a few of them reads the others in place: no second copy of the layer, no restacking a step); a
        # step hands it only the tensors its stage moves.
        mod.requires_grad_(False)
        const: dict[str, torch.Tensor] = {}  # untuned parts of the tensors a stage moves, on the device
        frozen: dict[str, torch.Tensor] = {}  # tuned in this layer's first stage: fixed in the later ones
        in_module: dict[str, torch.Tensor] = {}  # the stacks `over`: their decoded experts, read in place
        if over:
            parts = stacked_parts(mod, layer, self.ckpt.shape)
            self._decode_into(parts, over, encoded)
            in_module = {n: parts[n] for spec, _ in over for n in spec.hf_names}

        def current(n: str) -> torch.Tensor:
            if n in frozen:
                return frozen[n]
            if n in in_module:
                return in_module[n]
            if n not in const:
                const[n] = (fixed[n] if n in fixed else self._fetch(n)).to(self.device)
            return const[n]

        def value(n: str) -> torch.Tensor:  # the same, not kept: an in-place write reads each part once
            return frozen[n] if n in frozen else in_module[n] if n in in_module else fixed[n] if n in fixed \
                else self._fetch(n)

        write_values(mod, layer, fixed, value)
        live = tuned  # what the first stage moves (an expert group's experts move through `group_moe` after it)

        def quant_input(sl: slice) -> torch.Tensor:
            return self._embedded(sl) if first else self.quant[sl].to(self.device)

        attention = AttentionCache(mod.self_attn)
        group_moe: ExpertGroupMoE | None = None  # an expert-group stage's MoE block (the batch of each call)

        def run(sl: slice, params) -> tuple:
            prev = None if self.topk_quant is None else self.topk_quant[sl].to(self.device)
            attention.batch = (sl.start, sl.stop)
            if group_moe is not None:
                group_moe.batch = attention.batch
            return self.stream.call_layer(mod, quant_input(sl), prev, params=params)

        def loss(sl: slice) -> torch.Tensor:
            out, _ = run(sl, layer_params(mod, layer, self._tuned_values(live), current) if live else None)
            return F.mse_loss(out, target[sl].to(self.device))

        # each stage after the first starts where the one before ended: the module holds those values, and a group's
        # codes start at their encoded values, which the module holds for the experts not yet tuned
        reached = self._tune(layer, tuned_all, loss, self.iters)
        with torch.no_grad():
            frozen.update({k: v.detach() for k, v in self._tuned_values(tuned).items()})
        write_values(mod, layer, frozen, value)
        live = []  # the layer's other tensors stay at their tuned values while the experts move
        grouped: dict[str, np.ndarray] = {}  # the stacks tuned a group of experts at a time
        ranges = self._expert_ranges(over) if self.group_iters > 0 else []
        if ranges:
            sums = RoutedSums(mod.mlp)
            with attention:  # from here only routed experts move
                for (e0, e1), sources in ahead(ranges, lambda r: self._group_sources(over, *r)):
                    group = self._group(over, encoded, e0, e1, sources)

                    def block(stacks, e0=e0, e1=e1) -> tuple[torch.Tensor, torch.Tensor]:
                        return tuple(stacked_block(mod, layer, f"mlp.experts.{k}", range(e0, e1), stacks, current)
                                     for k in ("gate_up_proj", "down_proj"))
                    with ExpertGroupMoE(mod.mlp, e0, e1, lambda group=group: block(self._group_stacks(group)),
                                        sums) as group_moe:
                        reached = self._tune(layer, [(spec, codes) for spec, _, codes in group], loss,
                                             self.group_iters, start=reached, checks=GROUP_CHECKS)
                        with torch.no_grad():  # the group's end values, decoded once for its sums and the block
                            ended = self._group_stacks(group)
                        group_moe.commit(*block(ended))
                    group_moe = None
                    write_values(mod, layer, stack_rows(ended), value)
                    for spec, _, codes in group:
                        grouped.setdefault(spec.name, np.array(encoded[spec.name], copy=True))[e0:e1] = \
                            codes.blocks()
        with torch.no_grad():
            outs, topks = None, []
            for sl in self.stream.batches(self.ids.shape[0]):
                out, tk = run(sl, None)
                if outs is None:
                    outs = host_empty((self.ids.shape[0], *out.shape[1:]), out.dtype, pinned=out.is_cuda)
                outs[sl].copy_(out)
                if tk is not None:
                    topks.append(tk.to("cpu"))
        self.quant = outs
        self.topk_quant = torch.cat(topks) if topks else None
        self.source, self.topk_source = target, topk_next
        if own:
            self.stream.release(layer)
        result = {spec.name: codes.blocks() for spec, codes in tuned} | grouped
        if first and self.embed is not None:
            result[self.embed[0].name] = self.embed[1].blocks()
        if first:  # the embedding enters the first layer only
            self.embed = self.embed_fixed = None
        return result

    def take_encoded(self) -> dict[str, np.ndarray]:
        """{GGUF name: ggml blocks} this tuner encoded since the last call, for tensors Hessian rounding leaves to
        ggml (exactly the bytes ggml's encoder gives them in the file), handed over and forgotten."""
        out, self.encoded = self.encoded, {}
        return out

    def head(self, encoded: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Tune the output head (its encoded blocks in `encoded`) for the KL divergence of the quantized model's
        logits from the source model's, on the streams the last layer left."""
        if self.source is None:
            return {}
        self.held = 0
        heads = {s.name for s, _ in self.by_layer.get(None, []) if s.role == "lm_head"}
        _, tuned, _ = self._values(None, encoded, only=heads)
        if not tuned:
            return {}
        spec, codes = tuned[0]
        norm = self._fetch(NORM_NAME)
        w_source = self._fetch(HEAD_NAME).to(self.device)

        def loss(sl: slice) -> torch.Tensor:
            with torch.no_grad():
                p = F.log_softmax(self.stream.final_hidden(self.source[sl], norm) @ w_source.T, -1)
                h = self.stream.final_hidden(self.quant[sl], norm)
            q = F.log_softmax(h @ self._decoded(codes).reshape(spec.shape).T, -1)
            return F.kl_div(q.flatten(0, 1), p.flatten(0, 1), log_target=True, reduction="batchmean")

        self._tune(None, tuned, loss, self.iters)
        return {spec.name: codes.blocks()}
