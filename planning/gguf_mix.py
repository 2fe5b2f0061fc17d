"""llama.cpp's per-tensor type choice for the named GGUF mixes, for the upstream ``glm5-next`` arch.

Pure functions over GGUF tensor names and numpy shapes (outermost first, row length = ``shape[-1]`` = ne0).
Reproduces llama-quantize as vendored in llama-cpp-python 0.3.36 (facts: ../shared/reference/gguf-facts.md §4,
gguf-glm5-next.md §3.3-3.4; ``V:src/llama-quant.cpp``):

1. not quantizable (§4.2 + the glm5-next exclusion list) -> the source type the converter wrote;
2. ``--tensor-type`` style overrides: first regex (searched in the GGUF name) that matches wins and skips the mix;
3. otherwise the mix rules (``llama_tensor_get_type_impl``) including the glm5-next Q8_0 floor, restated as rows
   (RULES, CONDITIONS) for every ftype name llama-quantize takes (MIXES, ``V:tools/quantize/quantize.cpp``);
4. the shape fallback for rows that are not a multiple of the block size (§4.4).

Counters: tensors are visited in llama.cpp's loader order (layer number, then name; non-``blk`` names first);
``i_attention_wv`` counts the attn_v-like tensors in that order; ffn_down / ffn_gate / ffn_up use the layer parsed
from the name (MoE) against ``n_layer_all`` = trunk + NextN blocks, except that the IQ1/IQ2 mixes count ffn_down
tensors in loader order (two per MoE layer) against the same ``n_layer_all``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from gguf.constants import GGMLQuantizationType, LlamaFileType

from mixq.errors import FormatError, PlanError
from mixq.formats import gguf_layout
from mixq.quant.ggml.registry import SUPPORTED

# --- the named mixes: llama-quantize's ftype names, their file-type ids and default types ------------------------
@dataclass(frozen=True)
class Mix:
    """One llama-quantize ftype: the ggml type its quantizable tensors take unless a rule bumps them."""
    name: str
    default: str

    @property
    def file_type(self) -> int:
        """general.file_type of the file (gguf-py's LlamaFileType, the same ids as llama.h's llama_ftype)."""
        return int(LlamaFileType["MOSTLY_" + self.name])


# V:src/llama-quant.cpp llama_ftype_get_default_type; names as V:tools/quantize/quantize.cpp QUANT_OPTIONS
MIXES: dict[str, Mix] = {m.name: m for m in (
    Mix("Q4_0", "Q4_0"), Mix("Q4_1", "Q4_1"), Mix("Q5_0", "Q5_0"), Mix("Q5_1", "Q5_1"), Mix("Q8_0", "Q8_0"),
    Mix("Q2_K", "Q2_K"), Mix("Q2_K_S", "Q2_K"), Mix("Q3_K_S", "Q3_K"), Mix("Q3_K_M", "Q3_K"), Mix("Q3_K_L", "Q3_K"),
    Mix("Q4_K_S", "Q4_K"), Mix("Q4_K_M", "Q4_K"), Mix("Q5_K_S", "Q5_K"), Mix("Q5_K_M", "Q5_K"), Mix("Q6_K", "Q6_K"),
    Mix("IQ1_S", "IQ1_S"), Mix("IQ1_M", "IQ1_M"), Mix("IQ2_XXS", "IQ2_XXS"), Mix("IQ2_XS", "IQ2_XS"),
    Mix("IQ2_S", "IQ2_XS"), Mix("IQ2_M", "IQ2_S"), Mix("IQ3_XXS", "IQ3_XXS"), Mix("IQ3_XS", "IQ3_S"),
    Mix("IQ3_S", "IQ3_S"), Mix("IQ3_M", "IQ3_S"), Mix("IQ4_NL", "IQ4_NL"), Mix("IQ4_XS", "IQ4_XS"),
)}
MIX_DEFAULT = {n: m.default for n, m in MIXES.items()}
MIX_ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}  # V:tools/quantize/quantize.cpp QUANT_OPTIONS
MIX_NAMES: tuple[str, ...] = tuple(MIXES)


def requires_imatrix(type_name: str, tensor_name: str, mix: str | None = None) -> bool:
    """Whether llama-quantize refuses to write ``tensor_name`` as ``type_name`` without importance data: the
    very-low-bit types (gguf_layout.QUANTIZE_REQUIRES_IMATRIX) and Q2_K inside a Q2_K_S file, token_embd and
    output excepted (V:src/llama-quant.cpp tensor_requires_imatrix), unless ggml's encoder itself needs it."""
    t = type_name.upper()
    if t in gguf_layout.GGML_REQUIRES_IMATRIX:
        return True
    if tensor_name in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight"):
        return False
    return t in gguf_layout.QUANTIZE_REQUIRES_IMATRIX or (t == "Q2_K" and str(mix).upper() == "Q2_K_S")

FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
            "IQ4_XS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ3_XXS": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL",
            "IQ2_S": "IQ4_NL", "IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL", "TQ1_0": "Q4_0", "TQ2_0": "Q4_0"}

# names llama-quantize never touches in any architecture (gguf-facts.md §4.2, V:src/llama-quant.cpp:331-346);
# the glm5-next exclusion list and Q8_0 floor are the architecture table's GGUF policies (MixContext.policy)
_GENERIC_KEEP = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "ssm_conv1d",
                 "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight")
NEVER_QUANTIZED = ("keep", "f32")  # architecture policies llama-quantize leaves alone
Q8_FLOOR = "q8_floor"              # quantized, never below Q8_0 (V:src/llama-quant.cpp:472-484)
_BLK = re.compile(r"blk\.(\d+)\.")


def ggml_type(name: str) -> GGMLQuantizationType:
    """The gguf-py enum for a type name ("q4_k" -> Q4_K); unknown names raise PlanError."""
    try:
        return gguf_layout.ggml_type(name)
    except FormatError as e:
        raise PlanError(str(e)) from None


def block_size(type_name: str) -> int:
    """Weights per block of a ggml type (formats/gguf_layout); unknown names raise PlanError."""
    return gguf_layout.block_weights(ggml_type(type_name).name)


def type_bpw(type_name: str) -> float:
    """Storage bits per weight of a ggml type (formats/gguf_layout); unknown names raise PlanError."""
    return gguf_layout.bits_per_weight(ggml_type(type_name).name)


def tensor_nbytes(type_name: str, shape: Sequence[int]) -> int:
    """Bytes of a tensor of numpy ``shape`` stored as ``type_name`` (formats/gguf_layout.tensor_bytes); a plan
    that asks for an impossible size is a PlanError."""
    try:
        return gguf_layout.tensor_bytes(type_name, shape)
    except FormatError as e:
        raise PlanError(str(e)) from None


def is_quantized_type(type_name: str) -> bool:
    """Whether a ggml type is block-quantized (formats/gguf_layout.is_quantized)."""
    return gguf_layout.is_quantized(type_name)


def ggml_n_dims(shape: Sequence[int]) -> int:
    """ggml_n_dims of a numpy shape: 1 + the highest ggml axis (ne, innermost first) longer than 1."""
    ne = list(reversed([int(d) for d in shape]))
    n = 1
    for i, d in enumerate(ne):
        if d > 1:
            n = i + 1
    return n


def allows_quantization(name: str, shape: Sequence[int], policy: str | None = None) -> bool:
    """llama.cpp's ``tensor_allows_quantization`` (gguf-facts.md §4.2); ``policy``: the architecture's GGUF policy
    of the tensor (formats/glm5next), "keep" / "f32" being its exclusion list."""
    if ggml_n_dims(shape) < 2:
        return False
    if not name.endswith("weight"):
        return False
    if any(k in name for k in _GENERIC_KEEP):
        return False
    return policy not in NEVER_QUANTIZED


