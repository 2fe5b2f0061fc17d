"""The NextN (MTP) block of glm5_next, run from transformers' own modules.

transformers' glm5_next loads no NextN weights and has no NextN forward, so the block is assembled here from its
modules: the body is transformers' DSA attention (indexer "full") and MoE of a one-layer DSA + MoE config, with
plain residuals (the NextN block carries no mHC tensors). The wiring is GLM's DeepSeek-V3-style MTP head
(../shared/reference/exl3-format.md §6.2): at position t the input is
``eh_proj(cat(enorm(embed(token[t+1])), hnorm(h[t])))`` with ``h`` the trunk's final hidden state (the mHC
streams' mean through the final norm), then the block body, then ``shared_head.norm``; the trunk's lm_head turns
that into the logits of token t+2.

`NextNBlock.forward(x, ...)` takes the two inputs packed as ``x[..., 0, :]`` = the embedding of token t+1 and
``x[..., 1, :]`` = ``h[t]``, so it is called like a decoder layer (`DecoderStream.call_layer` / `run_layer`).
"""
from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

from mixq.formats import glm5next
from mixq.formats.glm5next import TEXT_PREFIX
from mixq.runtime.expert_groups import ExpertGroups, empty_with_host_experts, routed_experts

# the NextN-only tensors the block holds (names relative to `layers.{i}.`), besides transformers' layer body
NEXTN_ONLY = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight")


def nextn_config(text_config):
    """A copy of a Glm5NextTextConfig whose one layer is DSA + MoE with a full indexer: the NextN block's body."""
    cfg = copy.deepcopy(text_config)
    cfg.num_hidden_layers = 1
    cfg.layer_types = ["indexed_attention"]
    cfg.mlp_layer_types = ["sparse"]
    cfg.indexer_types = ["full"]
    return cfg


class NextNBlock(nn.Module):
    """One NextN block (transformers modules; names as the checkpoint's `layers.{i}.` tensors)."""

    def __init__(self, text_config) -> None:
        super().__init__()
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextDecoderLayer, Glm5NextTextRMSNorm

        cfg = nextn_config(text_config)
        d, eps = int(cfg.hidden_size), float(cfg.rms_norm_eps)
        body = Glm5NextTextDecoderLayer(cfg, 0)
        self.enorm = Glm5NextTextRMSNorm(d, eps)
        self.hnorm = Glm5NextTextRMSNorm(d, eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.input_layernorm = body.input_layernorm
        self.self_attn = body.self_attn
        self.post_attention_layernorm = body.post_attention_layernorm
        self.mlp = body.mlp
        self.shared_head = nn.Module()
        self.shared_head.norm = Glm5NextTextRMSNorm(d, eps)

    def forward(self, x: torch.Tensor, attention_mask=None, position_ids=None, position_embeddings=None,
                prev_topk_indices=None, **kw) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: (batch, seq, 2, hidden) = [embedding of token t+1, trunk final hidden at t]. Returns (the normed
        output at t, the lm_head input predicting token t+2; the DSA top-k indices)."""
        y = self.eh_proj(torch.cat([self.enorm(x[:, :, 0]), self.hnorm(x[:, :, 1])], dim=-1))
        a, _, topk = self.self_attn(hidden_states=self.input_layernorm(y), attention_mask=attention_mask,
                                    position_ids=position_ids, position_embeddings=None, prev_topk_indices=None)
        y = y + a
        y = y + self.mlp(self.post_attention_layernorm(y))
        return self.shared_head.norm(y), topk


def nextn_sources(layer: int, key: str, n_stack: int = 0) -> list[list[str]]:
    """Checkpoint tensors of parameter `key` of the NextN block at decoder index `layer`: [stacked][parts]."""
    if key in NEXTN_ONLY:
        return [[f"{TEXT_PREFIX}layers.{layer}.{key}"]]
    src = glm5next.module_sources(layer, key, n_stack)
    if src is None:
        raise KeyError(key)
    return src


def nextn_to_hf(layer: int, local: str) -> str:
    """Parameter name inside the NextN block (Linear weights) -> checkpoint tensor name."""
    (name,), = nextn_sources(layer, local)
    return name


@torch.no_grad()
def build_nextn(text_config, layer: int, fetch: Callable[[str], torch.Tensor], *,
                device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                groups: ExpertGroups | None = None) -> NextNBlock:
    """The NextN block at decoder index `layer` holding `fetch(checkpoint name)`'s tensors, on `device`, eval.
    `groups`: the trunk's routed-expert groups when its experts are streamed (`DecoderStream.groups`); the
    block's routed experts then stay on the host and cross to the device a group at a time, as the trunk's do."""
    device = torch.device(device)
    with torch.device("meta"):
        mod = NextNBlock(text_config)
    experts = routed_experts(mod) if groups is not None else None
    if experts is None:
        mod.to_empty(device=device)
    else:
        empty_with_host_experts(mod, experts, device, dtype)
        experts.expert_groups = groups
    for key, ref in mod.state_dict(keep_vars=True).items():
        src = nextn_sources(layer, key, ref.shape[0] if ref.dim() else 0)
        rows = [ref[r] for r in range(len(src))] if len(src) > 1 else [ref]
        for row, parts in zip(rows, src):
            got = [fetch(n).to(row.device).float() for n in parts]
            row.copy_((torch.cat(got, 0) if len(got) > 1 else got[0]).reshape(row.shape))
    return mod.to(dtype).eval()


def nextn_inputs(final_hidden: torch.Tensor, embed_next: torch.Tensor) -> torch.Tensor:
    """(rows, seq-1, 2, hidden) NextN inputs from the trunk's final hidden states (rows, seq, hidden) and the
    embeddings of the same tokens (rows, seq, hidden): position t pairs token t+1's embedding with h[t]."""
    return torch.stack([embed_next[:, 1:], final_hidden[:, :-1]], dim=2)
