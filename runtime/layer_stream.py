"""The glm5_next text decoder run one layer at a time over many token rows (calibration and evaluation share it).

transformers' `Glm5NextTextModel` is built on the meta device, so it costs no memory; one decoder layer at a time
is materialised from checkpoint-named tensors (`fetch(hf_name) -> tensor`), run over the hidden streams of every
row, and released. Peak memory is one layer's weights plus the hidden streams, whatever the depth of the model.
The forward is transformers' own decoder-layer module, called exactly as `Glm5NextTextModel.forward` calls it
(all-true mask, positions 0..seq-1, no rotary embeddings, the DSA top-k indices handed from layer to layer), so a
row gives the same numbers as the whole model run on that row.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Callable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from mixq.errors import InputError
from mixq.formats import glm5next
from mixq.formats.glm5next import global_hf_name
from mixq.runtime.expert_groups import REDUCTIONS, ExpertGroups, empty_with_host_experts, register, routed_experts
from mixq.runtime.overlap import host_empty

Fetch = Callable[[str], torch.Tensor]
# checkpoint names of the tensors outside the decoder layers
EMBED_NAME = global_hf_name("embed")
NORM_NAME = global_hf_name("norm")
HEAD_NAME = global_hf_name("lm_head")
PREFIX = glm5next.TEXT_PREFIX.rstrip(".")


def _libc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return None


_MALLOC_TRIM = _libc_trim()


def return_freed_memory() -> None:
    """Return freed heap pages to the system (glibc `malloc_trim`). glibc raises its mmap threshold after large
    frees, so later layer-sized tensors come from the heap, and the holes they leave would otherwise make the
    resident set grow layer after layer (measured: +33 MB per 25 MB layer on a tiny 12-layer model)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)



# ---------------------------------------------------------------------------------------------- name mapping

def module_sources(layer: int, key: str, n_stack: int = 0) -> list[list[str]]:
    """Checkpoint tensors of parameter ``key`` of transformers' decoder layer ``layer`` (from the architecture
    table): [stacked experts][parts concatenated on dim 0]."""
    src = glm5next.module_sources(layer, key, n_stack)
    if src is None:
        raise InputError(f"layer {layer}: transformers' parameter {key!r} has no glm5_next tensor in the table")
    return src


def module_to_hf(layer: int, local: str) -> str:
    """Parameter name inside a decoder layer module (Linear modules only) -> checkpoint tensor name."""
    (name,), = module_sources(layer, local)
    return name


def _row(parts: list[str], values: Mapping[str, torch.Tensor], fetch: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """One row of a module tensor: its checkpoint tensors `parts` concatenated on dim 0, each from `values` where
    it is there, else from `fetch`."""
    got = [values[n] if n in values else fetch(n) for n in parts]
    return torch.cat(got, 0) if len(got) > 1 else got[0]


def _fill_row(row: torch.Tensor, parts: list[str], get: Callable[[str], torch.Tensor]) -> None:
    """Copy the checkpoint tensors `parts` (get: HF name -> tensor, on any device) into a module row that holds them
    concatenated on dim 0 (a whole tensor, or one routed expert's row of a stack): each straight into its slice,
    the row never assembled, unless the parts' shapes only fit once concatenated."""
    got = {n: get(n) for n in parts}
    if len(got) == 1:
        row.copy_(got[parts[0]].reshape(row.shape))
    elif all(t.shape[1:] == row.shape[1:] for t in got.values()):
        for n, view in _part_views(row, parts, lambda n: got[n].shape[0]):
            view.copy_(got[n])
    else:
        row.copy_(torch.cat([t.to(row.device) for t in got.values()], 0).reshape(row.shape))


@torch.no_grad()
def fill_module(module: nn.Module, layer: int, fetch: Callable[[str], torch.Tensor]) -> None:
    """Write every tensor of the module (materialised, uninitialised) from its checkpoint tensors (fetch: HF name
    -> tensor), each copied straight into its slice: no state dict is assembled (at 288 routed experts that is a
    host copy of the layer's experts, twice, and a third through load_state_dict)."""
    for key, ref in module.state_dict(keep_vars=True).items():
        src = module_sources(layer, key, ref.shape[0] if ref.dim() else 0)
        rows = [ref[r] for r in range(len(src))] if len(src) > 1 else [ref]
        for row, parts in zip(rows, src):
            _fill_row(row, parts, fetch)


def _part_views(row: torch.Tensor, parts: list[str], length: Callable[[str], int]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) of each checkpoint tensor of a module row that holds `parts` concatenated on dim 0, each
    `length(name)` long."""
    off = 0
    for n in parts:
        k = int(length(n))
        yield n, row[off:off + k]
        off += k


def stack_rows(stacks: Mapping[tuple[str, ...], torch.Tensor]) -> dict[str, torch.Tensor]:
    """{checkpoint name: its row} of whole stacks ({names in row order: a (len(names), ...) tensor})."""
    return {n: t[i] for names, t in stacks.items() for i, n in enumerate(names)}


class _RowsInto(torch.autograd.Function):
    """Rows of a module's stacked tensor replaced in place by differentiable rows; the tensor itself is returned,
    and its gradient flows back to those rows only (the other rows are constants). No copy of the stack."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, target: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.index = index
        target[index] = rows
        return target.view_as(target)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.index], None, None


