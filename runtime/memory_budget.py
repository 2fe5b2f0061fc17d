"""The device memory budget (`--gpu-memory`): what each stage of convert, imatrix and eval needs on its device, from
the model's shapes, and the piece sizes that keep every stage within the budget.

A stage's need is `fixed + per_piece x piece`: `fixed` is what it holds whatever the piece (one decoder layer's
weights, the hidden streams), `per_piece` what one more unit of its piece adds (one routed expert of a stacked
call, one row of logits). `pieces(...)` gives each stage the largest piece that fits the budget, never larger than
the stage's own default (so the default budget on a large card reproduces the pieces the stage always used);
a stage whose smallest piece does not fit is refused before any work (`MemoryEstimate.check`, one InputError that
names the stage and its bytes). `STAGES` is the table of facts: what a piece is, whether the output depends on its
size, and why. On a CPU device the budget bounds the host working set of the same stages, the default being the
memory the host has available.

The figures are estimates from shapes (float32 working copies, the transients each stage's code allocates, counted
in `BYTES` with the reason), for the up-front line and the refusal; docs/memory-model.md (conversion side) has the
derivation and what was measured against them.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping

import torch

from mixq.errors import InputError
from mixq.formats.exl3_layout import pad_up
from mixq.runtime.layer_stream import BATCH_ROWS

GIB = 2**30


@dataclass(frozen=True)
class StageFact:
    """One stage: `piece` (what the budget cuts it into; None: no piece, the stage fits whole or is refused),
    `invariant` (whether the output is the same bytes whatever the piece size) and `why`."""

    name: str
    piece: str | None
    invariant: bool
    why: str


STAGES: dict[str, StageFact] = {f.name: f for f in (
    StageFact("calibration", "routed experts per group on the device (their weights and accumulators on the host)",
              True,
              "one decoder layer's weights, its Hessian (or imatrix) accumulators and one batch of rows; when the "
              "whole layer does not fit, the routed experts go through the device a group at a time "
              "(runtime/expert_groups.py), each token's sum over its experts formed in the same order, so the "
              "statistics and the streams are the same bytes. The rows' batch size is not the budget's: the "
              "Hessian sums and the tuning's held-out batches depend on it"),
    StageFact("exl3_encode", "routed experts (same-shape units) per stacked trellis call", False,
              "a stacked call picks one global scale over all its units' tiles and draws its sign vectors from one "
              "seed: a smaller stack gives other (equally good) codes. The default stack is kept whenever it fits; "
              "a budget that forces a smaller one is recorded in the result"),
    StageFact("gguf_rounding", "routed experts per Hessian-rounding call", True,
              "each expert is rounded against its own Hessian; a call over several only batches them"),
    StageFact("gguf_tuning", "weights tuned together in one stage (routed experts grouped to fit)", False,
              "the descent moves a stage's weights together: experts tuned in other groups end at other codes. "
              "The default groups come from the device's free memory, as they always did"),
    StageFact("gguf_encode", "weights per encoder chunk on the device (CPU worker processes: none, each holds "
              "one task of rows and the source tensor is cut once)", True,
              "ggml's block encodings are row by row; a chunk only batches rows"),
    StageFact("eval_forward", "routed experts per group on the device (the hidden streams live on the device "
              "when the whole layer fits beside them, else on the host)", True,
              "the streams are stored, not computed, where they live; the experts of a group are applied as "
              "transformers' experts implementation applies them and each token's sum is formed in its order "
              "(runtime/expert_groups.py); each layer still runs one window at a time"),
    StageFact("eval_logits", "rows of logits per float64 KL pass", True,
              "every row's KL, NLL and top-1 are computed on their own and concatenated"),
)}

# bytes per unit of what each stage holds, with the reason (float32 = 4 bytes, float64 = 8)
BYTES: dict[str, int] = {
    # the layer's weights, float32 on the device (runtime/layer_stream.py widens them there)
    "layer_weight": 4,
    # eval: the dequantized float32 weights of a layer beside the module they are copied into
    "eval_layer_weight": 8,
    # a hidden stream entry, kept on the host by the calibration: the layer's input and its output (float32),
    # the pinned or pageable copies between them and the allocator's slack: 8 float32, fitted as token_hidden
    "stream": 32,
    # calibration: per token of a batch and per hidden unit of the hc streams, the residual copies, norms,
    # projections and the linear attention's chunked states transformers' layer keeps alive at once: 24 float32,
    # fitted to the peak RSS of k256 calibrations at 4 rows x 128..512 tokens a batch (tests/runtime/
    # test_memory_budget.py measures it again)
    "token_hidden": 96,
    # per token and per routed/dense intermediate unit: gate, up and their product in float32
    "token_intermediate": 12,
    # per attention score (heads x tokens x tokens of one row): eager softmax keeps scores and probabilities
    "score": 8,
    # EXL3 trellis call, per padded weight of a unit: the transposed copy, rotated weight, tiles, scaled tiles,
    # reconstruction and its rotation back (float32 each), plus the int64 Viterbi state per weight
    "exl3_weight": 6 * 4 + 8,
    # EXL3, per padded Hessian entry of a unit: the damped float64 copy, its rotated float32 copy, the LDL factor
    "exl3_hessian": 8 + 4 + 4,
    # GGUF Hessian rounding, per weight of an expert: the float32 weight, its scaled copy, the candidate levels
    # and the feedback walk's residual (about 12 float32 per weight), and per Hessian entry one float64
    "rounding_weight": 48,
    "rounding_hessian": 8,
    # ggml encoders on a device: ~16 float32 copies of a chunk (quant/ggml/torch_encoders.py)
    "encode_weight": 64,
    # eval logits: the window's float32 logits and the reference log-probs (per row and vocabulary entry), and
    # per row of a KL pass five float64 temporaries
    "logit": 8,
    "kl_row_entry": 40,
}


@dataclass(frozen=True)
class StageNeed:
    """One stage's estimate: `fixed` + `per_piece` x `piece` bytes (`piece`: the units per call the budget
    allows; `default_piece`: what the stage uses unbounded; 1 unit is its smallest)."""

    stage: str
    fixed: int
    per_piece: int = 0
    piece: int = 1
    default_piece: int = 1

    @property
    def need(self) -> int:
        return self.fixed + self.per_piece * self.piece

    @property
    def minimum(self) -> int:
        return self.fixed + self.per_piece * (1 if self.per_piece else 0)

    def to_dict(self) -> dict:
        return {**asdict(self), "need": self.need, "minimum": self.minimum,
                "invariant": STAGES[self.stage].invariant, "piece_of": STAGES[self.stage].piece}


@dataclass
class MemoryBudget:
    """The bytes a run may hold on `device` (`given`: whether --gpu-memory said so, else the device's free
    memory)."""

    device: torch.device
    bytes: int
    given: bool = False

    def piece(self, fixed: int, per_piece: int, default: int) -> int:
        """The largest piece up to `default` with `fixed + per_piece * piece` within the budget (at least 1)."""
        if per_piece <= 0:
            return default
        room = (self.bytes - fixed) // per_piece
        return int(max(1, min(default, room)))

    def less(self, resident: int) -> "MemoryBudget":
        """The budget left to a stage while `resident` bytes of another (the calibration's layer, accumulators and
        streams) stay on the device beside it."""
        return MemoryBudget(self.device, max(0, self.bytes - int(resident)), self.given)


def free_bytes(device: torch.device) -> int:
    """What `device` has free: CUDA's free memory, or the host's available memory for the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def resolve_budget(gpu_memory: int | None, device: torch.device | str) -> MemoryBudget:
    """The budget of a run on `device`: `gpu_memory` bytes when given, else what the device has free."""
    device = torch.device(device)
    if gpu_memory is not None:
        return MemoryBudget(device, int(gpu_memory), True)
    return MemoryBudget(device, free_bytes(device), False)


