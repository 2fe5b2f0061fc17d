"""Inference memory model of glm5_next caches: pure arithmetic, one formula per buffer the engines allocate.

Every term is derived from the engines' own cache code; docs/memory-model.md gives each formula with its source
(llama.cpp as vendored in llama-cpp-python 0.3.36, ``V:``; exllamav3 1.6.5, ``E:``). In short:

llama.cpp (``llama_memory_hybrid_idx``, V:src/llama-model.cpp glm5-next case, V:src/llama-memory-hybrid-idx.cpp):
  * trunk DSA layers: a K-only MLA cache (``is_mla`` -> no V tensor) of ``key_length = kv_lora_rank + rope``
    values per token, type ``-ctk``;
  * trunk DSA layers with a full indexer: an indexer "K" cache of ``index_head_dim · 3`` values per token
    (key, gate, pooled; ``·1`` without k-pool), same type;
  * trunk KDA layers: recurrent R (conv) ``3·(d_conv−1)·H·d`` and S (state) ``d·d·H`` floats, F32, per sequence
    (and per rollback snapshot);
  * cells = n_ctx rounded up to 256 (``V:src/llama-context.cpp:290``); the NextN block has no cache.
exllamav3 (E:cache/mla.py, E:modules/gated_delta_net.py, E:cache/cache.py):
  * DSA layers: latent ``kv_lora_rank`` fp16 (or packed k_bits + fp16 group scales per 32), rope key fp16,
    indexer plane ``2·index_head_dim`` fp16 per token, pooled-key plane ``index_head_dim`` fp16 per kpool tokens;
  * KDA layers per batch slot: conv ring bf16 ``3·H·d·(d_conv + max_history)``, recurrent state
    ``2·H·d·d`` fp16 (or fp32), staged scan inputs for ``max_history + 1`` tokens;
  * ``max_num_tokens`` is a multiple of the 256-token page.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from mixq.errors import PlanError

LLAMA_CACHE_TYPES = {  # name -> (block size, bytes per block), ggml type traits
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q5_1": (32, 24), "q5_0": (32, 22),
    "q4_1": (32, 20), "q4_0": (32, 18), "iq4_nl": (32, 18),
}
EXL3_CACHE_BITS = {"fp16": 16, "q8": 8, "q7": 7, "q6": 6, "q5": 5, "q4": 4, "q3": 3, "q2": 2}
LLAMA_PAD = 256      # V:src/llama-context.cpp:290 n_ctx = GGML_PAD(n_ctx, 256)
EXL3_PAGE = 256      # E:constants.py PAGE_SIZE


@dataclass(frozen=True)
class CacheGeometry:
    """The config numbers the caches depend on (trunk only: the NextN block is never attended by the trunk)."""

    dsa_layers: int
    indexer_layers: int
    kda_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int
    index_kpool: int
    kda_heads: int
    kda_head_dim: int
    conv_kernel: int

    @classmethod
    def from_config(cls, text: dict) -> "CacheGeometry":
        """From a glm5_next ``text_config`` (or a flat config dict)."""
        text = text.get("text_config", text)
        try:
            kinds = cache_layers(text)
            lac = text.get("linear_attn_config") or {}
            return cls(
                dsa_layers=len(kinds["dsa"]),
                indexer_layers=len(kinds["indexer"]),
                kda_layers=len(kinds["kda"]),
                kv_lora_rank=int(text["kv_lora_rank"]),
                qk_rope_head_dim=int(text.get("qk_rope_head_dim") or 0),
                index_head_dim=int(text["index_head_dim"]),
                index_kpool=int(text.get("index_kpool") or 0),
                kda_heads=int(lac.get("num_heads") or text.get("linear_num_heads") or text["num_attention_heads"]),
                kda_head_dim=int(lac.get("head_dim") or text.get("linear_head_dim")),
                conv_kernel=int(lac.get("short_conv_kernel_size") or text.get("linear_conv_kernel_dim") or 4),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"config lacks a glm5_next cache field: {e}") from None


def cache_layers(text: dict) -> dict[str, list[int]]:
    """The trunk layers that hold each cache: "dsa" (MLA latent), "indexer" (DSA layers with a full indexer),
    "kda" (recurrent state), from a glm5_next ``text_config``."""
    text = text.get("text_config", text)
    n = int(text["num_hidden_layers"])
    kinds = list(text.get("layer_types") or [])[:n]
    idx_types = list(text.get("indexer_types") or ["full"] * n)[:n]
    dsa = [i for i, k in enumerate(kinds) if k != "linear_attention"]
    return {"dsa": dsa, "indexer": [i for i in dsa if i >= len(idx_types) or idx_types[i] == "full"],
            "kda": [i for i, k in enumerate(kinds) if k == "linear_attention"]}


def cache_by_layer(text: dict, cache: "CacheBytes") -> dict[int, int]:
    """``cache``'s bytes per trunk layer (each engine allocates a layer's cache with the layer): the MLA latent
    over the DSA layers, the indexer keys over the full-indexer layers, the KDA state over the KDA layers; equal
    shares, the remainder of a division on the first layers, so the values sum to ``cache.total`` exactly."""
    kinds = cache_layers(text)
    out: dict[int, int] = {}
    for layers, total in ((kinds["dsa"], cache.mla), (kinds["indexer"], cache.indexer + cache.kpool),
                          (kinds["kda"], cache.fixed)):
        if not layers:
            continue
        q, r = divmod(total, len(layers))
        for k, i in enumerate(layers):
            out[i] = out.get(i, 0) + q + (1 if k < r else 0)
    return out


@dataclass
class CacheBytes:
    """Bytes of each cache buffer for one context (all sequences)."""

    engine: str
    cache_type: str
    context: int          # tokens asked for
    cells: int            # tokens actually allocated (padding)
    mla: int              # MLA latent (+ rope key)
    indexer: int          # per-token indexer keys (llama.cpp: key|gate|pooled; exllamav3: key|gate plane)
    kpool: int            # exllamav3's pooled-key plane (llama.cpp keeps it inside ``indexer``)
    recurrent: int        # KDA state matrices
    conv: int             # KDA conv state (+ exllamav3 staged scan inputs)

    @property
    def per_token(self) -> float:
        """Context-proportional bytes per token (MLA + indexer + k-pool)."""
        return (self.mla + self.indexer + self.kpool) / self.cells if self.cells else 0.0

    @property
    def fixed(self) -> int:
        """Context-independent bytes (the recurrent KDA state)."""
        return self.recurrent + self.conv

    @property
    def total(self) -> int:
        return self.mla + self.indexer + self.kpool + self.recurrent + self.conv

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(total=self.total, per_token=self.per_token, fixed=self.fixed)
        return d


def _row(cache_type: str, n: int) -> int:
    blk, size = LLAMA_CACHE_TYPES[cache_type]
    if n % blk:
        raise PlanError(f"cache type {cache_type}: row of {n} values is not a multiple of its block {blk}")
    return n // blk * size


def _pad(n: int, a: int) -> int:
    return -(-int(n) // a) * a


def llama_cpp_cache(geo: CacheGeometry, context: int, *, cache_type: str = "f16", cache_type_v: str | None = None,
                    flash_attn: bool | None = None, n_seq: int = 1, n_rs_seq: int = 0) -> CacheBytes:
    """llama.cpp's cache buffers for glm5-next at ``context`` tokens (``-c``), ``-ctk/-ctv``, ``-fa``.

    Accepts only what llama.cpp accepts: K and V types equal (MLA model, V:src/llama-context.cpp:3835), a
    quantized V cache only with flash attention (``flash_attn=None`` = auto, which turns it on; ``False`` with
    a quantized type is an error, :3840-3847). Flash attention does not change the bytes: the MLA and indexer
    caches have no V tensor."""
    kt = cache_type.lower()
    vt = (cache_type_v or cache_type).lower()
    for t in (kt, vt):
        if t not in LLAMA_CACHE_TYPES:
            raise PlanError(f"llama.cpp cache type {t!r} unknown: use one of {', '.join(LLAMA_CACHE_TYPES)}")
    if kt != vt:
        raise PlanError(f"llama.cpp: glm5-next (MLA) needs equal K and V cache types, got -ctk {kt} -ctv {vt}")
    if LLAMA_CACHE_TYPES[vt][0] > 1 and flash_attn is False:
        raise PlanError(f"llama.cpp: a quantized V cache ({vt}) requires flash attention (-fa on)")
    if context <= 0 or n_seq <= 0:
        raise PlanError(f"context {context} and sequences {n_seq} must be positive")
    ctx = _pad(context, LLAMA_PAD)
    per_seq = _pad(ctx // n_seq, LLAMA_PAD)        # n_ctx_seq, one stream per sequence
    cells = per_seq * n_seq
    key_len = geo.kv_lora_rank + geo.qk_rope_head_dim
    idx_len = geo.index_head_dim * (3 if geo.index_kpool > 0 else 1)
    rows = max(1, n_seq) * (1 + n_rs_seq)
    n_embd_r = 3 * (geo.conv_kernel - 1) * geo.kda_heads * geo.kda_head_dim
    n_embd_s = geo.kda_head_dim * geo.kda_head_dim * geo.kda_heads
    return CacheBytes(
        engine="llama.cpp", cache_type=kt, context=context, cells=cells,
        mla=geo.dsa_layers * cells * _row(kt, key_len),
        indexer=geo.indexer_layers * cells * _row(kt, idx_len),
        kpool=0,
        recurrent=geo.kda_layers * rows * n_embd_s * 4,
        conv=geo.kda_layers * rows * n_embd_r * 4,
    )


def exllamav3_cache(geo: CacheGeometry, context: int, *, cache: str = "fp16", batch: int = 1,
                    max_history: int = 0, recurrent_dtype: str = "fp16") -> CacheBytes:
    """exllamav3's cache for glm5_next: ``Cache(model, max_num_tokens=context, layer_type=CacheLayer_fp16 |
    CacheLayer_quant(k_bits), max_batch_size=batch, max_history, recurrent_dtype)``.

    The MLA layer maps any quantized request to ``CacheLayer_MLA_quant`` (latent packed at k_bits with one fp16
    scale per 32 values; the indexer planes stay fp16)."""
    c = cache.lower()
    if c not in EXL3_CACHE_BITS:
        raise PlanError(f"exllamav3 cache {cache!r} unknown: use one of {', '.join(EXL3_CACHE_BITS)}")
    if recurrent_dtype not in ("fp16", "fp32"):
        raise PlanError(f"exllamav3 recurrent state dtype {recurrent_dtype!r}: fp16 or fp32")
    if context <= 0 or batch <= 0 or max_history < 0:
        raise PlanError(f"context {context}, batch {batch}, max_history {max_history} out of range")
    bits = EXL3_CACHE_BITS[c]
    cells = _pad(context, EXL3_PAGE)
    if bits == 16:
        latent = geo.kv_lora_rank * 2
    else:
        if geo.kv_lora_rank % 32:
            raise PlanError(f"quantized MLA cache needs kv_lora_rank % 32 == 0, got {geo.kv_lora_rank}")
        groups = geo.kv_lora_rank // 32
        latent = groups * bits * 4 + groups * 2
    rope = geo.qk_rope_head_dim * 2
    idx_dim = geo.index_head_dim * (2 if geo.index_kpool else 1)
    pool = (cells // geo.index_kpool) * geo.index_head_dim * 2 if geo.index_kpool else 0
    H, d = geo.kda_heads, geo.kda_head_dim
    fdim_qkv = 3 * H * d
    state_item = 2 if recurrent_dtype == "fp16" else 4
    spec_rows = batch * (max_history + 1)
    conv = batch * fdim_qkv * (geo.conv_kernel + max_history) * 2
    spec = spec_rows * (fdim_qkv * 2 + H * 2 + H * d * 4)
    return CacheBytes(
        engine="exllamav3", cache_type=c, context=context, cells=cells,
        mla=geo.dsa_layers * cells * (latent + rope),
        indexer=geo.indexer_layers * cells * idx_dim * 2,
        kpool=geo.indexer_layers * pool,
        recurrent=geo.kda_layers * 2 * batch * H * d * d * state_item,
        conv=geo.kda_layers * (conv + spec),
    )


def cache_bytes(engine: str, geo: CacheGeometry, context: int, cache: str | None = None, **kw) -> CacheBytes:
    """Dispatch on the engine: "llama.cpp"/"gguf" or "exllamav3"/"exl3"."""
    e = engine.lower()
    if e in ("llama.cpp", "gguf", "llamacpp"):
        return llama_cpp_cache(geo, context, cache_type=cache or "f16", **kw)
    if e in ("exllamav3", "exl3"):
        return exllamav3_cache(geo, context, cache=cache or "fp16", **kw)
    raise PlanError(f"unknown engine {engine!r}: llama.cpp (gguf) or exllamav3 (exl3)")
