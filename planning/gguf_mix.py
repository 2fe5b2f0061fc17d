"""llama.cpp's per-tensor type choice for the named GGUF mixes, for the upstream ``glm5-next`` arch.

Pure functions over GGUF tensor names and numpy shapes (outermost first, row length = ``shape[-1]`` = ne0).
Reproduces llama-quantize as vendored in llama-cpp-python 0.3.36 (facts: ../shared/reference/gguf-facts.md §4,
gguf-glm5-next.md §3.3-3.4; ``V:src/llama-quant.cpp``):

1. not quantizable (§4.2 + the glm5-next exclusion list) -> the source type the converter wrote;
2. ``--tensor-type`` style overrides: first regex (searched in the GGUF name) that matches wins and skips the mix;
3. otherwise the mix rules (``llama_tensor_get_type_impl``) including the glm5-next Q8_0 floor;
4. the shape fallback for rows that are not a multiple of the block size (§4.4).

Counters: tensors are visited in llama.cpp's loader order (layer number, then name; non-``blk`` names first);
``i_attention_wv`` counts the attn_v-like tensors in that order; ffn_down uses the layer parsed from the name
(MoE) against ``n_layer_all`` = trunk + NextN blocks.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from gguf.constants import GGMLQuantizationType

from mixq.errors import FormatError, PlanError
from mixq.formats import gguf_layout
from mixq.quant.ggml.registry import SUPPORTED

MIX_DEFAULT = {
    "Q2_K": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K", "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K",
    "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "Q8_0": "Q8_0",
}
MIX_ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}  # V:tools/quantize/quantize.cpp:34-75

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


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


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


def normalize_mix(mix: str) -> str:
    m = mix.upper()
    m = MIX_ALIASES.get(m, m)
    if m not in MIX_DEFAULT:
        raise PlanError(f"unknown GGUF mix {mix!r}: use one of {', '.join(sorted(MIX_DEFAULT))}")
    return m


def _mix_rule(mix: str, default: str, name: str, ne0: int, cat: str, ctx: MixContext, state: dict) -> str:
    """``llama_tensor_get_type_impl`` restricted to the K-quant / Q8_0 mixes (gguf-facts.md §4.3, §4.6)."""
    new = default
    if ctx.policy(name) == Q8_FLOOR:  # the architecture's Q8_0 floor, before everything else
        return "Q8_0"
    if cat == "output" or (state["tied"] and cat == "token_embd"):
        if ne0 % block_size(new):
            return "Q8_0"
        return new if new == "Q8_0" else "Q6_K"
    if cat == "token_embd":
        return new
    if cat in ("attn_v", "attn_qkv", "attn_kv_b"):
        i, n = state["i_attn_v"], state["n_attn_v"]
        if mix == "Q2_K":
            new = "Q4_K" if ctx.n_gqa >= 4 else "Q3_K"
        elif mix == "Q3_K_M":
            new = "Q5_K" if i < 2 else "Q4_K"
        elif mix == "Q3_K_L":
            new = "Q5_K"
        elif mix in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i, n):
            new = "Q6_K"
        elif mix == "Q4_K_S" and i < 4:
            new = "Q5_K"
        if ctx.n_expert == 8:
            new = "Q8_0"
        state["i_attn_v"] += 1
        return new
    if cat == "attn_k":
        return "Q8_0" if ctx.n_expert == 8 else new
    if cat == "ffn_down":
        if ctx.n_expert > 1:
            m = _BLK.match(name)
            if not m:
                raise PlanError(f"cannot determine the layer of {name}")
            i_layer = int(m.group(1))
        else:
            i_layer = state["i_ffn_down"]
        n = ctx.n_layer_all
        if mix == "Q2_K":
            new = "Q3_K"
        elif mix == "Q3_K_M":
            new = "Q5_K" if i_layer < n // 16 else "Q4_K"
        elif mix == "Q3_K_L":
            new = "Q5_K"
        elif mix == "Q4_K_M":
            if _use_more_bits(i_layer, n):
                new = "Q6_K"
        elif mix == "Q5_K_M" and _use_more_bits(i_layer, n):
            new = "Q6_K"
        elif mix == "Q4_K_S" and i_layer < n // 8:
            new = "Q5_K"
        state["i_ffn_down"] += 1
        return new
    if cat == "attn_output":
        if ctx.n_expert == 8:
            if mix in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M"):
                new = "Q5_K"
        elif mix == "Q2_K":
            new = "Q3_K"
        elif mix == "Q3_K_M":
            new = "Q4_K"
        elif mix == "Q3_K_L":
            new = "Q5_K"
        return new
    return new


def mix_types(tensors: Sequence[tuple[str, tuple[int, ...], str]], mix: str, ctx: MixContext,
              tensor_types: Sequence[tuple[str, str]] = (), manual: dict[int, str] | None = None,
              stats: dict | None = None) -> list[str]:
    """The type llama-quantize gives each ``(gguf_name, numpy_shape, source_type)`` for ``mix``.

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
    state = {"i_attn_v": 0, "i_ffn_down": 0,
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
            new = _mix_rule(mix, default, name, int(shape[-1]), _category(name), ctx, state)
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