@dataclass
class MemoryEstimate:
    """What a run needs: its stages' estimates on the device and the host bytes beside them."""

    budget: MemoryBudget
    stages: list[StageNeed] = field(default_factory=list)
    host_extra: int = 0

    @property
    def device_need(self) -> int:
        return max((s.need for s in self.stages), default=0)

    @property
    def host_need(self) -> int:
        """Host bytes: the device stages themselves on a CPU run, plus what stays on the host beside them."""
        return (self.device_need if self.budget.device.type == "cpu" else 0) + self.host_extra

    def stage(self, name: str) -> StageNeed | None:
        return next((s for s in self.stages if s.stage == name), None)

    def check(self, flag: str = "--gpu-memory") -> None:
        """InputError naming the first stage whose smallest piece does not fit the budget."""
        for s in self.stages:
            if s.minimum > self.budget.bytes:
                what = f"its smallest piece (1 of {STAGES[s.stage].piece})" if s.per_piece else "its whole"
                raise InputError(
                    f"{flag} {_gib(self.budget.bytes)}: the {s.stage} stage needs {s.minimum:,} bytes "
                    f"({_gib(s.minimum)}) on {self.budget.device} for {what}; give at least that much")

    def line(self) -> str:
        """The up-front line: device and host need, the budget, the largest stage."""
        big = max(self.stages, key=lambda s: s.need, default=None)
        dev = self.budget.device
        kind = f"GPU {dev}" if dev.type == "cuda" else f"device {dev}"
        src = "--gpu-memory" if self.budget.given else "free memory"
        top = f" (largest stage: {big.stage})" if big is not None else ""
        short = "" if self.device_need <= self.budget.bytes or self.budget.given else \
            " (more than is free: give --gpu-memory to be held to it)"
        return (f"memory: {kind} needs ~{_gib(self.device_need)}{top} of a {_gib(self.budget.bytes)} budget "
                f"({src}){short}; host ~{_gib(self.host_need)}")

    def to_dict(self) -> dict:
        return {"device": str(self.budget.device), "budget_bytes": self.budget.bytes, "budget_given":
                self.budget.given, "device_bytes": self.device_need, "host_bytes": self.host_need,
                "stages": [s.to_dict() for s in self.stages]}


