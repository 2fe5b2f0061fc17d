"""THE glm5_next architecture table: HF tensor name -> role, layer, MTP flag and every per-format name and policy.

Every planner, reader and writer takes tensor knowledge from here: ``classify`` (HF name -> ``TensorInfo``), and
the inverse look-ups ``gguf_sources`` (GGUF tensor -> HF tensors), ``module_sources`` (transformers parameter ->
HF tensors) and ``gguf_policy``. Nothing else hard-codes glm5next names. A name that matches no rule is an error
(a new checkpoint revision must never be half-converted silently).

Sources (../shared/reference):
  X = exl3-format.md (§1.5 "what stays unquantized", §1.6 padding, §6.1 glm5_next, §6.2 glm5_next_mtp)
  G = gguf-glm5-next.md (§2.2 name table, §2.3 transforms, §3.2 converter dtypes, §3.3 exclusions and Q8_0 floor,
      §4 mmproj)
  F = gguf-facts.md (§4.2 never-quantized set, §4.6 glm5-next pins and floor)

Name templates. ``hf`` is relative to its scope's prefix; ``{v:a|b}`` declares a variable and its alternatives,
``{e}`` (expert), ``{b}`` (vision block) are numbers, ``{i}`` is the layer. The other name columns (GGUF, EXL3 key,
transformers module, mmproj) reuse the variables; a variable of ``hf`` that a column leaves out is *gathered*:
the column's tensor is made of all its values, concatenated on dim 0 in the order listed (``{p:q|k|v}`` -> [q|k|v]),
or stacked on a new dim 0 for ``{e}`` (experts in expert order).

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
GGUF transforms (``TensorInfo.gguf_transforms``, applied by formats/gguf_names): "none", "stack" (gathered
experts), "kv_b_k" / "kv_b_v" (the two halves of kv_b, per head), "neg_exp" (ssm_a = -exp(A_log)), "conv"
(conv1d (C, 1, k) -> (1, C, 1, k)).
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

from mixq.errors import InputError

ROLES = (
    "embed", "lm_head", "norm", "attn", "attn_param", "router",
    "routed_expert", "shared_expert", "dense_mlp", "hc", "vision",
)
EXL3_POLICIES = ("trellis", "fp16", "fp32", "native")
GGUF_POLICIES = ("quant", "q8_floor", "keep", "f32", "mmproj")
GGUF_TRANSFORMS = ("none", "stack", "kv_b_k", "kv_b_v", "neg_exp", "conv")
TEXT_PREFIX = "model.language_model."  # the text model's tensors in GLM's releases (inverse look-ups use it)
VISION_PREFIX = "model.visual."

# scope -> (regex of the accepted prefixes, canonical prefix for names built from the table)
_SCOPE_PREFIX = {
    "text": (r"model\.(?:language_model\.)?", TEXT_PREFIX),
    "root": ("", ""),
    "vision": (r"(?:model\.)?visual\.", VISION_PREFIX),
}
_LAYER_SCOPES = ("layer", "trunk", "mtp")
_VAR = re.compile(r"\{(\w+)(?::([^{}]*))?\}")
_NUMBER = r"\d+"  # variables without alternatives ({i}, {e}, {b}) are numbers


def _template(text: str, alts: dict[str, str]) -> tuple[str, re.Pattern]:
    """``text`` with inline alternatives stripped (for str.format) and its regex (variables -> named groups)."""
    parts, pos, fmt = [], 0, _VAR.sub(lambda m: "{" + m.group(1) + "}", text)
    for m in _VAR.finditer(text):
        parts.append(re.escape(text[pos:m.start()]))
        v = m.group(1)
        parts.append(f"(?P<{v}>{alts.get(v, _NUMBER)})")
        pos = m.end()
    parts.append(re.escape(text[pos:]))
    return fmt, re.compile("".join(parts))


@dataclass(frozen=True)
class Rule:
    """One row of the table: an HF name template in ``scope`` ("text": under ``model.(language_model.)``, "root":
    bare, "vision": under ``model.visual.``, "layer": after ``layers.{i}.`` of any decoder layer, "trunk":
    i < num_hidden_layers only, "mtp": NextN layers only), its role and per-format columns."""

    hf: str
    role: str
    scope: str
    exl3: str
    gguf: str
    gguf_names: tuple[str, ...]  # text-GGUF tensor(s) built from it; () = not in the text GGUF
    source: str
    gguf_transforms: tuple[str, ...] = ()  # per GGUF name; () = "stack" when {e} is gathered, else "none"
    exl3_key: str | None = None      # EXL3 unit key when several HF tensors are fused into one (X §6.1)
    exl3_flat: bool = False          # stored flattened (A_log -> (H,))
    exl3_pad: int | None = None      # Linear padding other than the layout default (X §1.6: eh_proj pad_to=1)
    exl3_group: str | None = None    # allocator group (one rate per group); default: the fused key or the name
    module: str | None = None        # parameter inside transformers' decoder layer; None = same as ``hf``
    mmproj: tuple[str, ...] = ()     # mmproj tensor(s) of a vision tensor
    mmproj_parts: tuple[str, ...] = ()  # per mmproj name: "t0" / "t1" temporal slice of a Conv3d; () = whole
    nextn: tuple[str, tuple[int, ...]] | None = None  # NextN-only tensor: ("in"|"out" of the block body, shape / D)

    def __post_init__(self) -> None:
        alts = {m.group(1): m.group(2) for m in _VAR.finditer(self.hf) if m.group(2)}
        fmt, rx = _template(self.hf, alts)
        object.__setattr__(self, "alts", alts)
        object.__setattr__(self, "hf_fmt", fmt)
        object.__setattr__(self, "_rx", rx)
        if self.scope in _SCOPE_PREFIX:  # whole-name regex of the non-layer scopes
            object.__setattr__(self, "_full_rx", re.compile(_SCOPE_PREFIX[self.scope][0] + rx.pattern))
        object.__setattr__(self, "var_names", tuple(m.group(1) for m in _VAR.finditer(self.hf)))

    def transforms(self) -> tuple[str, ...]:
        """The GGUF transform of each of ``gguf_names``."""
        if self.gguf_transforms:
            return self.gguf_transforms
        return tuple("stack" if "e" in self.var_names and "{e}" not in g else "none" for g in self.gguf_names)

    def column_rx(self, template: str) -> re.Pattern:
        """Regex of a name-column template (inverse look-ups), variables restricted to their alternatives."""
        return _template(template, self.alts)[1]

    def gather(self, values: dict, template: str, n_stack: int | None = None) -> list[list[str]]:
        """The ``hf`` names (relative to the scope prefix) one ``template`` name is made of, given the ``values``
        of the variables it names: [stacked {e}][concatenated alternatives of the other gathered variables]."""
        present = {m.group(1) for m in _VAR.finditer(template)}
        gathered = [v for v in self.var_names if v not in present]
        alt_vars = [v for v in gathered if v != "e"]
        combos = list(itertools.product(*[self.alts[v].split("|") for v in alt_vars]))
        stack: list = list(range(n_stack or 0)) if "e" in gathered else [values.get("e")]
        rows = []
        for e in stack:
            base = dict(values) if e is None else dict(values, e=e)
            rows.append([self.hf_fmt.format(**dict(base, **dict(zip(alt_vars, c)))) for c in combos])
        return rows


_TRELLIS_LINEAR = "qkv|proj|gate_proj|up_proj|down_proj"
RULES: tuple[Rule, ...] = (
    # --- whole-model tensors -------------------------------------------------------------------------
    Rule("embed_tokens.weight", "embed", "text", "native", "quant", ("token_embd.weight",),
         "X§1.5 embedding kept (embed_bits 16); F§4.3 untied token_embd = mix default type"),
    Rule("lm_head.weight", "lm_head", "root", "trellis", "quant", ("output.weight",),
         "X§6.1 lm_head Q(head); F§4.3 output Q6_K (Q8_0 if ne0 % 256)"),
    Rule("norm.weight", "norm", "text", "native", "f32", ("output_norm.weight",),
         "X§1.5 RMSNorm kept; F§4.2 *_norm never quantized; G§3.2 F32"),
    # --- vision tower (mmproj names: G§4) --------------------------------------------------------------
    Rule("patch_embed.proj.weight", "vision", "vision", "native", "mmproj", (),
         "X§6.1 patch_embed is a Conv3d, copied raw; G§4 two 2-D patch kernels in the mmproj",
         mmproj=("v.patch_embd.weight", "v.patch_embd.weight.1"), mmproj_parts=("t0", "t1")),
    Rule("patch_embed.proj.bias", "vision", "vision", "native", "mmproj", (),
         "X§6.1 copied raw; G§4", mmproj=("v.patch_embd.bias",)),
    Rule("patch_embed.{rest:.+}", "vision", "vision", "native", "mmproj", (), "X§6.1 patch_embed copied raw"),
    Rule("blocks.{b}.attn.qkv.weight", "vision", "vision", "trellis", "mmproj", (),
         "X§6.1 vision Linears Q(vision_bits); G§4", mmproj=("v.blk.{b}.attn_qkv.weight",)),
    Rule("blocks.{b}.attn.proj.weight", "vision", "vision", "trellis", "mmproj", (),
         "X§6.1 vision Linears Q(vision_bits); G§4", mmproj=("v.blk.{b}.attn_out.weight",)),
    Rule("blocks.{b}.attn.qkv.bias", "vision", "vision", "native", "mmproj", (),
         "X§6.1 biases copied raw; G§4", mmproj=("v.blk.{b}.attn_qkv.bias",)),
    Rule("blocks.{b}.attn.proj.bias", "vision", "vision", "native", "mmproj", (),
         "X§6.1 biases copied raw; G§4", mmproj=("v.blk.{b}.attn_out.bias",)),
    Rule("blocks.{b}.attn.{n:q_norm|k_norm}.{s:weight|bias}", "vision", "vision", "native", "mmproj", (),
         "X§6.1 norms copied raw; G§4", mmproj=("v.blk.{b}.attn_{n}.{s}",)),
    Rule("blocks.{b}.mlp.{p:gate|up|down}_proj.weight", "vision", "vision", "trellis", "mmproj", (),
         "X§6.1 vision Linears Q(vision_bits); G§4", mmproj=("v.blk.{b}.ffn_{p}.weight",)),
    Rule("blocks.{b}.mlp.{p:gate|up|down}_proj.bias", "vision", "vision", "native", "mmproj", (),
         "X§6.1 biases copied raw; G§4", mmproj=("v.blk.{b}.ffn_{p}.bias",)),
    Rule("blocks.{b}.norm{n:1|2}.{s:weight|bias}", "vision", "vision", "native", "mmproj", (),
         "X§6.1 norms copied raw; G§4", mmproj=("v.blk.{b}.ln{n}.{s}",)),
    Rule("post_layernorm.{s:weight|bias}", "vision", "vision", "native", "mmproj", (),
         "X§6.1 norms copied raw; G§4", mmproj=("v.post_ln.{s}",)),
    Rule("downsample.{s:weight|bias}", "vision", "vision", "native", "mmproj", (),
         "X§6.1 conv copied raw; G§4 patch merger", mmproj=("mm.patch_merger.{s}",)),
    Rule("merger.proj.weight", "vision", "vision", "trellis", "mmproj", (),
         "X§6.1 vision Linears Q(vision_bits); G§4", mmproj=("mm.model.fc.weight",)),
    Rule("merger.proj.bias", "vision", "vision", "native", "mmproj", (),
         "X§6.1 biases copied raw; G§4", mmproj=("mm.model.fc.bias",)),
    Rule("merger.{p:gate|up|down}_proj.weight", "vision", "vision", "trellis", "mmproj", (),
         "X§6.1 vision Linears Q(vision_bits); G§4", mmproj=("mm.{p}.weight",)),
    Rule("merger.{p:gate|up|down}_proj.bias", "vision", "vision", "native", "mmproj", (),
         "X§6.1 biases copied raw; G§4", mmproj=("mm.{p}.bias",)),
    Rule("merger.post_projection_norm.{s:weight|bias}", "vision", "vision", "native", "mmproj", (),
         "X§6.1 norms copied raw; G§4", mmproj=("mm.post_norm.{s}",)),
    # other vision tensors: classified (EXL3 copies them), but not in the mmproj
    Rule("{path:.*}.{lin:" + _TRELLIS_LINEAR + "}.weight", "vision", "vision", "trellis", "mmproj", (),
         "X§6.1 vision Linears Q(vision_bits=6); G§4 vision only in mmproj"),
    Rule("{rest:.+}", "vision", "vision", "native", "mmproj", (),
         "X§6.1 vision convs/norms/biases copied raw; G§4 vision only in mmproj"),
    # --- decoder layers: norms and mHC -------------------------------------------------------------------
    Rule("input_layernorm.weight", "norm", "layer", "native", "f32", ("blk.{i}.attn_norm.weight",),
         "X§6.1 raw RMSNorm; G§2.2/§3.2 F32"),
    Rule("post_attention_layernorm.weight", "norm", "layer", "native", "f32", ("blk.{i}.ffn_norm.weight",),
         "X§6.1 raw RMSNorm; G§2.2/§3.2 F32"),
    Rule("hc_{a:attn|ffn}_{c:fn|base|scale}", "hc", "trunk", "fp32", "f32", ("blk.{i}.hc_{a}_{c}.weight",),
         "X§1.5 mHC fp32; G§3.2 glm.py:575-579 F32 pin; F§4.2 'hc_' excluded", module="{a}_hc.{c}"),
    # --- KDA (linear_attention) --------------------------------------------------------------------------
    Rule("self_attn.{p:q|k|v}_proj.weight", "attn", "layer", "trellis", "quant", ("blk.{i}.attn_{p}.weight",),
         "X§6.1 fused qkv_proj Q(bits); G§3.3 normal mix", exl3_key="self_attn.qkv_proj"),
    Rule("self_attn.{p:q|k|v}_conv1d.weight", "attn_param", "layer", "native", "f32",
         ("blk.{i}.ssm_conv1d_{p}.weight",),
         "X§6.1 conv1d raw, fused; F§4.2 ssm_conv1d never quantized; G§3.2 F32",
         gguf_transforms=("conv",), exl3_key="self_attn.conv1d.weight", module="self_attn.conv1d.weight"),
    Rule("self_attn.{p:f_a|f_b}_proj.weight", "attn", "layer", "fp16", "keep", ("blk.{i}.ssm_{p}.weight",),
         "X§1.5 qmap=None Linear fp16; G§3.3 glm5-next exclusion ssm_f_*",
         module="self_attn.forget_gate.{p}_proj.weight"),
    Rule("self_attn.{p:g_a|g_b}_proj.weight", "attn", "layer", "fp16", "keep", ("blk.{i}.ssm_{p}.weight",),
         "X§1.5 qmap=None Linear fp16; G§3.3 glm5-next exclusion ssm_g_*"),
    Rule("self_attn.b_proj.weight", "attn", "layer", "fp16", "keep", ("blk.{i}.ssm_beta.weight",),
         "X§1.5 b_proj fp16; G§3.3 glm5-next exclusion ssm_beta"),
    Rule("self_attn.A_log", "attn_param", "layer", "native", "f32", ("blk.{i}.ssm_a",),
         "X§1.5 A_log source dtype, stored (H,); G§2.2 ssm_a=-exp(A_log) F32, no suffix -> never quantized",
         gguf_transforms=("neg_exp",), exl3_flat=True, module="self_attn.forget_gate.A_log"),
    Rule("self_attn.dt_bias", "attn_param", "layer", "native", "f32", ("blk.{i}.ssm_dt.bias",),
         "X§1.5 dt_bias source dtype; G§3.2 ssm_dt F32 pin", module="self_attn.forget_gate.dt_bias"),
    Rule("self_attn.o_norm.weight", "attn_param", "layer", "native", "f32", ("blk.{i}.ssm_norm.weight",),
         "X§1.5 GatedRMSNorm source dtype; G§3.2 norms F32"),
    Rule("self_attn.o_proj.weight", "attn", "layer", "trellis", "quant", ("blk.{i}.attn_output.weight",),
         "X§6.1 o_proj Q(bits); G§3.3 normal mix"),
    # --- DSA / MLA (deepseek_sparse_attention) -----------------------------------------------------------
    Rule("self_attn.q_a_proj.weight", "attn", "layer", "trellis", "q8_floor", ("blk.{i}.attn_q_a.weight",),
         "X§6.1 Q(bits); G§3.3 / F§4.6 Q8_0 floor attn_q_a"),
    Rule("self_attn.q_b_proj.weight", "attn", "layer", "trellis", "q8_floor", ("blk.{i}.attn_q_b.weight",),
         "X§6.1 Q(bits); G§3.3 / F§4.6 Q8_0 floor attn_q_b"),
    Rule("self_attn.kv_a_proj_with_mqa.weight", "attn", "layer", "trellis", "keep", ("blk.{i}.attn_kv_a_mqa.weight",),
         "X§6.1 Q(bits); G§3.3 glm5-next exclusion attn_kv_a_mqa"),
    Rule("self_attn.{a:q_a|kv_a}_layernorm.weight", "norm", "layer", "native", "f32",
         ("blk.{i}.attn_{a}_norm.weight",), "X§6.1 raw RMSNorm; G§3.2 norms F32"),
    Rule("self_attn.kv_b_proj.weight", "attn", "layer", "fp16", "keep",
         ("blk.{i}.attn_k_b.weight", "blk.{i}.attn_v_b.weight"),
         "X§6.1 kv_b kept fp16 (absorbed bmm); G§2.3 split into k_b/v_b, §3.3 excluded",
         gguf_transforms=("kv_b_k", "kv_b_v")),
    Rule("self_attn.indexer.wq_b.weight", "attn", "layer", "trellis", "keep", ("blk.{i}.indexer.attn_q_b.weight",),
         "X§6.1 indexer wq_b Q(bits); G§3.3 exclusion indexer.attn_q_b"),
    Rule("self_attn.indexer.wk.weight", "attn", "layer", "fp16", "keep", ("blk.{i}.indexer.attn_k.weight",),
         "X§6.1 indexer wk fp16; G§3.3 exclusion indexer.attn_k"),
    Rule("self_attn.indexer.weights_proj.weight", "attn", "layer", "fp16", "f32", ("blk.{i}.indexer.proj.weight",),
         "X§6.1 weights_proj fp16; G§2.2 base.py:1115 F32, §3.3 excluded"),
    Rule("self_attn.indexer.k_norm.{s:weight|bias}", "attn_param", "layer", "fp16", "f32",
         ("blk.{i}.indexer.k_norm.{s}",), "X§1.5 LayerNorm always fp16; G§3.1 F32"),
    Rule("self_attn.indexer.index_kpool_compress_ape", "attn_param", "layer", "fp32", "f32",
         ("blk.{i}.indexer_compressor_ape.weight",), "X§1.5 kpool ape fp32; G§3.2 indexer_compressor_ F32 pin"),
    Rule("self_attn.indexer.index_kpool_compress_gate", "attn_param", "layer", "fp16", "f32",
         ("blk.{i}.indexer_compressor_gate.weight",), "X§1.5 kpool gate fp16; G§3.2 indexer_compressor_ F32 pin"),
    # --- MLPs --------------------------------------------------------------------------------------------
    Rule("mlp.{p:gate|up|down}_proj.weight", "dense_mlp", "layer", "trellis", "quant", ("blk.{i}.ffn_{p}.weight",),
         "X§6.1 dense GatedMLP Q(bits); G§3.3 normal mix"),
    Rule("mlp.gate.weight", "router", "layer", "fp16", "f32", ("blk.{i}.ffn_gate_inp.weight",),
         "X§6.1 router fp16; F§4.2 ffn_gate_inp never quantized; G§2.2 F32"),
    Rule("mlp.gate.e_score_correction_bias", "router", "layer", "fp32", "f32", ("blk.{i}.exp_probs_b.bias",),
         "X§1.5 fp32 unless source fp16; G§3.2 exp_probs_b F32 pin"),
    Rule("mlp.experts.{e}.{p:gate|up}_proj.weight", "routed_expert", "layer", "trellis", "quant",
         ("blk.{i}.ffn_{p}_exps.weight",), "X§6.1 per-expert Linears Q(bits), one rate per layer; G§2.3 *_exps",
         exl3_group="layers.{i}.experts", module="mlp.experts.gate_up_proj"),
    Rule("mlp.experts.{e}.down_proj.weight", "routed_expert", "layer", "trellis", "quant",
         ("blk.{i}.ffn_down_exps.weight",), "X§6.1 per-expert Linears Q(bits), one rate per layer; G§2.3 *_exps",
         exl3_group="layers.{i}.experts", module="mlp.experts.down_proj"),
    Rule("mlp.shared_experts.{p:gate|up|down}_proj.weight", "shared_expert", "layer", "trellis", "quant",
         ("blk.{i}.ffn_{p}_shexp.weight",), "X§6.1 shared experts Q(bits); G§3.3 normal mix"),
    # --- NextN / MTP block only --------------------------------------------------------------------------
    Rule("eh_proj.weight", "attn", "mtp", "trellis", "q8_floor", ("blk.{i}.nextn.eh_proj.weight",),
         "X§6.2 eh_proj Q(mtp), pad_to=1; G§3.3 / F§4.6 Q8_0 floor nextn.eh_proj",
         exl3_pad=1, nextn=("in", (1, 2))),
    Rule("{n:enorm|hnorm}.weight", "norm", "mtp", "native", "f32", ("blk.{i}.nextn.{n}.weight",),
         "X§6.2 raw RMSNorm; G§2.2 F32", nextn=("in", (1,))),
    Rule("shared_head.norm.weight", "norm", "mtp", "native", "f32", ("blk.{i}.nextn.shared_head_norm.weight",),
         "X§6.2 raw; G§2.2 F32", nextn=("out", (1,))),
    Rule("shared_head.head.weight", "lm_head", "mtp", "trellis", "quant", ("blk.{i}.nextn.shared_head_head.weight",),
         "X§6.2 (absent in GLM: borrows trunk head); G§2.2 optional"),
    Rule("embed_tokens.weight", "embed", "mtp", "native", "quant", ("blk.{i}.nextn.embed_tokens.weight",),
         "X§6.2 (absent in GLM: borrows trunk embedding); G§2.2 optional"),
)
_BY_SCOPE: dict[str, tuple[Rule, ...]] = {
    s: tuple(r for r in RULES if r.scope in ((s,) if s not in ("trunk", "mtp") else (s, "layer")))
    for s in ("text", "root", "vision", "trunk", "mtp")
}
_LAYER_RX = re.compile(r"((?:model\.(?:language_model\.)?)?layers\.(\d+)\.)(.+)")
_PREFIX_RX = {s: re.compile(p) for s, (p, _) in _SCOPE_PREFIX.items()}


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
    gguf_transforms: tuple[str, ...] = field(default=())  # per gguf_names entry, see GGUF_TRANSFORMS
    exl3_key: str | None = None    # the fused EXL3 unit (full name) this tensor is part of; None = its own unit
    exl3_members: tuple[str, ...] = field(default=())  # every HF tensor of that fused unit, concatenation order
    exl3_flat: bool = False        # EXL3 stores it flattened
    exl3_pad: int | None = None    # Linear padding other than the layout default
    exl3_group: str = ""           # allocator group of a trellis tensor (one rate per group)
    module: str | None = None      # parameter name inside transformers' decoder layer (layer tensors)
    mmproj_names: tuple[str, ...] = field(default=())  # mmproj tensor(s) of a vision tensor
    mmproj_parts: tuple[str, ...] = field(default=())  # per mmproj name: "t0" / "t1" temporal slice, "" whole

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
        m = (r._full_rx if r.scope in _SCOPE_PREFIX else r._rx).fullmatch(text)  # type: ignore[attr-defined]
        if m:
            return r, m
    return None


def _layer_hit(name: str, lm: re.Match, num_hidden_layers: int) -> tuple[Rule, re.Match]:
    layer = int(lm.group(2))
    mtp = layer >= num_hidden_layers
    hit = _match(_BY_SCOPE["mtp" if mtp else "trunk"], lm.group(3))
    if hit is None:
        other = _match(_BY_SCOPE["trunk" if mtp else "mtp"], lm.group(3))
        where = (f"a NextN layer (num_hidden_layers={num_hidden_layers})" if mtp
                 else f"a trunk layer (num_hidden_layers={num_hidden_layers})")
        why = f"not expected in {where}" if other else "unknown glm5_next tensor name"
        raise InputError(f"tensor {name!r}: {why}")
    return hit


def classify(name: str, num_hidden_layers: int) -> TensorInfo:
    """Classify one checkpoint tensor name; ``layers.{num_hidden_layers}`` and above are NextN (MTP) layers.

    Raises InputError naming the tensor when no rule of the table matches it."""
    lm = _LAYER_RX.fullmatch(name)
    if lm and not name.startswith(("visual.", "model.visual.")):
        rule, m = _layer_hit(name, lm, num_hidden_layers)
        prefix, layer = lm.group(1), int(lm.group(2))
    else:
        hit = _match(_BY_SCOPE["text"] + _BY_SCOPE["root"], name) or _match(_BY_SCOPE["vision"], name)
        if hit is None:
            raise InputError(f"tensor {name!r}: unknown glm5_next tensor name")
        (rule, m), prefix, layer = hit, "", None
    mtp = layer is not None and layer >= num_hidden_layers
    values = {k: v for k, v in m.groupdict().items()}
    bits_key = None
    if rule.exl3 == "trellis":
        bits_key = ("vision_bits" if rule.role == "vision" else "mtp_bits" if mtp
                    else "head_bits" if rule.role == "lm_head" else "bits")
    exl3_key = members = None
    if rule.exl3_key:
        exl3_key = prefix + rule.exl3_key.format(**values)
        members = tuple(prefix + n for row in rule.gather(values, rule.exl3_key) for n in row)
    group = name
    if rule.exl3 == "trellis" and (rule.exl3_group or rule.exl3_key):
        group = (rule.exl3_group or "layers.{i}." + rule.exl3_key).format(i=layer, **values)
    return TensorInfo(
        name=name, role=rule.role, layer=layer, mtp=mtp,
        expert=int(values["e"]) if "e" in values else None,
        exl3=rule.exl3, exl3_bits_key=bits_key, gguf=rule.gguf,
        gguf_names=tuple(t.format(i=layer, **values) for t in rule.gguf_names),
        source=rule.source, gguf_transforms=rule.transforms(),
        exl3_key=exl3_key, exl3_members=members or (), exl3_flat=rule.exl3_flat, exl3_pad=rule.exl3_pad,
        exl3_group=group, module=(rule.module or rule.hf_fmt).format(**values) if layer is not None else None,
        mmproj_names=tuple(t.format(**values) for t in rule.mmproj),
        mmproj_parts=rule.mmproj_parts or ("",) * len(rule.mmproj),
    )


# --- inverse look-ups ------------------------------------------------------------------------------------------
def _canonical_prefix(rule: Rule, layer: int | None) -> str:
    if rule.scope in _LAYER_SCOPES:
        return f"{TEXT_PREFIX}layers.{layer}."
    return _SCOPE_PREFIX[rule.scope][1]


_GGUF_TARGETS = tuple((r, j, r.column_rx(t)) for r in RULES for j, t in enumerate(r.gguf_names))


@dataclass(frozen=True)
class GGUFSource:
    """The HF side of one GGUF tensor (``gguf_sources``)."""

    rule: Rule
    layer: int | None
    hf_names: list[str]   # canonical HF names; experts in stacking order
    transform: str


def gguf_sources(gguf_name: str, shape: tuple[int, ...] = ()) -> GGUFSource | None:
    """The HF tensors a text-GGUF tensor is built from (canonical ``model.language_model.`` names) and its
    transform; ``shape[0]`` is the expert count of a stacked tensor. None when the table has no such name."""
    for rule, j, rx in _GGUF_TARGETS:
        m = rx.fullmatch(gguf_name)
        if not m:
            continue
        values = m.groupdict()
        layer = int(values.pop("i")) if "i" in values else None
        prefix = _canonical_prefix(rule, layer)
        n_stack = int(shape[0]) if shape else 0
        names = [prefix + n for row in rule.gather(values, rule.gguf_names[j], n_stack) for n in row]
        return GGUFSource(rule, layer, names, rule.transforms()[j])
    return None


def gguf_policy(gguf_name: str) -> str | None:
    """The glm5-next GGUF policy (``GGUF_POLICIES``) of a text-GGUF tensor name; None for names not in the table."""
    src = gguf_sources(gguf_name)
    return src.rule.gguf if src else None


def global_hf_name(role: str) -> str:
    """The canonical HF name of a whole-model tensor: "embed", "lm_head" or "norm" (the final norm)."""
    for r in _BY_SCOPE["text"] + _BY_SCOPE["root"]:
        if r.role == role:
            return _SCOPE_PREFIX[r.scope][1] + r.hf_fmt
    raise KeyError(role)


def global_gguf_name(role: str) -> str:
    """The GGUF name of a whole-model tensor: "embed" -> token_embd.weight, "lm_head", "norm"."""
    for r in _BY_SCOPE["text"] + _BY_SCOPE["root"]:
        if r.role == role:
            return r.gguf_names[0]
    raise KeyError(role)


_MODULE_TARGETS = tuple((r, r.column_rx(r.module) if r.module else r._rx)  # type: ignore[attr-defined]
                        for r in _BY_SCOPE["trunk"])


def module_sources(layer: int, key: str, n_stack: int = 0) -> list[list[str]] | None:
    """The HF tensors (canonical names) of parameter ``key`` of transformers' trunk decoder layer ``layer``:
    [stacked experts][concatenated parts]; ``n_stack`` = the stacked size (the parameter's dim 0). None when
    the table has no rule for it."""
    for rule, rx in _MODULE_TARGETS:
        m = rx.fullmatch(key)
        if m:
            prefix = _canonical_prefix(rule, layer)
            return [[prefix + n for n in row] for row in rule.gather(m.groupdict(), rule.module or rule.hf_fmt, n_stack)]
    return None


def nextn_only_shapes(hidden_size: int) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """Tensors of a NextN block that transformers' decoder layer lacks, names relative to ``layers.{i}.``:
    (those before the block's body in GLM's checkpoints, those after it)."""
    before: dict[str, tuple[int, ...]] = {}
    after: dict[str, tuple[int, ...]] = {}
    for r in _BY_SCOPE["mtp"]:
        if r.nextn is None:
            continue
        side, units = r.nextn
        for row in r.gather({}, ""):
            for n in row:
                (before if side == "in" else after)[n] = tuple(u * hidden_size for u in units)
    return before, after


def is_vision(name: str) -> bool:
    """True for a tensor of the vision tower (it goes to the mmproj, never to the text GGUF)."""
    return _PREFIX_RX["vision"].match(name) is not None


def in_nextn_block(local: str) -> bool:
    """True when a decoder-layer tensor (name after ``layers.{i}.``) may appear in a NextN block (no mHC)."""
    return _match(_BY_SCOPE["mtp"], local) is not None


def normalise_layer_type(kind: str) -> str:
    """Map the spellings of the DSA kind (``deepseek_sparse_attention``, ``indexed_attention``,
    ``full_attention``) to ``deepseek_sparse_attention``; ``linear_attention`` stays. Others -> InputError."""
    if kind == "linear_attention":
        return kind
    if kind in ("deepseek_sparse_attention", "indexed_attention", "full_attention"):
        return "deepseek_sparse_attention"
    raise InputError(f"unknown glm5_next layer type {kind!r}")
