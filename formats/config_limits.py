"""The sizes a glm5_next config.json may name: a config beyond them is refused at once, naming the key and the bound,
instead of planning a model of 100,000 layers for minutes (or building it on the meta device for hours).

The bounds lie well above GLM-5.3-Flash (45 layers, 288 routed experts, hidden size 4096, vocabulary 154,880:
../shared/models/glm-5.3-flash-shape/config.json) and any plausible successor; each entry is (bound, Flash's value).
"""
from __future__ import annotations

from pathlib import Path

from mixq.errors import InputError

TEXT_LIMITS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (512, 45), "n_routed_experts": (2048, 288), "num_experts_per_tok": (256, 8),
    "n_shared_experts": (64, 1), "num_nextn_predict_layers": (16, 1), "first_k_dense_replace": (512, 3),
    "hidden_size": (65536, 4096), "intermediate_size": (262144, 12288), "moe_intermediate_size": (65536, 2048),
    "vocab_size": (4194304, 154880), "num_attention_heads": (1024, 64), "num_key_value_heads": (1024, 64),
    "q_lora_rank": (65536, 1536), "kv_lora_rank": (65536, 512), "head_dim": (8192, 0), "qk_head_dim": (8192, 256),
    "qk_nope_head_dim": (8192, 256), "qk_rope_head_dim": (8192, 0), "v_head_dim": (8192, 256),
    "linear_num_heads": (1024, 64), "linear_head_dim": (8192, 128), "linear_conv_kernel_dim": (64, 4),
    "index_n_heads": (1024, 32), "index_head_dim": (8192, 128), "hc_mult": (64, 4),
}
VISION_LIMITS: dict[str, tuple[int, int]] = {
    "depth": (1024, 24), "hidden_size": (65536, 1024), "intermediate_size": (262144, 4096), "num_heads": (1024, 16),
    "out_hidden_size": (65536, 1536), "projection_intermediate_size": (262144, 10240), "patch_size": (1024, 14),
    "spatial_merge_size": (64, 2), "temporal_patch_size": (64, 2), "in_channels": (64, 3),
}
# routed expert matrices in all: each is a tensor to list, plan and check (GLM-5.3-Flash: 45 x 288 = 12,960)
EXPERT_LAYERS_LIMIT = 262144


def _check(section: dict, limits: dict[str, tuple[int, int]], prefix: str, path: Path) -> None:
    for key, (bound, flash) in limits.items():
        v = section.get(key)
        if v is None:
            continue  # absent or null: transformers' default, or the feature is off
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InputError(f"{path}: {prefix}{key} is {v!r}, not a whole number >= 0")
        if v > bound:
            raise InputError(f"{path}: {prefix}{key} is {v}, above the {bound} mixq accepts for a glm5_next "
                             f"model (GLM-5.3-Flash has {flash}); is the config corrupt?")


def check_config_limits(config: dict, text: dict, path: Path) -> None:
    """InputError naming ``path``, the key, its value and the bound when a size in the text (or vision) config is
    not a whole number or lies beyond every glm5_next model; ``text`` is ``config``'s text config."""
    prefix = "text_config." if text is not config else ""
    _check(text, TEXT_LIMITS, prefix, path)
    layers, experts = text.get("num_hidden_layers") or 0, text.get("n_routed_experts") or 0
    if layers * experts > EXPERT_LAYERS_LIMIT:
        raise InputError(f"{path}: {prefix}num_hidden_layers x n_routed_experts is {layers} x {experts} = "
                         f"{layers * experts} routed experts, above the {EXPERT_LAYERS_LIMIT} mixq accepts "
                         "(GLM-5.3-Flash has 45 x 288 = 12960); is the config corrupt?")
    vision = config.get("vision_config")
    if isinstance(vision, dict):
        _check(vision, VISION_LIMITS, "vision_config.", path)