def layer_params(module: nn.Module, layer: int, values: Mapping[str, torch.Tensor],
                 fetch: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The module's tensors that hold any of `values` (HF name -> tensor), assembled from their checkpoint tensors
    (concatenated on dim 0, stacked per routed expert), the other parts of such a tensor from `fetch`. A stacked
    tensor (routed experts) is the module's own, its rows that hold any of `values` written in place and
    differentiable (the module then holds them): moving a few experts neither copies the others nor restacks the
    layer."""
    out: dict[str, torch.Tensor] = {}
    for key, ref in module.state_dict(keep_vars=True).items():
        src = module_sources(layer, key, ref.shape[0] if ref.dim() else 0)
        if not any(n in values for parts in src for n in parts):
            continue
        if len(src) == 1:
            out[key] = _row(src[0], values, fetch).reshape(ref.shape)
            continue
        live = [r for r, parts in enumerate(src) if any(n in values for n in parts)]
        rows = torch.stack([_row(src[r], values, fetch).reshape(ref.shape[1:]) for r in live])
        out[key] = _RowsInto.apply(rows, ref, torch.tensor(live, device=ref.device))
    return out


def stacked_rows(module: nn.Module, layer: int, key: str, rows: range, values: Mapping[str, torch.Tensor],
                 fetch: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """Rows `rows` of the module's stacked tensor `key` (routed experts), assembled from `values` (HF name ->
    tensor) and, for the parts not among them, `fetch`: (len(rows), ...) as the stack holds them."""
    ref = module.get_parameter(key)
    src = module_sources(layer, key, ref.shape[0])
    return torch.stack([_row(src[r], values, fetch).reshape(ref.shape[1:]) for r in rows])


def stacked_block(module: nn.Module, layer: int, key: str, rows: range,
                  stacks: Mapping[tuple[str, ...], torch.Tensor], fetch: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """Rows `rows` of the module's stacked tensor `key`, as :func:`stacked_rows` gives them, from whole stacks:
    `stacks` maps the checkpoint names of one part over those rows (in row order) to a (len(rows), ...) tensor.
    Where every part of the rows is such a stack, the rows are those stacks concatenated on dim 1 (one copy, and a
    gradient that reaches each stack as one tensor, not row by row); else row by row, the other parts from
    `fetch`."""
    ref = module.get_parameter(key)
    src = module_sources(layer, key, ref.shape[0])
    whole = [stacks.get(tuple(names)) for names in zip(*(src[r] for r in rows))]
    if all(t is not None for t in whole):
        return torch.cat(whole, 1) if len(whole) > 1 else whole[0]
    return stacked_rows(module, layer, key, rows, stack_rows(stacks), fetch)


def stacked_parts(module: nn.Module, layer: int, shape: Callable[[str], tuple]) -> dict[str, torch.Tensor]:
    """{checkpoint name: the view of the module's stacked (routed-expert) tensor that holds it}: row r of a stack
    holds its parts concatenated on dim 0, each as long as its checkpoint tensor (`shape`: name -> shape)."""
    out: dict[str, torch.Tensor] = {}
    for key, ref in module.state_dict(keep_vars=True).items():
        src = module_sources(layer, key, ref.shape[0] if ref.dim() else 0)
        if len(src) < 2:
            continue
        for r, parts in enumerate(src):
            out.update(_part_views(ref[r], parts, lambda n: shape(n)[0]))
    return out


@torch.no_grad()
def write_values(module: nn.Module, layer: int, values: Mapping[str, torch.Tensor],
                 fetch: Callable[[str], torch.Tensor]) -> None:
    """Copy `values` (HF name -> tensor) into the module's tensors in place, a stacked tensor row by row (no copy
    of the whole stack); the other parts of a row that holds one of them come from `fetch`. Host or device
    tensors alike: each row goes to the module's device."""
    def get(n: str) -> torch.Tensor:
        return values[n] if n in values else fetch(n)

    for key, ref in module.state_dict(keep_vars=True).items():
        src = module_sources(layer, key, ref.shape[0] if ref.dim() else 0)
        rows = [ref[r] for r in range(len(src))] if len(src) > 1 else [ref]
        for row, parts in zip(rows, src):
            if any(n in values for n in parts):
                _fill_row(row, parts, get)