def fallback(type_name: str, ne0: int) -> str:
    """Shape fallback (gguf-facts.md §4.4): K/IQ types on rows that are not multiples of 256."""
    t = type_name.upper()
    if ne0 % block_size(t) == 0:
        return t
    if t not in FALLBACK:
        raise PlanError(f"no type fallback for {t} on rows of length {ne0}")
    f = FALLBACK[t]
    return f if ne0 % block_size(f) == 0 else "F16"


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"), ("attn_v.weight", "attn_v"),
                     ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
                     ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if key in name:
            return cat
    return "other"


def loader_order(names: Sequence[str]) -> list[int]:
    """Indices of ``names`` in llama.cpp's ``weights_map`` order: blk number (-1 for others), then name."""
    def key(i: int):
        m = _BLK.match(names[i])
        return (int(m.group(1)) if m else -1, names[i].encode())
    return sorted(range(len(names)), key=key)


def _no_policy(name: str) -> str | None:
    return None


@dataclass
class MixContext:
    """Model facts the mix rules read: n_layer_all (trunk + NextN), n_expert, n_gqa of layer 0, and ``policy``:
    GGUF tensor name -> the architecture's GGUF policy (formats/glm5next.gguf_policy; None = no rule)."""

    n_layer_all: int
    n_expert: int
    n_gqa: int = 0
    policy: Callable[[str], str | None] = _no_policy


# --- the per-tensor bumps of each mix (V:src/llama-quant.cpp llama_tensor_get_type_impl), restated as rows -------
def _m(*names: str) -> frozenset[str]:
    return frozenset(names)


@dataclass(frozen=True)
class Bump:
    """A tensor of a category, quantized with one of `mixes`, takes type `to` when condition `when` holds. A
    category's rows are read in order and the first that applies decides; none applies: the mix's default type."""
    mixes: frozenset[str]
    to: str
    when: str = "always"


LOW_BIT = _m("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M")  # one branch of their own for the body
_IQ1, _IQ2_SM = _m("IQ1_S", "IQ1_M"), _m("IQ2_S", "IQ2_M")
_ALL = frozenset(MIXES)
# output.weight (and a tied token_embd): Q8_0 when its rows do not hold the default type's block, else these at Q5_K,
# else Q6_K unless the mix's default is Q8_0
OUTPUT_Q5_K = LOW_BIT | _m("IQ3_XXS")
_ATTN_OUT_E8 = _m("Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ3_S", "IQ3_M",
                  "IQ4_XS")