def _gib(n: int) -> str:
    """Bytes for a person: GiB, or MiB below one GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.2f} MiB"


# --- shapes --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShapes:
    """The shapes a budget needs: the largest decoder layer's parameters and its Linear inputs (the accumulators a
    calibration keeps: in_dim per distinct input), and the text config's widths."""

    layer_params: int
    layer_inputs: tuple[int, ...]
    hidden: int
    hc_mult: int
    intermediate: int
    vocab: int
    heads: int
    experts: int
    expert_shapes: tuple[tuple[int, int], ...] = ()  # (out, in) of one routed expert's Linears
    # input widths of the accumulators each routed expert has of its own (its gate and up read the layer's input,
    # whose one accumulator every expert and the router share: it is among `layer_inputs`)
    expert_inputs: tuple[int, ...] = ()

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert."""
        return sum(o * i for o, i in self.expert_shapes)

    @property
    def act_width(self) -> int:
        return max(self.intermediate, 1)


def model_shapes(text_config: Mapping, names: Iterable[str], shape_of, layer_of) -> ModelShapes:
    """ModelShapes from a text config and a checkpoint's names (`shape_of(name)`, `layer_of(name)`: the decoder layer
    of a name, None outside them). Accumulators: one per distinct (module, input width) of a layer's 2-D weights
    outside the routed experts, one for the routed experts' shared input (the calibration feeds every expert's gate
    and up from the layer input's one accumulator), and per routed expert one per other input width."""
    params: dict[int, int] = {}
    inputs: dict[int, set] = {}
    expert_shapes: dict[str, tuple[int, int]] = {}
    hidden = int(text_config["hidden_size"])
    for n in names:
        layer = layer_of(n)
        if layer is None:
            continue
        shp = tuple(int(x) for x in shape_of(n))
        params[layer] = params.get(layer, 0) + math.prod(shp)
        if len(shp) == 2 and n.endswith(".weight"):
            module = n.rsplit(".", 2)[0]
            if ".experts." in n:
                if ".experts.0." in n:
                    expert_shapes[n.rsplit(".", 2)[1]] = (shp[0], shp[1])
                if shp[-1] != hidden:
                    continue  # an expert's own accumulator: `expert_inputs`
                module = n.split(".experts.")[0] + ".experts"  # the input every expert shares
            inputs.setdefault(layer, set()).add((module, shp[-1]))
    biggest = max(params, key=lambda k: params[k], default=None)
    t = text_config
    return ModelShapes(
        layer_params=params.get(biggest, 0),
        layer_inputs=tuple(sorted(d for _, d in inputs.get(biggest, set()))),
        hidden=int(t["hidden_size"]), hc_mult=int(t.get("hc_mult", 1)),
        intermediate=max(int(t.get("intermediate_size", 0)),
                         int(t.get("moe_intermediate_size", 0)) * int(t.get("num_experts_per_tok", 1))),
        vocab=int(t["vocab_size"]), heads=int(t.get("num_attention_heads", 1)),
        experts=int(t.get("n_routed_experts", 0) or 0), expert_shapes=tuple(sorted(expert_shapes.values())),
        expert_inputs=tuple(sorted({i for _, i in expert_shapes.values() if i != hidden})))