# rows per layer call of the calibration and tuning passes (independent sequences, run together): the Hessian sums
# and the tuning's held-out batches are made per batch, so it is part of what a conversion computes
# (runtime/memory_budget.py counts one batch)
BATCH_ROWS = 4


class DecoderStream:
    """transformers' glm5_next text decoder on the meta device, materialised and run one layer at a time.

    config: the checkpoint's config.json (dict). device: where layers run. dtype: the compute dtype of layers
    and hidden streams. batch_rows: rows per layer call (the rows of a batch are independent sequences).
    expert_group: routed experts per group on the device (runtime/expert_groups.py); None or at least the
    layer's experts: the whole layer on the device.
    """

    def __init__(self, config: dict, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 batch_rows: int = BATCH_ROWS, expert_group: int | None = None) -> None:
        from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

        self.device = torch.device(device)
        self.dtype = dtype
        self.batch_rows = max(1, int(batch_rows))
        cfg = Glm5NextConfig.from_dict(dict(config))
        self.text_config = cfg.text_config
        self.text_config._attn_implementation = "sdpa"  # what from_pretrained picks for this model
        with torch.device("meta"):
            self.skeleton = Glm5NextTextModel(self.text_config)
        self.num_layers = int(self.text_config.num_hidden_layers)
        self.hc_mult = int(self.text_config.hc_mult)
        self.groups = self._stream_experts(expert_group)  # None: the whole layer on the device

    def _stream_experts(self, size: int | None) -> ExpertGroups | None:
        """Mark every routed-experts module to be streamed `size` experts at a time (None: not needed), through
        the experts implementation of runtime/expert_groups.py; the groups, or None when not streamed."""
        n = int(getattr(self.text_config, "n_routed_experts", 0) or 0)
        if size is None or n == 0 or int(size) >= n:
            return None
        reference = self.text_config._experts_implementation or "eager"
        if reference not in REDUCTIONS:
            raise InputError(f"routed experts in groups reproduce the experts implementations "
                             f"{', '.join(REDUCTIONS)}, not {reference!r}")
        groups = ExpertGroups(max(1, int(size)), self.device, reference)
        for layer in self.skeleton.layers:
            experts = routed_experts(layer)
            if experts is not None:
                experts.expert_groups = groups
        self.text_config._experts_implementation = register()
        return groups

    def _host_experts(self, mod: nn.Module) -> nn.Module | None:
        """The layer's routed-experts module when its experts stay on the host (streamed), else None."""
        experts = getattr(getattr(mod, "mlp", None), "experts", None)
        return experts if self.groups is not None and hasattr(experts, "expert_groups") else None

    # -- weights
    def materialize(self, layer: int, fetch: Fetch) -> nn.Module:
        """Decoder layer `layer` holding the tensors `fetch` returns (checkpoint names), on `device`, eval mode.
        Each tensor crosses to the device as `fetch` gives it (16-bit weights as stored: half the bytes of float32)
        and is widened there."""
        mod = self.skeleton.layers[layer]
        experts = self._host_experts(mod)
        if experts is None:
            mod.to_empty(device=self.device)
            fill_module(mod, layer, lambda n: fetch(n).to(self.device).float())  # tensor by tensor
            return mod.to(self.dtype).eval()
        # streamed: the routed experts widened on the host (pinned from a CUDA device: the groups' copies at DMA
        # speed), never allocated on the device; the rest of the layer on the device
        empty_with_host_experts(mod, experts, self.device, self.dtype)
        path = next(k for k, m in mod.named_modules() if m is experts)
        host = {n for key in ("gate_up_proj", "down_proj")
                for parts in module_sources(layer, f"{path}.{key}", experts.get_parameter(key).shape[0])
                for n in parts}
        fill_module(mod, layer, lambda n: fetch(n).float() if n in host else fetch(n).to(self.device).float())
        return mod.to(self.dtype).eval()

    def release(self, layer: int) -> None:
        """Give layer `layer`'s weights back (the module returns to the meta device) and hand the freed memory
        back to the system."""
        self.skeleton.layers[layer].to("meta")
        return_freed_memory()

    def layer_prefix(self, layer: int) -> str:
        """Checkpoint-name prefix of decoder layer `layer`'s tensors."""
        return f"{PREFIX}.layers.{layer}."

    # -- hidden streams
    def embed(self, input_ids: torch.Tensor, fetch: Fetch, out_device: str | torch.device | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """(rows, seq, hc_mult, hidden) streams of the embedded tokens, as the text model starts."""
        w = fetch(EMBED_NAME).to(self.dtype)
        out = torch.empty(*input_ids.shape, self.hc_mult, w.shape[1], dtype=out_dtype or self.dtype,
                          device=out_device or w.device)
        for sl in self.batches(input_ids.shape[0]):
            emb = F.embedding(input_ids[sl], w)
            out[sl] = emb.unsqueeze(2).expand(-1, -1, self.hc_mult, -1)
        return out

    def batches(self, rows: int) -> Iterator[slice]:
        for r in range(0, rows, self.batch_rows):
            yield slice(r, min(r + self.batch_rows, rows))

    def forward_batch(self, mod: nn.Module, hidden: torch.Tensor, prev_topk: torch.Tensor | None):
        """One decoder-layer call on a batch of rows (already on `device`): (streams out, DSA top-k or None)."""
        with torch.no_grad():
            return self.call_layer(mod, hidden, prev_topk)

    def call_layer(self, mod: nn.Module, hidden: torch.Tensor, prev_topk: torch.Tensor | None,
                   params: dict[str, torch.Tensor] | None = None):
        """`forward_batch` with autograd as the caller has it; `params` (the module's state-dict names) replace
        the module's own tensors for this call (torch.func.functional_call), so gradients can reach them."""
        b, s = hidden.shape[:2]
        kw = dict(attention_mask=torch.ones(b, s, dtype=torch.bool, device=self.device),
                  position_ids=torch.arange(s, device=self.device).unsqueeze(0), position_embeddings=None,
                  prev_topk_indices=prev_topk)
        if params is None:
            return mod(hidden, **kw)
        return functional_call(mod, params, (hidden,), kw)

    def run_layer(self, mod: nn.Module, hidden: torch.Tensor, topk: torch.Tensor | None, *,
                  before_batch: Callable[[slice], None] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All rows of `hidden` (any device and dtype) through `mod`, batch by batch, into new tensors on the
        CPU (computed in `dtype`). Returns (hidden streams, DSA top-k indices or None)."""
        outs, topks = None, []
        for sl in self.batches(hidden.shape[0]):
            if before_batch is not None:
                before_batch(sl)
            prev = None if topk is None else topk[sl].to(self.device)
            out, tk = self.forward_batch(mod, hidden[sl].to(self.device, self.dtype), prev)
            if outs is None:  # pinned from a CUDA device: the copies back, and the next layer's reads, at DMA speed
                outs = host_empty((hidden.shape[0], *out.shape[1:]), out.dtype, pinned=out.is_cuda)
            outs[sl].copy_(out)
            if tk is not None:
                topks.append(tk.to("cpu"))
        return outs, (torch.cat(topks) if topks else None)

    def run_layer_inplace(self, mod: nn.Module, hidden: torch.Tensor,
                          topk: torch.Tensor | None) -> torch.Tensor | None:
        """All rows of `hidden` through `mod`, each batch's output written back over its input rows (same device
        and dtype as `hidden`: no second copy of the streams). Returns the new DSA top-k indices or None."""
        topks = []
        for sl in self.batches(hidden.shape[0]):
            prev = None if topk is None else topk[sl].to(self.device)
            out, tk = self.forward_batch(mod, hidden[sl].to(self.device, self.dtype), prev)
            hidden[sl] = out.to(hidden.device, hidden.dtype)
            if tk is not None:
                topks.append(tk.to(hidden.device))
        return torch.cat(topks) if topks else None

    # -- the end of the text model
    def final_hidden(self, hidden: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
        """norm(hc_head(streams)) — the text model's last hidden state — for rows of streams on `device`."""
        norm = self.skeleton.norm
        if norm.weight.device != self.device or norm.weight.device.type == "meta":
            norm.to_empty(device=self.device)
        norm.load_state_dict({"weight": norm_weight.to(self.device)})
        norm.to(self.dtype)
        with torch.no_grad():
            return norm(self.skeleton.hc_head(hidden.to(self.device, self.dtype)))