# keys: "<branch>:<category>", branch "low" for the LOW_BIT mixes, "std" for the others
RULES: dict[str, tuple[Bump, ...]] = {
    "any:token_embd": (Bump(_m("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"), "Q2_K"),
                       Bump(_m("IQ2_S", "IQ2_M", "IQ3_XXS"), "IQ3_S")),
    "low:attn_v": (Bump(LOW_BIT, "Q4_K", "gqa4_or_experts4"), Bump(_IQ2_SM, "IQ3_S"), Bump(LOW_BIT, "Q2_K")),
    "low:attn_k": (Bump(LOW_BIT, "Q4_K", "experts8"),),
    "low:ffn_down": (Bump(_IQ2_SM, "IQ3_S", "counted_first_eighth"), Bump(LOW_BIT, "Q2_K", "counted_first_eighth")),
    "low:attn_output": (Bump(LOW_BIT, "Q5_K", "experts8"), Bump(_IQ1, "IQ2_XXS"), Bump(_IQ2_SM, "IQ3_S")),
    "std:attn_v": (
        Bump(_ALL, "Q8_0", "experts8"),  # llama.cpp sets it after the bumps, over them
        Bump(_m("Q2_K"), "Q4_K", "gqa4"), Bump(_m("Q2_K"), "Q3_K"),
        Bump(_m("Q2_K_S"), "Q4_K", "gqa4"),
        Bump(_m("IQ3_XXS"), "Q4_K", "gqa4"), Bump(_m("IQ3_XXS"), "IQ3_S", "no_imatrix"),
        Bump(_m("IQ3_XS", "IQ3_S"), "Q4_K", "gqa4"),
        Bump(_m("IQ3_M"), "Q4_K"),
        Bump(_m("Q3_K_M"), "Q5_K", "first_two_v"), Bump(_m("Q3_K_M"), "Q4_K"),
        Bump(_m("Q3_K_L"), "Q5_K"),
        Bump(_m("IQ4_NL", "IQ4_XS"), "Q5_K", "gqa4"),
        Bump(_m("Q4_K_M", "Q5_K_M"), "Q6_K", "more_bits_v"),
        Bump(_m("Q4_K_S"), "Q5_K", "first_four_v"),
    ),
    "std:attn_k": (Bump(_ALL, "Q8_0", "experts8"), Bump(_m("IQ3_XS"), "IQ3_XXS"), Bump(_m("IQ3_XXS"), "IQ2_S")),
    "std:attn_q": (Bump(_m("IQ3_XS"), "IQ3_XXS"), Bump(_m("IQ3_XXS"), "IQ2_S")),
    "std:ffn_down": (
        Bump(_m("Q2_K"), "Q3_K"),
        Bump(_m("Q2_K_S"), "Q4_K", "first_eighth"),
        Bump(_m("IQ3_XXS"), "Q4_K", "first_eighth_no_imatrix"), Bump(_m("IQ3_XXS"), "Q3_K", "no_imatrix"),
        Bump(_m("Q3_K_M"), "Q5_K", "first_sixteenth"), Bump(_m("Q3_K_M"), "Q4_K"),
        Bump(_m("IQ3_M"), "Q4_K", "first_eighth"), Bump(_m("IQ3_M"), "Q4_K", "experts8_more_bits"),
        Bump(_m("Q3_K_L"), "Q5_K"),
        Bump(_m("Q4_K_M"), "Q6_K", "more_bits"),
        Bump(_m("IQ4_NL", "IQ4_XS"), "Q5_K", "first_eighth_no_imatrix"),
        Bump(_m("Q5_K_M"), "Q6_K", "more_bits"),
        Bump(_m("Q4_K_S"), "Q5_K", "first_eighth"),
        Bump(_m("Q4_0"), "Q4_1", "first_eighth_imatrix"), Bump(_m("Q5_0"), "Q5_1", "first_eighth_imatrix"),
    ),
    "std:attn_output": (
        Bump(_ATTN_OUT_E8, "Q5_K", "experts8"),
        Bump(_m("Q2_K"), "Q3_K", "not_experts8"), Bump(_m("IQ3_XXS"), "IQ3_S", "not_experts8"),
        Bump(_m("Q3_K_M"), "Q4_K", "not_experts8"), Bump(_m("Q3_K_L"), "Q5_K", "not_experts8"),
        Bump(_m("IQ3_M"), "Q4_K", "not_experts8"),
    ),
    "std:ffn_gate": (Bump(_m("IQ3_XS"), "IQ3_XXS", "middle_layers"),),
    "std:ffn_up": (Bump(_m("IQ3_XS"), "IQ3_XXS", "middle_layers"),),
}


@dataclass(frozen=True)
class _Where:
    """What the conditions read: the tensor's layer (or count) of its category and that count's total, the
    attn_v-like count and total, the ffn_down count, the model's GQA and experts, and whether an imatrix is given."""
    i: int
    n: int
    i_v: int
    n_v: int
    i_down: int
    gqa: int
    n_expert: int
    imatrix: bool


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


CONDITIONS: dict[str, Callable[[_Where], bool]] = {
    "always": lambda w: True,
    "gqa4": lambda w: w.gqa >= 4,
    "gqa4_or_experts4": lambda w: w.gqa >= 4 or w.n_expert >= 4,
    "experts8": lambda w: w.n_expert == 8,
    "not_experts8": lambda w: w.n_expert != 8,
    "no_imatrix": lambda w: not w.imatrix,
    "first_two_v": lambda w: w.i_v < 2,
    "first_four_v": lambda w: w.i_v < 4,
    "more_bits_v": lambda w: _use_more_bits(w.i_v, w.n_v),
    "first_eighth": lambda w: w.i < w.n // 8,
    "first_sixteenth": lambda w: w.i < w.n // 16,
    "first_eighth_no_imatrix": lambda w: w.i < w.n // 8 and not w.imatrix,
    "first_eighth_imatrix": lambda w: w.i < w.n // 8 and w.imatrix,
    "more_bits": lambda w: _use_more_bits(w.i, w.n),
    "experts8_more_bits": lambda w: w.n_expert == 8 and _use_more_bits(w.i, w.n),
    "middle_layers": lambda w: w.n // 8 <= w.i < 7 * w.n // 8,
    # the IQ1/IQ2 mixes count ffn_down tensors in loader order (an MoE layer has two: exps and shexp)
    "counted_first_eighth": lambda w: w.i_down < w.n // 8,
}