def checkpoint_shapes(ckpt) -> ModelShapes:
    """ModelShapes of an opened checkpoint (formats/checkpoint.py; the NextN block is not a decoder layer here)."""
    def layer_of(n: str):
        info = ckpt.info(n)
        return None if info.mtp else info.layer
    return model_shapes(ckpt.text_config, ckpt.names(), ckpt.shape, layer_of)


# --- the stages ----------------------------------------------------------------------------------------------------

def _layer_bytes(shapes: ModelShapes) -> int:
    return BYTES["layer_weight"] * shapes.layer_params


def _activation_bytes(shapes: ModelShapes, rows: int, seq: int) -> int:
    tokens = rows * seq
    return (tokens * (BYTES["token_hidden"] * shapes.hc_mult * shapes.hidden
                      + BYTES["token_intermediate"] * shapes.act_width)
            + rows * shapes.heads * seq * seq * BYTES["score"])


def _expert_acc_bytes(shapes: ModelShapes, full: bool) -> int:
    """Accumulator bytes of one routed expert of its own (Σ x·xᵀ float32, or the imatrix's Σ x² vectors)."""
    return sum(4 * d * d if full else 16 * d for d in shapes.expert_inputs)


def calibration_need(shapes: ModelShapes, rows: int, seq_len: int, batch_rows: int, *,
                     full: bool = True, budget: MemoryBudget | None = None, stream: bool = True) -> StageNeed:
    """The calibration forward on the device: one layer's weights, its accumulators (Σ x·xᵀ float32 per distinct
    input, or the Σ x² vectors of an imatrix) and one batch's activations (the hidden streams of all rows stay on
    the host: `calibration_host`). The piece: routed experts per group on the device, each with its weights
    (float32) and its own accumulators; the whole layer (every expert) unless `budget` holds fewer. `stream`
    False: no piece (a stage after it needs the whole layer anyway)."""
    acc = sum(4 * d * d if full else 16 * d for d in shapes.layer_inputs)
    per = BYTES["layer_weight"] * shapes.expert_params + _expert_acc_bytes(shapes, full) if shapes.experts else 0
    fixed = (_layer_bytes(shapes) - BYTES["layer_weight"] * shapes.expert_params * shapes.experts + acc
             + _activation_bytes(shapes, min(rows, batch_rows), seq_len))
    default = max(shapes.experts, 1)
    if not stream:
        return StageNeed("calibration", fixed + per * default)
    piece = default if budget is None else budget.piece(fixed, per, default)
    return StageNeed("calibration", fixed, per, piece, default)


def expert_group(need: StageNeed) -> int | None:
    """Routed experts per group of a calibration or eval-forward estimate, None when the whole layer fits (no
    streaming)."""
    return need.piece if need.per_piece and need.piece < need.default_piece else None


