"""THE glm5_next architecture table: HF tensor name -> role, layer, MTP flag and per-format storage policy.

Every planner and writer reads tensor knowledge from here (``classify``); nothing else hard-codes glm5next names.
A name that matches no rule is an error (a new checkpoint revision must never be half-converted silently).

Sources (../shared/reference):
  X = exl3-format.md (§1.5 "what stays unquantized", §6.1 glm5_next, §6.2 glm5_next_mtp)
  G = gguf-glm5-next.md (§2.2 name table, §3.2 converter dtypes, §3.3 llama-quantize exclusions and Q8_0 floor)
  F = gguf-facts.md (§4.2 never-quantized set, §4.6 glm5-next pins and floor)

EXL3 policy (``TensorInfo.exl3``):
  "trellis" quantized (budget key in ``exl3_bits_key``: bits / head_bits / mtp_bits / vision_bits);
  "fp16"    unquantized, stored fp16;      "fp32" stored fp32;
  "native"  copied in the source dtype (bf16/fp16 kept, fp32 -> fp16 per X §1.5).
GGUF glm5-next policy (``TensorInfo.gguf``):
  "quant"    2-D/3-D weight that llama-quantize's mix may quantize (converter writes BF16);
  "q8_floor" quantized, but never below Q8_0 (glm5-next floor: attn_q_a, attn_q_b, nextn.eh_proj);
  "keep"     never quantized, keeps the converter's BF16 (glm5-next exclusion list);
  "f32"      pinned F32 by the converter and never quantized (norms, 1-D, router, hc_, ssm_a/dt, indexer.proj...);
  "mmproj"   not in the text GGUF (vision tower goes to the separate mmproj file).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from mixq.errors import InputError

ROLES = (
    "embed", "lm_head", "norm", "attn", "attn_param", "router",
    "routed_expert", "shared_expert", "dense_mlp", "hc", "vision",
)
EXL3_POLICIES = ("trellis", "fp16", "fp32", "native")
GGUF_POLICIES = ("quant", "q8_floor", "keep", "f32", "mmproj")


@dataclass(frozen=True)
class Rule:
    """One row of the table. ``pattern`` matches the whole name (scope "global"/"vision") or the part after
    ``layers.{i}.`` (scopes "layer": any decoder layer, "trunk": i < num_hidden_layers, "mtp": NextN only)."""

    pattern: str
    role: str
    scope: str
    exl3: str
    gguf: str
    gguf_name: tuple[str, ...]  # templates with {i} (layer), {g1} (first regex group); () = not in the text GGUF
    source: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "_rx", re.compile(self.pattern))


RULES: tuple[Rule, ...] = (
    # --- whole-model tensors -------------------------------------------------------------------------
    Rule(r"model\.(?:language_model\.)?embed_tokens\.weight", "embed", "global", "native", "quant",
         ("token_embd.weight",), "X§1.5 embedding kept (embed_bits 16); F§4.3 untied token_embd = mix default type"),
    Rule(r"lm_head\.weight", "lm_head", "global", "trellis", "quant",
         ("output.weight",), "X§6.1 lm_head Q(head); F§4.3 output Q6_K (Q8_0 if ne0 % 256)"),
    Rule(r"model\.(?:language_model\.)?norm\.weight", "norm", "global", "native", "f32",
         ("output_norm.weight",), "X§1.5 RMSNorm kept; F§4.2 *_norm never quantized; G§3.2 F32"),
    Rule(r"(?:model\.)?visual\.patch_embed\..+", "vision", "vision", "native", "mmproj",
         (), "X§6.1 patch_embed is a Conv3d, copied raw; G§4 vision only in mmproj"),
    Rule(r"(?:model\.)?visual\..*\.(?:qkv|proj|gate_proj|up_proj|down_proj)\.weight", "vision", "vision",
         "trellis", "mmproj", (), "X§6.1 vision Linears Q(vision_bits=6); G§4 vision only in mmproj"),
    Rule(r"(?:model\.)?visual\..+", "vision", "vision", "native", "mmproj",
         (), "X§6.1 vision convs/norms/biases copied raw; G§4 vision only in mmproj"),
    # --- decoder layers: norms and mHC -------------------------------------------------------------------
    Rule(r"input_layernorm\.weight", "norm", "layer", "native", "f32",
         ("blk.{i}.attn_norm.weight",), "X§6.1 raw RMSNorm; G§2.2/§3.2 F32"),
    Rule(r"post_attention_layernorm\.weight", "norm", "layer", "native", "f32",
         ("blk.{i}.ffn_norm.weight",), "X§6.1 raw RMSNorm; G§2.2/§3.2 F32"),
    Rule(r"hc_(attn|ffn)_(fn|base|scale)", "hc", "trunk", "fp32", "f32",
         ("blk.{i}.hc_{g1}_{g2}.weight",), "X§1.5 mHC fp32; G§3.2 glm.py:575-579 F32 pin; F§4.2 'hc_' excluded"),
    # --- KDA (linear_attention) --------------------------------------------------------------------------
    Rule(r"self_attn\.(q|k|v)_proj\.weight", "attn", "layer", "trellis", "quant",
         ("blk.{i}.attn_{g1}.weight",), "X§6.1 fused qkv_proj Q(bits); G§3.3 normal mix"),
    Rule(r"self_attn\.(q|k|v)_conv1d\.weight", "attn_param", "layer", "native", "f32",
         ("blk.{i}.ssm_conv1d_{g1}.weight",), "X§6.1 conv1d raw; F§4.2 ssm_conv1d never quantized; G§3.2 F32"),
    Rule(r"self_attn\.(f_a|f_b|g_a|g_b)_proj\.weight", "attn", "layer", "fp16", "keep",
         ("blk.{i}.ssm_{g1}.weight",), "X§1.5 qmap=None Linear fp16; G§3.3 glm5-next exclusion ssm_f_*/ssm_g_*"),
    Rule(r"self_attn\.b_proj\.weight", "attn", "layer", "fp16", "keep",
         ("blk.{i}.ssm_beta.weight",), "X§1.5 b_proj fp16; G§3.3 glm5-next exclusion ssm_beta"),
    Rule(r"self_attn\.A_log", "attn_param", "layer", "native", "f32",
         ("blk.{i}.ssm_a",), "X§1.5 A_log source dtype; G§2.2 ssm_a=-exp(A_log) F32, no suffix -> never quantized"),
    Rule(r"self_attn\.dt_bias", "attn_param", "layer", "native", "f32",
         ("blk.{i}.ssm_dt.bias",), "X§1.5 dt_bias source dtype; G§3.2 ssm_dt F32 pin"),
    Rule(r"self_attn\.o_norm\.weight", "attn_param", "layer", "native", "f32",
         ("blk.{i}.ssm_norm.weight",), "X§1.5 GatedRMSNorm source dtype; G§3.2 norms F32"),
    Rule(r"self_attn\.o_proj\.weight", "attn", "layer", "trellis", "quant",
         ("blk.{i}.attn_output.weight",), "X§6.1 o_proj Q(bits); G§3.3 normal mix"),
    # --- DSA / MLA (deepseek_sparse_attention) -----------------------------------------------------------
    Rule(r"self_attn\.q_a_proj\.weight", "attn", "layer", "trellis", "q8_floor",
         ("blk.{i}.attn_q_a.weight",), "X§6.1 Q(bits); G§3.3 / F§4.6 Q8_0 floor attn_q_a"),
    Rule(r"self_attn\.q_b_proj\.weight", "attn", "layer", "trellis", "q8_floor",
         ("blk.{i}.attn_q_b.weight",), "X§6.1 Q(bits); G§3.3 / F§4.6 Q8_0 floor attn_q_b"),
    Rule(r"self_attn\.kv_a_proj_with_mqa\.weight", "attn", "layer", "trellis", "keep",
         ("blk.{i}.attn_kv_a_mqa.weight",), "X§6.1 Q(bits); G§3.3 glm5-next exclusion attn_kv_a_mqa"),
    Rule(r"self_attn\.(q_a|kv_a)_layernorm\.weight", "norm", "layer", "native", "f32",
         ("blk.{i}.attn_{g1}_norm.weight",), "X§6.1 raw RMSNorm; G§3.2 norms F32"),
    Rule(r"self_attn\.kv_b_proj\.weight", "attn", "layer", "fp16", "keep",
         ("blk.{i}.attn_k_b.weight", "blk.{i}.attn_v_b.weight"),
         "X§6.1 kv_b kept fp16 (absorbed bmm); G§2.3 split into k_b/v_b, §3.3 excluded"),
    Rule(r"self_attn\.indexer\.wq_b\.weight", "attn", "layer", "trellis", "keep",
         ("blk.{i}.indexer.attn_q_b.weight",), "X§6.1 indexer wq_b Q(bits); G§3.3 exclusion indexer.attn_q_b"),
    Rule(r"self_attn\.indexer\.wk\.weight", "attn", "layer", "fp16", "keep",
         ("blk.{i}.indexer.attn_k.weight",), "X§6.1 indexer wk fp16; G§3.3 exclusion indexer.attn_k"),
    Rule(r"self_attn\.indexer\.weights_proj\.weight", "attn", "layer", "fp16", "f32",
         ("blk.{i}.indexer.proj.weight",), "X§6.1 weights_proj fp16; G§2.2 base.py:1115 F32, §3.3 excluded"),
    Rule(r"self_attn\.indexer\.k_norm\.(weight|bias)", "attn_param", "layer", "fp16", "f32",
         ("blk.{i}.indexer.k_norm.{g1}",), "X§1.5 LayerNorm always fp16; G§3.1 F32"),
    Rule(r"self_attn\.indexer\.index_kpool_compress_ape", "attn_param", "layer", "fp32", "f32",
         ("blk.{i}.indexer_compressor_ape.weight",), "X§1.5 kpool ape fp32; G§3.2 indexer_compressor_ F32 pin"),
    Rule(r"self_attn\.indexer\.index_kpool_compress_gate", "attn_param", "layer", "fp16", "f32",
         ("blk.{i}.indexer_compressor_gate.weight",), "X§1.5 kpool gate fp16; G§3.2 indexer_compressor_ F32 pin"),
    # --- MLPs --------------------------------------------------------------------------------------------
    Rule(r"mlp\.(gate|up|down)_proj\.weight", "dense_mlp", "layer", "trellis", "quant",
         ("blk.{i}.ffn_{g1}.weight",), "X§6.1 dense GatedMLP Q(bits); G§3.3 normal mix"),
    Rule(r"mlp\.gate\.weight", "router", "layer", "fp16", "f32",
         ("blk.{i}.ffn_gate_inp.weight",), "X§6.1 router fp16; F§4.2 ffn_gate_inp never quantized; G§2.2 F32"),
    Rule(r"mlp\.gate\.e_score_correction_bias", "router", "layer", "fp32", "f32",
         ("blk.{i}.exp_probs_b.bias",), "X§1.5 fp32 unless source fp16; G§3.2 exp_probs_b F32 pin"),
    Rule(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", "routed_expert", "layer", "trellis", "quant",
         ("blk.{i}.ffn_{g2}_exps.weight",), "X§6.1 per-expert Linears Q(bits); G§2.3 stacked into *_exps"),
    Rule(r"mlp\.shared_experts\.(gate|up|down)_proj\.weight", "shared_expert", "layer", "trellis", "quant",
         ("blk.{i}.ffn_{g1}_shexp.weight",), "X§6.1 shared experts Q(bits); G§3.3 normal mix"),
    # --- NextN / MTP block only --------------------------------------------------------------------------
    Rule(r"eh_proj\.weight", "attn", "mtp", "trellis", "q8_floor",
         ("blk.{i}.nextn.eh_proj.weight",), "X§6.2 eh_proj Q(mtp); G§3.3 / F§4.6 Q8_0 floor nextn.eh_proj"),
    Rule(r"(enorm|hnorm)\.weight", "norm", "mtp", "native", "f32",
         ("blk.{i}.nextn.{g1}.weight",), "X§6.2 raw RMSNorm; G§2.2 F32"),
    Rule(r"shared_head\.norm\.weight", "norm", "mtp", "native", "f32",
         ("blk.{i}.nextn.shared_head_norm.weight",), "X§6.2 raw; G§2.2 F32"),
    Rule(r"shared_head\.head\.weight", "lm_head", "mtp", "trellis", "quant",
         ("blk.{i}.nextn.shared_head_head.weight",), "X§6.2 (absent in GLM: borrows trunk head); G§2.2 optional"),
    Rule(r"embed_tokens\.weight", "embed", "mtp", "native", "quant",
         ("blk.{i}.nextn.embed_tokens.weight",), "X§6.2 (absent in GLM: borrows trunk embedding); G§2.2 optional"),
)
_BY_SCOPE: dict[str, tuple[Rule, ...]] = {
    s: tuple(r for r in RULES if r.scope in ((s,) if s in ("global", "vision") else (s, "layer")))
    for s in ("global", "vision", "trunk", "mtp")
}
_LAYER_RX = re.compile(r"(?:model\.(?:language_model\.)?)?layers\.(\d+)\.(.+)")
_EXPERT_RX = re.compile(r"mlp\.experts\.(\d+)\.")


@dataclass(frozen=True)
class TensorInfo:
    """What the table says about one HF tensor."""

    name: str
    role: str
    layer: int | None
    mtp: bool
    expert: int | None = None
    exl3: str = "native"           # see EXL3_POLICIES
    exl3_bits_key: str | None = None  # "bits" | "head_bits" | "mtp_bits" | "vision_bits" when exl3 == "trellis"
    gguf: str = "quant"            # see GGUF_POLICIES
    gguf_names: tuple[str, ...] = field(default=())  # GGUF tensor(s) this feeds (kv_b feeds two; vision none)
    source: str = ""               # citation of the rule in ../shared/reference

    @property
    def gguf_name(self) -> str | None:
        """The (first) GGUF tensor this feeds; None for vision tensors (mmproj only)."""
        return self.gguf_names[0] if self.gguf_names else None

    @property
    def exl3_quantized(self) -> bool:
        return self.exl3 == "trellis"

    @property
    def gguf_quantizable(self) -> bool:
        """True when llama-quantize may change its type (mix or Q8_0 floor)."""
        return self.gguf in ("quant", "q8_floor")

    @property
    def gguf_source_type(self) -> str | None:
        """The type a BF16 conversion writes before quantization ("F32" or "BF16"); None when not in the GGUF."""
        return None if self.gguf == "mmproj" else ("F32" if self.gguf == "f32" else "BF16")


def _match(rules: tuple[Rule, ...], text: str) -> tuple[Rule, re.Match] | None:
    for r in rules:
        m = r._rx.fullmatch(text)  # type: ignore[attr-defined]
        if m:
            return r, m
    return None


def classify(name: str, num_hidden_layers: int) -> TensorInfo:
    """Classify one checkpoint tensor name; ``layers.{num_hidden_layers}`` and above are NextN (MTP) layers.

    Raises InputError naming the tensor when no rule of the table matches it."""
    layer: int | None = None
    mtp = False
    lm = _LAYER_RX.fullmatch(name)
    if lm and not name.startswith(("visual.", "model.visual.")):
        layer = int(lm.group(1))
        mtp = layer >= num_hidden_layers
        hit = _match(_BY_SCOPE["mtp" if mtp else "trunk"], lm.group(2))
        if hit is None:
            other = _match(_BY_SCOPE["trunk" if mtp else "mtp"], lm.group(2))
            where = (f"a NextN layer (num_hidden_layers={num_hidden_layers})" if mtp
                     else f"a trunk layer (num_hidden_layers={num_hidden_layers})")
            why = f"not expected in {where}" if other else "unknown glm5_next tensor name"
            raise InputError(f"tensor {name!r}: {why}")
    else:
        hit = _match(_BY_SCOPE["global"], name) or _match(_BY_SCOPE["vision"], name)
        if hit is None:
            raise InputError(f"tensor {name!r}: unknown glm5_next tensor name")
    rule, m = hit
    groups = {f"g{k + 1}": g for k, g in enumerate(m.groups())}
    em = _EXPERT_RX.search(name) if rule.role == "routed_expert" else None
    bits_key = None
    if rule.exl3 == "trellis":
        bits_key = ("vision_bits" if rule.role == "vision" else "mtp_bits" if mtp
                    else "head_bits" if rule.role == "lm_head" else "bits")
    return TensorInfo(
        name=name, role=rule.role, layer=layer, mtp=mtp,
        expert=int(em.group(1)) if em else None,
        exl3=rule.exl3, exl3_bits_key=bits_key, gguf=rule.gguf,
        gguf_names=tuple(t.format(i=layer, **groups) for t in rule.gguf_name),
        source=rule.source,
    )


def normalise_layer_type(kind: str) -> str:
    """Map the spellings of the DSA kind (``deepseek_sparse_attention``, ``indexed_attention``,
    ``full_attention``) to ``deepseek_sparse_attention``; ``linear_attention`` stays. Others -> InputError."""
    if kind == "linear_attention":
        return kind
    if kind in ("deepseek_sparse_attention", "indexed_attention", "full_attention"):
        return "deepseek_sparse_attention"
    raise InputError(f"unknown glm5_next layer type {kind!r}")