def normalize_mix(mix: str) -> str:
    """The llama-quantize mix a ``--type`` names (case-insensitive, Q3_K/Q4_K/Q5_K aliases); PlanError if none."""
    m = mix.upper()
    m = MIX_ALIASES.get(m, m)
    if m not in MIX_DEFAULT:
        raise PlanError(f"unknown GGUF mix {mix!r}: use one of {', '.join(MIX_NAMES)}")
    return m


def _layer(name: str, cat: str, ctx: MixContext, state: dict) -> int:
    """The layer an FFN rule reads: parsed from ``blk.N.`` in an MoE model (its experts are not in layer order),
    else the count of that category so far."""
    if ctx.n_expert <= 1:
        return state["i_" + cat]
    m = _BLK.match(name)
    if not m:
        raise PlanError(f"cannot determine the layer of {name}")
    i = int(m.group(1))
    if i >= ctx.n_layer_all:
        raise PlanError(f"{name}: layer {i} is beyond the model's {ctx.n_layer_all} blocks")
    return i


def _mix_rule(mix: str, default: str, name: str, ne0: int, cat: str, ctx: MixContext, state: dict,
              imatrix: bool) -> str:
    """The type of one quantizable tensor under ``mix`` (no override): the glm5-next Q8_0 floor, the output rule,
    then the first row of RULES for its category that applies (gguf-facts.md §4.3, §4.6)."""
    if ctx.policy(name) == Q8_FLOOR:  # the architecture's Q8_0 floor, before everything else
        return "Q8_0"
    if cat == "output" or (state["tied"] and cat == "token_embd"):
        if ne0 % block_size(default):
            return "Q8_0"
        if mix in OUTPUT_Q5_K:
            return "Q5_K"
        return default if default == "Q8_0" else "Q6_K"
    branch = "any" if cat == "token_embd" else "low" if mix in LOW_BIT else "std"
    key = "attn_v" if cat in ("attn_v", "attn_qkv", "attn_kv_b") else cat
    i = n = 0
    if key in ("ffn_down", "ffn_gate", "ffn_up"):
        i = state["i_" + key] if branch == "low" else _layer(name, key, ctx, state)
        n = ctx.n_layer_all
    where = _Where(i=i, n=n, i_v=state["i_attn_v"], n_v=state["n_attn_v"], i_down=state["i_ffn_down"],
                   gqa=ctx.n_gqa, n_expert=ctx.n_expert, imatrix=imatrix)
    new = default
    for row in RULES.get(f"{branch}:{key}", ()):
        if mix in row.mixes and CONDITIONS[row.when](where):
            new = row.to
            break
    if "i_" + key in state:  # the counts advance only where llama.cpp's rules look at the tensor
        state["i_" + key] += 1
    return new