def calibration_resident(need: StageNeed) -> int:
    """What a calibration keeps on the device beside the stages that follow it in a layer: the whole layer and
    its accumulators, or with streamed experts the rest of the layer (the groups and their accumulators are
    back on the host)."""
    return need.fixed if expert_group(need) is not None else need.need


def streamed_host(shapes: ModelShapes, need: StageNeed, full: bool) -> int:
    """Host bytes of streamed experts: the layer's routed experts in float32 and their own accumulators."""
    if expert_group(need) is None:
        return 0
    return shapes.experts * (BYTES["layer_weight"] * shapes.expert_params + _expert_acc_bytes(shapes, full))


def calibration_host(shapes: ModelShapes, rows: int, seq_len: int) -> int:
    """Host bytes of a calibration beside the device: every row's hidden streams, the layer's input and output."""
    return BYTES["stream"] * rows * seq_len * shapes.hc_mult * shapes.hidden


def exl3_unit_bytes(out_f: int, in_f: int, hessian: bool = True) -> int:
    """Device bytes of one unit of a stacked trellis call (padded to EXL3's 128)."""
    k, n = pad_up(in_f), pad_up(out_f)
    return BYTES["exl3_weight"] * k * n + (BYTES["exl3_hessian"] * k * k if hessian else 0)


def exl3_encode_need(budget: MemoryBudget, shapes: ModelShapes, default_batch: int, resident: int = 0) -> StageNeed:
    """EXL3's trellis encoding of the largest stacked units (a routed expert's largest Linear, else the largest
    dense input) beside `resident` bytes: per unit `exl3_unit_bytes`, the stack as large as the budget and the
    default allow."""
    if shapes.expert_shapes:
        out_f, in_f = max(shapes.expert_shapes, key=lambda s: s[0] * s[1])
    else:
        in_f = max(shapes.layer_inputs, default=shapes.hidden)
        out_f = shapes.hidden
    per = exl3_unit_bytes(out_f, in_f)
    return StageNeed("exl3_encode", resident, per, budget.piece(resident, per, default_batch), default_batch)


def exl3_batch(budget: MemoryBudget | None, out_f: int, in_f: int, hessian: bool, default: int) -> int:
    """Units per stacked trellis call for units of (out_f, in_f): `default` unless the budget holds fewer."""
    if budget is None:
        return default
    return budget.piece(0, exl3_unit_bytes(out_f, in_f, hessian), default)


def rounding_expert_bytes(rows: int, n: int) -> int:
    """Device bytes of one routed expert (rows x n) in a Hessian-rounding call."""
    return BYTES["rounding_weight"] * rows * n + BYTES["rounding_hessian"] * n * n


def rounding_slice(budget: MemoryBudget | None, rows: int, n: int, default: int) -> int:
    """Routed experts per Hessian-rounding call: `default` unless the budget holds fewer."""
    if budget is None:
        return default
    return budget.piece(0, rounding_expert_bytes(rows, n), default)


def rounding_need(budget: MemoryBudget, shapes: ModelShapes, default: int, resident: int = 0) -> StageNeed:
    """GGUF Hessian rounding of the largest routed expert (or Linear) beside `resident` bytes."""
    if shapes.expert_shapes:
        rows, n = max(shapes.expert_shapes, key=lambda s: s[0] * s[1] + s[1] * s[1])
    else:
        rows, n = shapes.hidden, max(shapes.layer_inputs, default=shapes.hidden)
    per = rounding_expert_bytes(rows, n)
    return StageNeed("gguf_rounding", resident, per, budget.piece(resident, per, default), default)


