"""A DFlash2 drafter in plain torch, for bench/engines/drafter_check.py: the forward exllamav3 1.6.5 runs when it drafts
(reference §6.3), differentiable, so a random drafter can be distilled cheaply from its target, and so the engine's
draft logits can be checked against an independent forward on the same weights.

What one drafting round computes (block size b, anchor = the newest verified token at position p):
  context  c_j = hidden_norm(fc([target states at the tap layers]_j)), j < p (one stream for every layer);
  block    x = target_embedding([anchor, mask × (b−1)]) at positions p .. p+b−1;
  layer    y = conv_a.prepare(norm1(x)); x += conv_a.finish(o_proj(attn(y)));
           y = conv_m.prepare(norm2(x)); x += conv_m.finish(down(silu(gate(y)) · up(y)))
           attention: queries from the block rows; keys/values from the context (k_proj/v_proj of c, k_norm, RoPE
           at j) and from the block rows; every block row sees the whole context and the whole block;
  conv     grouped dynamic causal convolution over the block rows:
           out_t = Σ_tap (base[tap] + dyn_t[tap]) · x_{t−tap},
           the dynamic part projected from the conv's input (kernel_projection, first half for prepare, second
           half for finish);
  output   draft logits of row i (1 ≤ i < b) = target_lm_head(norm(x_i)), the guess for the token at p+i.
The selector (candidate codebooks) only reranks those logits' top-k and is not trained here.
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from mixq.formats.dflash2 import DrafterDims, drafter_shapes


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """NEOX-style rotary embedding of x (B, T, heads, d) at integer positions pos (B, T)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = pos.to(torch.float32)[..., None] * inv  # (B, T, d/2)
    cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def dynamic_conv(x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor, group: int) -> torch.Tensor:
    """Grouped dynamic causal convolution along the rows: x (B, L, H), dyn (B, L, taps, H/group), base (taps, H)."""
    b, n, h = x.shape
    taps, groups = base.shape[0], h // group
    xg = x.view(b, n, groups, group)
    out = torch.zeros_like(xg)
    for tap in range(min(taps, n)):
        w = base[tap].view(1, 1, groups, group) + dyn[:, tap:, tap, :, None]
        out[:, tap:] = out[:, tap:] + w * xg[:, : n - tap]
    return out.view(b, n, h)


