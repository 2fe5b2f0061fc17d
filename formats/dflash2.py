"""The DFlash2 speculative-decoding drafter (`DFlash2DraftModel`): its checkpoint layout as one table, and a writer
for drafters laid out as a release ships them (config.json with the DFlash keys under `dflash_config`, one BF16
`model.safetensors`).

A drafter has no embedding and no head: it embeds [anchor, mask × (block_size − 1)] with its target's embedding,
reads the target's hidden states at `target_layer_ids` through `fc` + `hidden_norm`, and its draft logits come
from the target's lm_head. Every name, shape and EXL3 storage policy below follows reference §6.3.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from mixq.errors import FormatError, InputError
from mixq.formats.atomic import atomic_dir, write_json
from mixq.formats.safetensors_io import write_safetensors
from mixq.formats.model_files import read_json

ARCHITECTURE = "DFlash2DraftModel"


@dataclass(frozen=True)
class DrafterDims:
    """The widths a drafter's tensor shapes depend on, read from its config.json as exllamav3 reads them
    (DFlash keys at the top level or under `dflash_config`)."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    taps: int              # len(target_layer_ids): fc reads the concatenated target states
    kernel: int            # conv_kernel_size
    group: int             # conv_group_size
    rank: int              # selector_rank

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> "DrafterDims":
        def get(key: str, default=None):
            v = (config.get("dflash_config") or {}).get(key, config.get(key, default))
            if v is None:
                raise InputError(f"{where}: missing {key!r}")
            return v

        try:
            hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
            dims = cls(hidden=hidden, layers=int(get("num_hidden_layers")), heads=heads,
                       kv_heads=int(get("num_key_value_heads", heads)),
                       head_dim=int(get("head_dim", 0) or hidden // heads),
                       intermediate=int(get("intermediate_size")), vocab=int(get("vocab_size")),
                       taps=len(get("target_layer_ids")), kernel=int(get("conv_kernel_size", 2)),
                       group=int(get("conv_group_size", 16)), rank=int(get("selector_rank")))
        except (TypeError, ValueError) as e:
            raise InputError(f"{where}: bad DFlash2 drafter config ({e})") from None
        if dims.group <= 0 or dims.hidden % dims.group:
            raise InputError(f"{where}: hidden_size {dims.hidden} is not a multiple of conv_group_size {dims.group}")
        return dims


@dataclass(frozen=True)
class DrafterTensor:
    """One row of the layout table: a name ({i} = drafter layer), its shape, how EXL3 stores it, its random init."""
    name: str
    shape: Callable[[DrafterDims], tuple[int, ...]]
    exl3: str              # "trellis" (Linear, padded to 128), "trellis_unpadded" (fc), "fp16_linear", "raw"
    init: str              # "linear" (N(0, 0.02)), "ones", "conv_identity", "codebook" (N(0, 0.02))


def _conv_rows(d: DrafterDims) -> int:
    return 2 * d.kernel * d.hidden // d.group


LAYOUT: tuple[DrafterTensor, ...] = (
    DrafterTensor("fc.weight", lambda d: (d.hidden, d.hidden * d.taps), "trellis_unpadded", "linear"),
    DrafterTensor("hidden_norm.weight", lambda d: (d.hidden,), "raw", "ones"),
    DrafterTensor("layers.{i}.input_layernorm.weight", lambda d: (d.hidden,), "raw", "ones"),
    DrafterTensor("layers.{i}.self_attn.q_proj.weight", lambda d: (d.heads * d.head_dim, d.hidden), "trellis",
                  "linear"),
    DrafterTensor("layers.{i}.self_attn.k_proj.weight", lambda d: (d.kv_heads * d.head_dim, d.hidden), "trellis",
                  "linear"),
    DrafterTensor("layers.{i}.self_attn.v_proj.weight", lambda d: (d.kv_heads * d.head_dim, d.hidden), "trellis",
                  "linear"),
    DrafterTensor("layers.{i}.self_attn.o_proj.weight", lambda d: (d.hidden, d.heads * d.head_dim), "trellis",
                  "linear"),
    DrafterTensor("layers.{i}.self_attn.q_norm.weight", lambda d: (d.head_dim,), "raw", "ones"),
    DrafterTensor("layers.{i}.self_attn.k_norm.weight", lambda d: (d.head_dim,), "raw", "ones"),
    DrafterTensor("layers.{i}.attention_conv.kernel_projection.weight", lambda d: (_conv_rows(d), d.hidden), "trellis",
                  "linear"),
    DrafterTensor("layers.{i}.attention_conv.base_kernel", lambda d: (2, d.kernel, d.hidden), "raw", "conv_identity"),
    DrafterTensor("layers.{i}.post_attention_layernorm.weight", lambda d: (d.hidden,), "raw", "ones"),
    DrafterTensor("layers.{i}.mlp.gate_proj.weight", lambda d: (d.intermediate, d.hidden), "trellis", "linear"),
    DrafterTensor("layers.{i}.mlp.up_proj.weight", lambda d: (d.intermediate, d.hidden), "trellis", "linear"),
    DrafterTensor("layers.{i}.mlp.down_proj.weight", lambda d: (d.hidden, d.intermediate), "trellis", "linear"),
    DrafterTensor("layers.{i}.mlp_conv.kernel_projection.weight", lambda d: (_conv_rows(d), d.hidden), "trellis",
                  "linear"),
    DrafterTensor("layers.{i}.mlp_conv.base_kernel", lambda d: (2, d.kernel, d.hidden), "raw", "conv_identity"),
    DrafterTensor("norm.weight", lambda d: (d.hidden,), "raw", "ones"),
    DrafterTensor("candidate_selector.hidden_projection.weight", lambda d: (d.rank, d.hidden), "fp16_linear", "linear"),
    DrafterTensor("candidate_selector.predecessor_codebook", lambda d: (d.vocab, d.rank), "raw", "codebook"),
    DrafterTensor("candidate_selector.successor_codebook", lambda d: (d.vocab, d.rank), "raw", "codebook"),
)
# Older trainers append ".weight" to the bare codebook names; exllamav3 accepts both spellings.
CODEBOOK_ALIASES = {f"{t.name}.weight": t.name for t in LAYOUT if t.init == "codebook"}
_PATTERNS = [(re.compile(re.escape(t.name).replace(r"\{i\}", r"(\d+)")), t) for t in LAYOUT]


def lookup(name: str) -> tuple[DrafterTensor, int | None]:
    """The table row of a checkpoint tensor name (codebook `.weight` alias accepted) and its layer.
    InputError naming the tensor when the table does not know it."""
    canonical = CODEBOOK_ALIASES.get(name, name)
    for rx, row in _PATTERNS:
        m = rx.fullmatch(canonical)
        if m:
            return row, int(m.group(1)) if m.groups() else None
    raise InputError(f"tensor {name!r}: unknown DFlash2 drafter tensor name")


def drafter_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a drafter with this config.json: canonical name -> shape, in table order per layer."""
    d = DrafterDims.from_config(config)
    out: dict[str, tuple[int, ...]] = {}
    for row in LAYOUT:
        for i in (range(d.layers) if "{i}" in row.name else [None]):
            out[row.name.format(i=i)] = tuple(row.shape(d))
    return out


def check_tensor(name: str, shape: tuple[int, ...], config: dict, where: str) -> DrafterTensor:
    """Table row of `name`, after checking its layer index and shape against the config (FormatError naming
    the tensor, the expected and the found shape)."""
    row, layer = lookup(name)
    d = DrafterDims.from_config(config, where)
    if layer is not None and layer >= d.layers:
        raise FormatError(f"{where}: tensor {name!r} is in layer {layer}, the config has {d.layers} layers")
    want = tuple(row.shape(d))
    if tuple(shape) != want:
        raise FormatError(f"{where}: tensor {name!r} has shape {tuple(shape)}, the config implies {want}")
    return row


def drafter_config(target_config: dict, *, layers: int = 2, block_size: int = 8,
                   target_layer_ids: list[int] | None = None, heads: int | None = None, kv_heads: int | None = None,
                   head_dim: int = 64, intermediate_size: int | None = None, selector_rank: int = 32,
                   selector_top_k: int = 8, conv_kernel_size: int = 2, conv_group_size: int = 16,
                   mask_token_id: int = 1, rope_theta: float = 10000.0) -> dict:
    """config.json of a drafter for a glm5_next target (its config.json dict): the target's width, vocabulary and
    norm epsilon; taps spread over the target's layers (first and last excluded when there are enough)."""
    text = target_config.get("text_config") or target_config
    hidden, vocab, n = int(text["hidden_size"]), int(text["vocab_size"]), int(text["num_hidden_layers"])
    if target_layer_ids is None:
        lo, hi = (1, n - 2) if n >= 4 else (0, n - 1)
        k = min(5, hi - lo + 1)
        target_layer_ids = sorted({round(lo + j * (hi - lo) / max(k - 1, 1)) for j in range(k)})
    if any(not 0 <= i < n for i in target_layer_ids):
        raise InputError(f"target_layer_ids {target_layer_ids} outside the target's {n} layers")
    if not 0 <= mask_token_id < vocab:
        raise InputError(f"mask_token_id {mask_token_id} outside the target vocabulary ({vocab})")
    heads = heads or max(1, hidden // head_dim)
    return {
        "architectures": [ARCHITECTURE], "model_type": "qwen3", "dtype": "bfloat16",
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads or max(1, heads // 2), "head_dim": head_dim,
        "intermediate_size": intermediate_size or int(text.get("intermediate_size") or 3 * hidden),
        "hidden_act": "silu", "vocab_size": vocab, "rms_norm_eps": float(text.get("rms_norm_eps", 1e-6)),
        "rope_theta": rope_theta, "max_position_embeddings": int(text.get("max_position_embeddings", 32768)),
        "attention_bias": False, "tie_word_embeddings": False, "num_target_layers": n,
        "layer_types": ["full_attention"] * layers, "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids),
                          "conv_kernel_size": conv_kernel_size, "conv_group_size": conv_group_size,
                          "selector_rank": selector_rank, "selector_top_k": selector_top_k},
    }


def random_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 random weights for every tensor of the table. The conv base kernels start as the identity
    (tap 0 = 1, later taps 0) so that a fresh drafter passes its sublayers' signal through."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in drafter_shapes(config).items():
        row, _ = lookup(name)
        if row.init == "ones":
            out[name] = torch.ones(shape)
        elif row.init == "conv_identity":
            t = torch.zeros(shape)
            t[:, 0, :] = 1.0
            out[name] = t
        else:
            out[name] = torch.randn(shape, generator=gen) * 0.02
    return out


def write_drafter(out_dir: str | os.PathLike, config: dict, weights: dict[str, torch.Tensor]) -> Path:
    """Write config.json and one BF16 model.safetensors (table order) to `out_dir` (created; must not hold
    files), through a temporary directory renamed at the end."""

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"{out}: output directory exists and is not empty")
    shapes = drafter_shapes(config)
    missing = [n for n in shapes if n not in weights]
    if missing:
        raise InputError(f"drafter weights lack {missing[0]!r} ({len(missing)} missing)")
    for n, s in shapes.items():
        if tuple(weights[n].shape) != s:
            raise InputError(f"drafter weight {n!r} has shape {tuple(weights[n].shape)}, expected {s}")
    tensors = {n: weights[n].detach().to("cpu", torch.bfloat16).contiguous() for n in shapes}
    with atomic_dir(out) as tmp:
        write_safetensors(tmp / "model.safetensors", tensors, metadata={"format": "pt"})
        write_json(tmp / "config.json", config)
    return out


def write_tiny_drafter(out_dir: str | os.PathLike, target: str | os.PathLike | dict, *, seed: int = 0,
                       **config_opts) -> Path:
    """A random drafter for `target` (a glm5_next model directory or its config dict); `config_opts` go to
    `drafter_config`."""
    if not isinstance(target, dict):
        cfg = Path(target) / "config.json"
        if not cfg.is_file():
            raise InputError(f"{target}: no config.json")
        target = read_json(cfg, "config.json")
    config = drafter_config(target, **config_opts)
    return write_drafter(out_dir, config, random_weights(config, seed))