def tuning_weights(budget: MemoryBudget, bytes_per_weight: int) -> int:
    """Weights one tuning stage may move at once: a third of the budget (the layer, its streams and the decoded
    stacks take the rest), at `bytes_per_weight` each."""
    return int(budget.bytes // 3 // bytes_per_weight)


def tuning_need(budget: MemoryBudget, shapes: ModelShapes, bytes_per_weight: int, resident: int = 0) -> StageNeed:
    """Block-output tuning beside `resident` bytes (the calibration's, whose layer it borrows): the tuned weights,
    a third of what is left (`tuning_weights`); its smallest piece is one routed expert."""
    per_expert = sum(o * i for o, i in shapes.expert_shapes) or shapes.layer_params
    weights = tuning_weights(budget.less(resident), bytes_per_weight)
    experts = max(1, weights // max(per_expert, 1))
    return StageNeed("gguf_tuning", resident, 3 * bytes_per_weight * per_expert,
                     min(experts, max(shapes.experts, 1)), max(shapes.experts, 1))


def encode_chunk(budget: MemoryBudget | None, default: int) -> int:
    """Weights per device encoder chunk: `default` unless the budget holds fewer."""
    if budget is None:
        return default
    return budget.piece(0, BYTES["encode_weight"], default)


def encode_need(budget: MemoryBudget, default: int, row: int) -> StageNeed:
    piece = max(row, encode_chunk(budget, default))
    return StageNeed("gguf_encode", 0, BYTES["encode_weight"], piece, default)


def eval_forward_need(shapes: ModelShapes, ctx: int, batch_windows: int, state_bytes: int,
                      models: int = 2, budget: MemoryBudget | None = None) -> StageNeed:
    """The eval forward: one model's layer at a time (dequantized float32 and the module's copy), one batch of
    windows' activations, and every model's hidden streams when they live on the device (`state_bytes`: one
    model's, 0 when they live on the host). The piece: routed experts per group on the device; the whole layer
    unless `budget` holds fewer."""
    per = BYTES["eval_layer_weight"] * shapes.expert_params if shapes.experts else 0
    fixed = (BYTES["eval_layer_weight"] * (shapes.layer_params - shapes.expert_params * shapes.experts)
             + _activation_bytes(shapes, batch_windows, ctx) + models * state_bytes)
    default = max(shapes.experts, 1)
    piece = default if budget is None else budget.piece(fixed, per, default)
    return StageNeed("eval_forward", fixed, per, piece, default)


def kl_rows(budget: MemoryBudget | None, vocab: int, ctx: int, default: int) -> int:
    """Rows of logits per KL pass: `default` unless the budget (less the window's logits) holds fewer."""
    if budget is None:
        return default
    return budget.piece(BYTES["logit"] * ctx * vocab, BYTES["kl_row_entry"] * vocab, default)


def eval_logits_need(budget: MemoryBudget, shapes: ModelShapes, ctx: int, default: int) -> StageNeed:
    fixed = BYTES["logit"] * ctx * shapes.vocab + 4 * shapes.hidden * shapes.vocab  # logits, log-probs, lm_head
    per = BYTES["kl_row_entry"] * shapes.vocab
    return StageNeed("eval_logits", fixed, per, budget.piece(fixed, per, default), default)


# --- what each verb runs -------------------------------------------------------------------------------------------


def gguf_estimate(budget: MemoryBudget, shapes: ModelShapes, *, hessian: bool, rows: int, seq_len: int,
                  tune: bool, tune_bytes_per_weight: int, rounding_default: int, encode_default: int | None,
                  largest_tensor: int, host_workers: int = 0, task_weights: int = 0) -> MemoryEstimate:
    """`mixq convert` to GGUF: with --rounding hessian the calibration, the rounding beside it and the tuning;
    the device encoders when a device encodes (`encode_default` weights per call, None: CPU worker processes,
    `host_workers` of `task_weights` each). Host: the source tensor being cut and its encoding."""
    est = MemoryEstimate(budget)
    if hessian:
        # the tuning runs its own whole layer and borrows the calibration's: no streamed experts beside it
        cal = calibration_need(shapes, rows, seq_len, BATCH_ROWS, budget=budget, stream=not tune)
        est.stages.append(cal)
        est.stages.append(rounding_need(budget, shapes, rounding_default, calibration_resident(cal)))
        if tune:
            est.stages.append(tuning_need(budget, shapes, tune_bytes_per_weight, calibration_resident(cal)))
    source = 2 * 4 * largest_tensor  # the float32 source tensor being cut, and its encoded copy
    if encode_default is not None:
        est.stages.append(encode_need(budget, encode_default, shapes.hidden))
        est.host_extra = source
    else:  # CPU worker processes: the host is the device
        est.stages.append(StageNeed("gguf_encode", source + host_workers * task_weights * BYTES["encode_weight"]))
    if hessian:  # the streams, and the source layer read on the host before it goes to the device
        est.host_extra += (calibration_host(shapes, rows, seq_len) + _layer_bytes(shapes)
                           + streamed_host(shapes, cal, True))
    return est


def exl3_estimate(budget: MemoryBudget, shapes: ModelShapes, *, rows: int, seq_len: int, batch_rows: int,
                  default_batch: int) -> MemoryEstimate:
    """`mixq convert` to EXL3: the calibration forward, and the trellis encoding beside its resident part. Host:
    the layer read from the checkpoint and its quantized copy handed to the next layer."""
    est = MemoryEstimate(budget)
    cal = calibration_need(shapes, rows, seq_len, batch_rows, budget=budget)
    est.stages += [cal, exl3_encode_need(budget, shapes, default_batch, calibration_resident(cal))]
    # the streams, the layer read from the checkpoint and its quantized copy handed to the next layer
    est.host_extra = (calibration_host(shapes, rows, seq_len) + 2 * _layer_bytes(shapes)
                      + streamed_host(shapes, cal, True))
    return est


def imatrix_estimate(budget: MemoryBudget, shapes: ModelShapes, *, rows: int, seq_len: int) -> MemoryEstimate:
    """`mixq imatrix`: the calibration forward with Σ x² accumulators."""
    est = MemoryEstimate(budget)
    cal = calibration_need(shapes, rows, seq_len, BATCH_ROWS, full=False, budget=budget)
    est.stages.append(cal)
    est.host_extra = calibration_host(shapes, rows, seq_len) + _layer_bytes(shapes) + streamed_host(shapes, cal, False)
    return est


def eval_estimate(budget: MemoryBudget, shapes: ModelShapes, *, ctx: int, batch_windows: int, models: int,
                  state_bytes: int, kl_default: int) -> tuple[MemoryEstimate, bool]:
    """`mixq eval`: the forward (every model's hidden streams on the device when they fit beside one layer and one
    batch of windows, else on the host; the routed experts a group at a time when the layer does not fit) and the
    logits' KL passes. Returns (estimate, streams on the device)."""
    est = MemoryEstimate(budget)
    on_device = budget.device.type != "cpu" and models > 0
    if on_device:  # the streams on the device only beside the whole layer: streamed experts cost more than they do
        with_states = eval_forward_need(shapes, ctx, batch_windows, state_bytes, models)
        on_device = with_states.need <= budget.bytes
    fwd = eval_forward_need(shapes, ctx, batch_windows, state_bytes if on_device else 0, models, budget)
    if models > 0:  # no torch forward when every model's logits come from a file or an engine
        est.stages.append(fwd)
    est.stages.append(eval_logits_need(budget, shapes, ctx, kl_default))
    est.host_extra = ((0 if on_device else models * state_bytes) + _layer_bytes(shapes) // 2
                      + streamed_host(shapes, fwd, False))
    return est, on_device


def announce(est: MemoryEstimate, verb: str, *, show: bool = True, flag: str = "--gpu-memory") -> dict:
    """The up-front step of a verb: the line on stderr (when `show`), then the refusal of a given budget its
    smallest piece cannot meet (InputError, before any work). Without --gpu-memory the free memory sets the pieces
    and a shortfall is said on the line, not refused: the figures are estimates, and the free memory is not
    something the user chose. Returns the estimate as the result's `memory` entry."""
    if est.budget.given:
        est.check(flag)
    if show:
        say(est, verb)
    return est.to_dict()


def say(est: MemoryEstimate, verb: str) -> None:
    """The up-front line on stderr (a verb whose later checks can still refuse its input says it after them, so
    that a refusal stays the one line on stderr)."""
    print(f"mixq {verb}: {est.line()}", file=sys.stderr, flush=True)