def mix_types(tensors: Sequence[tuple[str, tuple[int, ...], str]], mix: str, ctx: MixContext,
              tensor_types: Sequence[tuple[str, str]] = (), manual: dict[int, str] | None = None,
              stats: dict | None = None, imatrix: bool = False) -> list[str]:
    """The type llama-quantize gives each ``(gguf_name, numpy_shape, source_type)`` for ``mix``; ``imatrix``:
    whether an importance matrix is given (some mixes choose differently with one, as llama-quantize does).

    ``tensor_types``: ``(regex, TYPE)`` pairs like ``--tensor-type`` (pattern lower-cased, searched in the name,
    first match wins, skips the mix rules and the Q8_0 floor, the shape fallback still applies); ``manual``:
    tensor index -> TYPE chosen by the caller (mixq's --override), same semantics, checked before the regexes.
    ``stats`` (optional dict) receives ``n_fallback``, the count llama-quantize prints as "required fallback"."""
    mix = normalize_mix(mix)
    default = MIX_DEFAULT[mix]
    names = [t[0] for t in tensors]
    compiled = []
    for pat, typ in tensor_types:
        try:
            compiled.append((re.compile(pat.lower()), typ.upper()))
        except re.error as e:
            raise PlanError(f"bad --tensor-type pattern {pat!r}: {e}") from None
        ggml_type(typ)
    state = {"i_attn_v": 0, "i_ffn_down": 0, "i_ffn_gate": 0, "i_ffn_up": 0,
             "n_attn_v": sum(1 for n in names if _category(n) in ("attn_v", "attn_qkv", "attn_kv_b")),
             "tied": "output.weight" not in names}
    out: list[str] = [""] * len(tensors)
    for idx in loader_order(names):
        name, shape, src = tensors[idx]
        if not allows_quantization(name, shape, ctx.policy(name)):
            out[idx] = src
            continue
        new = default
        is_manual = False
        if manual and idx in manual:
            new, is_manual = ggml_type(manual[idx]).name, True
        for rx, typ in ([] if is_manual else compiled):
            if rx.search(name):
                new, is_manual = typ, True
                break
        if not is_manual:
            new = _mix_rule(mix, default, name, int(shape[-1]), _category(name), ctx, state, imatrix)
        if is_quantized_type(new):
            fb = fallback(new, int(shape[-1]))
            state["n_fallback"] = state.get("n_fallback", 0) + (fb != new)
            new = fb
        out[idx] = new
    if stats is not None:
        stats["n_fallback"] = state.get("n_fallback", 0)
    return out


# --- custom (role-based) GGUF ladders --------------------------------------------------------------------------
GGUF_LADDER: tuple[str, ...] = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0")  # K-quants (the default)
# "iq": adds the i-quants (mixq.quant.ggml.encoders writes them all, bit-exact with ggml; IQ2_*/IQ3_XXS need an
# importance matrix, as in llama-quantize); the only way below 2.625 bpw, i.e. to put a 321B model into ~108 GB
# (as the Unsloth UD-Q2_K_XL mixes do)
GGUF_LADDER_IQ: tuple[str, ...] = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "Q2_K", "IQ3_XXS", "Q3_K", "IQ4_XS", "Q4_K",
                                   "Q5_K", "Q6_K", "Q8_0")
LADDERS = {"k": GGUF_LADDER, "iq": GGUF_LADDER_IQ}
DEFAULT_LADDER = "k"  # --gguf-ladder when not given
GGUF_ROLE_TYPES = {"routed_expert": "Q4_K", "attn": "Q6_K", "shared_expert": "Q6_K", "lm_head": "Q6_K",
                   "dense_mlp": "Q5_K"}
BITS_TO_TYPE = {2: "Q2_K", 3: "Q3_K", 4: "Q4_K", 5: "Q5_K", 6: "Q6_K", 8: "Q8_0"}


def bits_to_type(bits: float) -> str:
    """``--head-bits 6`` / ``--mtp-bits 4`` on GGUF: the K-quant of that width (16 -> BF16)."""
    if bits >= 16:
        return "BF16"
    b = int(round(bits))
    if b == 7:
        b = 8
    if b not in BITS_TO_TYPE:
        raise PlanError(f"no GGUF type for {bits} bits (use 2, 3, 4, 5, 6, 8 or 16)")
    return BITS_TO_TYPE[b]


def encodable_types() -> tuple[str, ...]:
    """The ggml types mixq writes: the float types and every type of the ggml registry (mixq.quant.ggml.registry)."""
    return gguf_layout.FLOAT_TYPES + tuple(SUPPORTED)


