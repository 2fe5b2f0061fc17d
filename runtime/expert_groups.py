"""Routed experts streamed through the device a group at a time (`--gpu-memory` below one decoder layer).

The layer's routed-expert stacks stay on the host; the rest of the layer (attention, router, shared expert, norms)
is on the device. Each group of experts is copied to the device, applied to the tokens routed to it and released,
so a layer needs one group of experts on the device instead of all of them (runtime/memory_budget.py sizes the
group).

The forward is transformers' own: `EXPERT_IMPLEMENTATION` is an experts implementation registered in transformers'
`ALL_EXPERTS_FUNCTIONS` (the seam its `@use_experts_implementation` experts classes dispatch through). Per group it
calls the implementation the model would have used (`ExpertGroups.reference`: "grouped_mm", the default, or
"eager") on the group's (token, slot) pairs, one slot each, which gives every pair its weighted expert output:
both multiply one expert's tokens at a time, so a pair's product is the one the whole layer forms. The pairs'
outputs are then summed per token exactly as that implementation sums them (`REDUCTIONS`: over the top-k slots
in slot order, or eager's one `index_add_` per expert in ascending expert order). The sum of a token is therefore
formed from the same terms in the same order whatever the group size (tests/runtime/test_expert_groups.py
compares the bytes with the whole-layer forward). "batched_mm" is not reproduced: its one `bmm` over every pair
of the layer rounds a pair's product differently with the number of pairs (measured: 1 ulp on mini).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from mixq.runtime.overlap import host_empty

EXPERT_IMPLEMENTATION = "mixq_expert_groups"


@dataclass(frozen=True)
class ExpertGroups:
    """Experts per group (`size`), the device a group is copied to, and the experts implementation whose
    numbers the groups reproduce (`reference`, the config's before the groups replaced it)."""

    size: int
    device: torch.device
    reference: str


def group_ranges(n: int, size: int) -> list[tuple[int, int]]:
    """[e0, e1) of consecutive groups of `size` experts over `n`."""
    size = max(1, int(size))
    return [(e0, min(e0 + size, n)) for e0 in range(0, n, size)]


def routed_experts(mod: nn.Module) -> nn.Module | None:
    """The stacked routed-experts module of a decoder layer (or NextN block), else None (a dense MLP)."""
    experts = getattr(getattr(mod, "mlp", None), "experts", None)
    return experts if experts is not None and hasattr(experts, "gate_up_proj") else None


def empty_with_host_experts(mod: nn.Module, experts: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """`mod` (on the meta device) allocated for streaming: every module but `experts` emptied onto `device`, the
    routed-expert stacks as host tensors of `dtype` (pinned from a CUDA device: the groups' copies at DMA speed),
    never allocated on the device."""
    for m in mod.modules():
        if m is not experts:
            m.to_empty(device=device, recurse=False)
    for key, p in list(experts.named_parameters(recurse=False)):
        host = host_empty(p.shape, dtype, pinned=device.type == "cuda")
        experts._parameters[key] = nn.Parameter(host, requires_grad=p.requires_grad)


def groups_of(experts: nn.Module) -> ExpertGroups | None:
    """The module's ExpertGroups when its experts are streamed, else None (the whole stack on its device)."""
    return getattr(experts, "expert_groups", None)


def expert_blocks(experts: nn.Module, device: torch.device | None = None,
                  dtype: torch.dtype | None = None) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """(e0, e1, gate_up (e1-e0, 2I, H), down (e1-e0, H, I)) of the module's routed experts on the device a group
    at a time: the whole stacks at once when they are not streamed (views, no copy), else each group copied from
    the host and released after the caller moves on."""
    g = groups_of(experts)
    n = experts.gate_up_proj.shape[0]
    dev = device if device is not None else (g.device if g is not None else experts.gate_up_proj.device)
    for e0, e1 in group_ranges(n, g.size if g is not None else n):
        gu = experts.gate_up_proj[e0:e1].to(dev, dtype)
        dn = experts.down_proj[e0:e1].to(dev, dtype)
        yield e0, e1, gu, dn
        del gu, dn


def _reduce_slots(pairs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """grouped_mm: each token's weighted slots summed over the top-k dimension."""
    t, k = index.shape
    return pairs.view(t, k, -1).sum(dim=1)


def _reduce_eager(pairs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """eager: one `index_add_` per expert in ascending expert order into zeros, i.e. each token's terms added one
    at a time in ascending order of their expert."""
    t, k = index.shape
    pairs = pairs.view(t, k, -1)
    order = torch.sort(index, dim=1, stable=True).indices
    out = torch.zeros_like(pairs[:, 0])
    for j in range(k):
        out += pairs.gather(1, order[:, j, None, None].expand(-1, 1, pairs.shape[-1]))[:, 0]
    return out


# how each of transformers' experts implementations the groups reproduce sums a token's weighted expert outputs
REDUCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "grouped_mm": _reduce_slots,
    "eager": _reduce_eager,
}


def _group_module(experts: nn.Module, e0: int, e1: int, gate_up: torch.Tensor, down: torch.Tensor) -> nn.Module:
    """A view of the experts module holding experts [e0, e1) only (the same class, attributes and config)."""
    sub = copy.copy(experts)
    sub._parameters = {**experts._parameters, "gate_up_proj": gate_up, "down_proj": down}
    for b in ("gate_up_proj_bias", "down_proj_bias"):
        if getattr(experts, "has_bias", False) and b in experts._parameters:
            sub._parameters[b] = experts._parameters[b][e0:e1].to(gate_up.device)
    sub.num_experts = e1 - e0
    sub.__dict__.pop("forward", None)
    return sub


def grouped_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts implementation `EXPERT_IMPLEMENTATION` (module docstring): transformers' reference
    implementation applied a group of experts at a time, the tokens' sums formed as it forms them."""
    g = groups_of(self)
    if g is None:
        raise RuntimeError("the expert-groups implementation runs on a module whose experts are streamed")
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    reduce = REDUCTIONS[g.reference]
    impl = ALL_EXPERTS_FUNCTIONS.get_interface(g.reference, type(self).forward.__wrapped__)
    t, k = top_k_index.shape
    expert = top_k_index.reshape(-1)
    weight = top_k_weights.reshape(-1)
    pairs = torch.zeros(t * k, hidden_states.shape[-1], dtype=hidden_states.dtype, device=hidden_states.device)
    for e0, e1, gu, dn in expert_blocks(self, hidden_states.device):
        sel = ((expert >= e0) & (expert < e1)).nonzero().squeeze(1)
        if sel.numel() == 0:
            continue
        sub = _group_module(self, e0, e1, gu, dn)
        pairs[sel] = impl(sub, hidden_states[sel // k], (expert[sel] - e0).unsqueeze(1),
                          weight[sel].unsqueeze(1)).to(pairs.dtype)
    return reduce(pairs, top_k_index).to(hidden_states.dtype)


def register() -> str:
    """Register `grouped_experts_forward` in transformers' experts implementations; returns its name (what a
    config's `_experts_implementation` names to dispatch to it)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERT_IMPLEMENTATION, grouped_experts_forward)
    return EXPERT_IMPLEMENTATION