class TorchDrafter(torch.nn.Module):
    """The drafter's weights as parameters (fp32), with the target's embedding and lm_head as fixed buffers."""

    def __init__(self, config: dict, weights: dict[str, torch.Tensor], embedding: torch.Tensor,
                 lm_head: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        self.dims = DrafterDims.from_config(config)
        dc = config.get("dflash_config") or {}
        self.block = int(config.get("block_size", dc.get("block_size", 8)))
        self.mask_id = int(dc.get("mask_token_id", config.get("mask_token_id", 0)))
        self.eps = float(config["rms_norm_eps"])
        self.theta = float(config.get("rope_theta", 10000.0))
        self.names = list(drafter_shapes(config))
        self.params = torch.nn.ParameterList([torch.nn.Parameter(weights[n].detach().float().clone())
                                              for n in self.names])
        self.index = {n: i for i, n in enumerate(self.names)}
        self.register_buffer("embedding", embedding.detach().float(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach().float(), persistent=False)

    def w(self, name: str) -> torch.Tensor:
        return self.params[self.index[name]]

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu() for n, p in zip(self.names, self.params)}

    def context(self, states: list[torch.Tensor]) -> torch.Tensor:
        """(B, T, H) context stream from the target states at the tap layers (each (B, T, H), tap order)."""
        c = torch.cat([s.float() for s in states], -1) @ self.w("fc.weight").t()
        return rms_norm(c, self.w("hidden_norm.weight"), self.eps)

    def forward(self, context: torch.Tensor, anchor_pos: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Normed draft states (B, b, H) of one round per row: context (B, T, H) of which positions < anchor_pos
        (B,) are visible, anchor token ids (B,)."""
        d, b = self.dims, self.block
        bsz, t_ctx, _ = context.shape
        dev = context.device
        ids = torch.full((bsz, b), self.mask_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchors
        x = self.embedding[ids]
        pos_blk = anchor_pos[:, None] + torch.arange(b, device=dev)
        pos_ctx = torch.arange(t_ctx, device=dev)[None].expand(bsz, t_ctx)
        visible = torch.cat([pos_ctx < anchor_pos[:, None], torch.ones(bsz, b, dtype=torch.bool, device=dev)], 1)
        mask = visible[:, None, None, :]  # (B, 1, 1, T + b): every block row sees the same keys
        for i in range(d.layers):
            p = f"layers.{i}."
            y, fin = self._prepare(rms_norm(x, self.w(p + "input_layernorm.weight"), self.eps), p + "attention_conv.")
            o = self._attention(y, context, pos_blk, pos_ctx, mask, p + "self_attn.")
            x = x + dynamic_conv(o, fin, self.w(p + "attention_conv.base_kernel")[1], d.group)
            y, fin = self._prepare(rms_norm(x, self.w(p + "post_attention_layernorm.weight"), self.eps),
                                   p + "mlp_conv.")
            m = (F.silu(y @ self.w(p + "mlp.gate_proj.weight").t()) * (y @ self.w(p + "mlp.up_proj.weight").t())
                 ) @ self.w(p + "mlp.down_proj.weight").t()
            x = x + dynamic_conv(m, fin, self.w(p + "mlp_conv.base_kernel")[1], d.group)
        return rms_norm(x, self.w("norm.weight"), self.eps)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        return states @ self.lm_head.t()

    def _prepare(self, y: torch.Tensor, conv: str) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.dims
        dyn = (y @ self.w(conv + "kernel_projection.weight").t()).view(*y.shape[:2], 2, d.kernel, d.hidden // d.group)
        return dynamic_conv(y, dyn[:, :, 0], self.w(conv + "base_kernel")[0], d.group), dyn[:, :, 1]

    def _attention(self, y, context, pos_blk, pos_ctx, mask, a: str) -> torch.Tensor:
        d = self.dims
        bsz, b, _ = y.shape
        t_ctx = context.shape[1]
        q = (y @ self.w(a + "q_proj.weight").t()).view(bsz, b, d.heads, d.head_dim)
        q = rope(rms_norm(q, self.w(a + "q_norm.weight"), self.eps), pos_blk, self.theta)
        src = torch.cat([context, y], 1)
        k = (src @ self.w(a + "k_proj.weight").t()).view(bsz, t_ctx + b, d.kv_heads, d.head_dim)
        k = rope(rms_norm(k, self.w(a + "k_norm.weight"), self.eps), torch.cat([pos_ctx, pos_blk], 1), self.theta)
        v = (src @ self.w(a + "v_proj.weight").t()).view(bsz, t_ctx + b, d.kv_heads, d.head_dim)
        rep = d.heads // d.kv_heads
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return o.transpose(1, 2).reshape(bsz, b, d.heads * d.head_dim) @ self.w(a + "o_proj.weight").t()


def sample_rounds(lengths: torch.Tensor, n: int, block: int, gen: torch.Generator,
                  min_context: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """n random (row, anchor position) pairs with at least `min_context` context positions and a full block
    of labels after the anchor. lengths (N,): valid tokens per row."""
    rows = torch.randint(0, lengths.numel(), (n,), generator=gen)
    hi = (lengths[rows] - block).clamp_min(min_context)
    pos = min_context + (torch.rand(n, generator=gen) * (hi - min_context + 1)).long()
    return rows, pos.clamp_max(hi)


def round_labels(ids: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, block: int) -> torch.Tensor:
    """Tokens rows 1..b−1 of each round should guess: ids[row, pos + i] (B, b−1)."""
    return ids[rows[:, None], pos[:, None] + torch.arange(1, block)]


def distill(model: TorchDrafter, ids: torch.Tensor, states: list[torch.Tensor], *, steps: int = 3000,
            seconds: float = 90.0, batch: int = 256, lr: float = 3e-3, decay: float = 0.7, seed: int = 0,
            log=print) -> dict:
    """Train the drafter to guess the target's own continuation: ids (N, T) are sequences the target generated
    greedily, states its hidden states at the tap layers on them. Cross-entropy of each drafted row against the
    sequence, row i weighted decay^(i−1) (acceptance stops at the first miss). Stops after `steps` or `seconds`.
    Returns {"steps", "seconds", "loss_first", "loss_last", "row1_accuracy"} (accuracy on the last 20 batches)."""
    dev = model.lm_head.device
    gen = torch.Generator().manual_seed(seed)
    b = model.block
    lengths = torch.full((ids.shape[0],), ids.shape[1])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    row_w = torch.tensor([decay ** i for i in range(b - 1)], device=dev)
    row_w = row_w / row_w.sum()
    t0, losses, hits = time.time(), [], []
    step = 0
    for step in range(steps):
        rows, pos = sample_rounds(lengths, batch, b, gen)
        labels = round_labels(ids, rows, pos, b).to(dev)
        t_ctx = int(pos.max())
        ctx = model.context([s[rows, :t_ctx].to(dev) for s in states])
        logits = model.logits(model(ctx, pos.to(dev), ids[rows, pos].to(dev))[:, 1:])
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(batch, b - 1)
        loss = (ce.mean(0) * row_w).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        hits.append((logits[:, 0].argmax(-1) == labels[:, 0]).float().mean().item())
        if step % 200 == 0:
            log(f"distill step {step}: loss {losses[-1]:.3f}, row-1 accuracy {hits[-1]:.3f}")
        if time.time() - t0 > seconds:
            break
    return {"steps": step + 1, "seconds": round(time.time() - t0, 1), "loss_first": losses[0],
            "loss_last": sum(losses[-20:]) / len(losses[-20:]), "row1_accuracy": sum(hits[-20:]) / len(hits[-20:])}