def has_encoder(type_name: str) -> bool:
    """Whether mixq can write `type_name` (plan and convert share this check)."""
    return type_name.upper() in encodable_types()


def ladder(ne0: int, floor: str | None = None, kind: str = DEFAULT_LADDER) -> list[str]:
    """The custom-mix candidate types of a tensor with rows of ``ne0``, after the shape fallback, deduplicated
    (by type and by bits per weight), ascending; ``floor`` drops every type below it; ``kind``: "k" or "iq"."""
    if kind not in LADDERS:
        raise PlanError(f"GGUF ladder {kind!r}: use one of {', '.join(LADDERS)}")
    out: list[str] = []
    for t in LADDERS[kind]:
        f = fallback(t, ne0)
        # a type mixq cannot encode (a fallback such as IQ4_NL) never enters a plan that convert must then refuse
        if f not in out and has_encoder(f) and all(type_bpw(f) != type_bpw(o) for o in out):
            out.append(f)
    out.sort(key=type_bpw)
    if floor:
        fb = type_bpw(fallback(floor, ne0))
        out = [t for t in out if type_bpw(t) >= fb]
    return out


# --- file size estimate ------------------------------------------------------------------------------------------
GGUF_ALIGNMENT = 32


def aligned(n: int, a: int = GGUF_ALIGNMENT) -> int:
    """``n`` bytes rounded up to GGUF's alignment (every tensor's data and the header end on it)."""
    return -(-n // a) * a


def stored_bytes(type_name: str, shape: Sequence[int]) -> int:
    """Bytes a tensor of ``type_name`` takes in a GGUF file, alignment padding included."""
    return aligned(tensor_nbytes(type_name, shape))


def tensor_info_bytes(name: str, ndim: int) -> int:
    """GGUF v3 tensor-info entry: name (u64 len + bytes), n_dims u32, dims u64 each, type u32, offset u64."""
    return 8 + len(name.encode()) + 4 + 8 * ndim + 4 + 8


def gguf_file_bytes(tensors: Sequence[tuple[str, tuple[int, ...], str]], kv_bytes: int) -> tuple[int, int]:
    """(total file bytes, header bytes) of one GGUF: 24-byte header + KV + tensor infos, padded to 32, then each
    tensor's data padded to 32 (gguf-facts.md §1.1). ``kv_bytes`` comes from ``estimate_kv_bytes``."""
    head = header_bytes([(n, len(s)) for n, s, _ in tensors], kv_bytes)
    data = sum(stored_bytes(t, s) for _, s, t in tensors)
    return head + data, head


def header_bytes(names_ndims: Iterable[tuple[str, int]], kv_bytes: int) -> int:
    """A GGUF header's bytes: 24 fixed, the KV metadata, one tensor-info entry per (name, n_dims), padded."""
    return aligned(24 + kv_bytes + sum(tensor_info_bytes(n, nd) for n, nd in names_ndims))


def estimate_kv_bytes(n_layer_all: int, vocab_size: int, token_bytes: int | None = None,
                      merge_bytes: int | None = None, template_bytes: int = 4096) -> int:
    """Metadata estimate: ~60 arch/general keys (≈64 bytes each), two per-layer arrays (head_count_kv,
    indexer types), the tokenizer (tokens as u64-length strings + i32 token types + merges) and a chat template.
    ``token_bytes``/``merge_bytes``: the UTF-8 byte totals when the tokenizer is at hand; otherwise 7 bytes per
    token and 14 per merge (byte-level BPE averages)."""
    tb = token_bytes if token_bytes is not None else 7 * vocab_size
    mb = merge_bytes if merge_bytes is not None else 14 * max(0, vocab_size - 256)
    n_merges = max(0, vocab_size - 256)
    scalars = 60 * 64
    arrays = 2 * (64 + 4 * n_layer_all)
    tokenizer = (64 + 8 * vocab_size + tb) + (64 + 4 * vocab_size) + (64 + 8 * n_merges + mb)
    return scalars + arrays + tokenizer + 64 + template_bytes
