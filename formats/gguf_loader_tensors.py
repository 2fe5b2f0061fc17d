"""What llama.cpp's `glm5-next` loader reads from a GGUF: every tensor per block kind, with its ne from the KVs.

A file that lacks one of these tensors, stores one with another shape, or holds a tensor the loader does not read
is refused by llama.cpp ("tensor ... not found", "has wrong shape", "wrong number of tensors"). `loader_problems`
checks a file's tensors against this table using only the file's own metadata (block count, head_count_kv,
leading dense blocks, NextN count, indexer types and the widths), so a file that is not sealed by mixq is still
checked against its architecture.

Facts: ../shared/reference/gguf-glm5-next.md §1.2 (keys), §2.2 (loader ne per tensor), §2.4 (which block carries
what: KDA iff head_count_kv[i] == 0; dense FFN iff i < leading_dense_block_count; mHC in trunk blocks only; the
NextN block's own tensors; indexer tensors optional in "shared" indexer layers; trailing 1s of a shape tolerated).
The tensor names are those of the architecture table (formats/glm5next, `gguf_names` of its rules); ne is ggml's
order (ne[0] innermost), the reverse of the numpy shape.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from gguf import Keys

from mixq.errors import FormatError
from mixq.formats.gguf_writer import ARCH

ARCH_KEY = Keys.General.ARCHITECTURE
TOKENS_KEY = Keys.Tokenizer.LIST
LLM, Attn = Keys.LLM, Keys.Attention
_INDEXER = "{arch}.attention.indexer."
_HC = "{arch}.hyper_connection."

# symbol -> the KV (templates of gguf-py's Keys, arch filled in) it comes from; every one is a whole number
_DIM_KEYS: dict[str, str] = {
    "D": LLM.EMBEDDING_LENGTH, "ff": LLM.FEED_FORWARD_LENGTH, "H": Attn.HEAD_COUNT, "E": LLM.EXPERT_COUNT,
    "c": Keys.SSM.CONV_KERNEL, "d": Keys.KDA.HEAD_DIM, "r_q": Attn.Q_LORA_RANK, "r_kv": Attn.KV_LORA_RANK,
    "rope": Keys.Rope.DIMENSION_COUNT, "k_mla": Attn.KEY_LENGTH_MLA, "v": Attn.VALUE_LENGTH_MLA,
    "Hi": _INDEXER + "head_count", "di": _INDEXER + "key_length", "P": _INDEXER + "kpool",
    "hc": _HC + "count", "ns": LLM.EXPERT_SHARED_COUNT,
}
_BLOCK_COUNT = LLM.BLOCK_COUNT
_HEAD_KV = Attn.HEAD_COUNT_KV
_DENSE = LLM.LEADING_DENSE_BLOCK_COUNT
_NEXTN = LLM.NEXTN_PREDICT_LAYERS
_EXPERT_FF = LLM.EXPERT_FEED_FORWARD_LENGTH
_INDEXER_TYPES = _INDEXER + "types"


@dataclass(frozen=True)
class Dims:
    """The widths of one block, read from the file's KVs (symbols of gguf-glm5-next.md §2.2)."""

    D: int
    vocab: int
    ff: int
    H: int
    E: int
    c: int
    d: int
    r_q: int
    r_kv: int
    rope: int
    k_mla: int
    v: int
    Hi: int
    di: int
    P: int
    hc: int
    ns: int
    F: int  # this block's expert width (expert_feed_forward_length may be per block)

    @property
    def Dk(self) -> int:
        return self.d * self.H

    @property
    def nope(self) -> int:
        return self.k_mla - self.rope


@dataclass(frozen=True)
class Row:
    """One tensor the loader reads: name template ({i} = block), the blocks that carry it, its ne, and whether the
    loader accepts the file without it."""

    name: str
    where: str   # "global" | "block" | "trunk" | "kda" | "dsa" | "indexer" | "dense" | "moe" | "nextn"
    ne: Callable[[Dims], tuple[int, ...]]
    optional: bool = False


_NORM = (lambda g: (g.D,))
ROWS: tuple[Row, ...] = (
    Row("token_embd.weight", "global", lambda g: (g.D, g.vocab)),
    Row("output_norm.weight", "global", _NORM),
    Row("output.weight", "global", lambda g: (g.D, g.vocab)),  # no fallback to token_embd in this loader
    Row("blk.{i}.attn_norm.weight", "block", _NORM),
    Row("blk.{i}.ffn_norm.weight", "block", _NORM),
    *(Row(f"blk.{{i}}.hc_{a}_fn.weight", "trunk", lambda g: (g.hc * g.D, (2 + g.hc) * g.hc)) for a in ("attn", "ffn")),
    *(Row(f"blk.{{i}}.hc_{a}_base.weight", "trunk", lambda g: ((2 + g.hc) * g.hc,)) for a in ("attn", "ffn")),
    *(Row(f"blk.{{i}}.hc_{a}_scale.weight", "trunk", lambda g: (3,)) for a in ("attn", "ffn")),
    # KDA (linear attention) blocks
    *(Row(f"blk.{{i}}.attn_{p}.weight", "kda", lambda g: (g.D, g.Dk)) for p in "qkv"),
    *(Row(f"blk.{{i}}.ssm_conv1d_{p}.weight", "kda", lambda g: (g.c, 1, g.Dk, 1)) for p in "qkv"),
    *(Row(f"blk.{{i}}.ssm_{p}_a.weight", "kda", lambda g: (g.D, g.d)) for p in "fg"),
    *(Row(f"blk.{{i}}.ssm_{p}_b.weight", "kda", lambda g: (g.d, g.Dk)) for p in "fg"),
    Row("blk.{i}.ssm_beta.weight", "kda", lambda g: (g.D, g.H)),
    Row("blk.{i}.ssm_a", "kda", lambda g: (g.H,)),
    Row("blk.{i}.ssm_dt.bias", "kda", lambda g: (g.Dk,)),
    Row("blk.{i}.ssm_norm.weight", "kda", lambda g: (g.d,)),
    Row("blk.{i}.attn_output.weight", "kda", lambda g: (g.Dk, g.D)),
    # DSA / MLA blocks (the NextN block too)
    Row("blk.{i}.attn_q_a.weight", "dsa", lambda g: (g.D, g.r_q)),
    Row("blk.{i}.attn_q_a_norm.weight", "dsa", lambda g: (g.r_q,)),
    Row("blk.{i}.attn_q_b.weight", "dsa", lambda g: (g.r_q, g.H * g.k_mla)),
    Row("blk.{i}.attn_kv_a_mqa.weight", "dsa", lambda g: (g.D, g.r_kv + g.rope)),
    Row("blk.{i}.attn_kv_a_norm.weight", "dsa", lambda g: (g.r_kv,)),
    Row("blk.{i}.attn_k_b.weight", "dsa", lambda g: (g.nope, g.r_kv, g.H)),
    Row("blk.{i}.attn_v_b.weight", "dsa", lambda g: (g.r_kv, g.v, g.H)),
    Row("blk.{i}.attn_output.weight", "dsa", lambda g: (g.H * g.v, g.D)),
    # the indexer of a DSA block: required where the block's indexer type is "full"
    Row("blk.{i}.indexer.attn_q_b.weight", "indexer", lambda g: (g.r_q, g.Hi * g.di)),
    Row("blk.{i}.indexer.attn_k.weight", "indexer", lambda g: (g.D, g.di)),
    Row("blk.{i}.indexer.k_norm.weight", "indexer", lambda g: (g.di,)),
    Row("blk.{i}.indexer.k_norm.bias", "indexer", lambda g: (g.di,)),
    Row("blk.{i}.indexer.proj.weight", "indexer", lambda g: (g.D, g.Hi)),
    Row("blk.{i}.indexer_compressor_gate.weight", "indexer", lambda g: (g.D, g.di)),
    Row("blk.{i}.indexer_compressor_ape.weight", "indexer", lambda g: (g.di, g.P)),
    # FFN: dense below leading_dense_block_count, MoE with shared experts above (NextN included)
    *(Row(f"blk.{{i}}.ffn_{p}.weight", "dense", lambda g: (g.D, g.ff)) for p in ("gate", "up")),
    Row("blk.{i}.ffn_down.weight", "dense", lambda g: (g.ff, g.D)),
    Row("blk.{i}.ffn_gate_inp.weight", "moe", lambda g: (g.D, g.E)),
    Row("blk.{i}.exp_probs_b.bias", "moe", lambda g: (g.E,)),
    *(Row(f"blk.{{i}}.ffn_{p}_exps.weight", "moe", lambda g: (g.D, g.F, g.E)) for p in ("gate", "up")),
    Row("blk.{i}.ffn_down_exps.weight", "moe", lambda g: (g.F, g.D, g.E)),
    *(Row(f"blk.{{i}}.ffn_{p}_shexp.weight", "moe", lambda g: (g.D, g.F * g.ns)) for p in ("gate", "up")),
    Row("blk.{i}.ffn_down_shexp.weight", "moe", lambda g: (g.F * g.ns, g.D)),
    # the NextN block's own tensors (loaded though never run)
    Row("blk.{i}.nextn.eh_proj.weight", "nextn", lambda g: (2 * g.D, g.D)),
    *(Row(f"blk.{{i}}.nextn.{n}.weight", "nextn", _NORM) for n in ("enorm", "hnorm")),
    Row("blk.{i}.nextn.shared_head_norm.weight", "nextn", _NORM, optional=True),
    Row("blk.{i}.nextn.embed_tokens.weight", "nextn", lambda g: (g.D, g.vocab), optional=True),
    Row("blk.{i}.nextn.shared_head_head.weight", "nextn", lambda g: (g.D, g.vocab), optional=True),
)


@dataclass(frozen=True)
class BlockKind:
    """What one block is, by the file's metadata."""

    kda: bool        # head_count_kv[i] == 0
    dense: bool      # i < leading_dense_block_count
    nextn: bool      # i >= block_count - nextn_predict_layers
    indexer: bool    # the block's indexer type is "full" (its indexer tensors are required)

    def carries(self, where: str) -> bool:
        return {"block": True, "trunk": not self.nextn, "kda": self.kda, "dsa": not self.kda,
                "indexer": not self.kda, "dense": self.dense, "moe": not self.dense, "nextn": self.nextn}[where]

    def describe(self) -> str:
        return ("NextN" if self.nextn else "KDA" if self.kda else "DSA") + (", dense FFN" if self.dense else ", MoE")


def _key(template: str) -> str:
    return template.format(arch=ARCH)


def _whole(kv: dict[str, Any], template: str, default: int | None = None) -> int:
    key = _key(template)
    v = kv.get(key, default)
    if v is None:
        raise FormatError(f"{key}: missing (the glm5-next loader needs it)")
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise FormatError(f"{key}: {v!r} is not a whole number")
    return v


def _per_block(kv: dict[str, Any], template: str, n: int, default: Any = None) -> list:
    """A per-block key ("key or array" in the loader): a scalar for every block, or an array of exactly n."""
    key = _key(template)
    v = kv.get(key, default)
    if v is None:
        raise FormatError(f"{key}: missing (the glm5-next loader needs it)")
    if isinstance(v, (list, tuple)):
        if len(v) != n:
            raise FormatError(f"{key}: {len(v)} entries, the loader expects {n} (one per block)")
        return list(v)
    return [v] * n


def block_kinds(kv: dict[str, Any]) -> list[BlockKind]:
    """Every block's kind from the file's block_count, head_count_kv, leading_dense_block_count,
    nextn_predict_layers and indexer.types (raises FormatError naming a key that is missing or malformed)."""
    n = _whole(kv, _BLOCK_COUNT)
    nextn = _whole(kv, _NEXTN, 0)
    if nextn > n:
        raise FormatError(f"{_key(_NEXTN)}: {nextn} NextN blocks, more than {_key(_BLOCK_COUNT)} {n}")
    trunk = n - nextn
    head_kv = _per_block(kv, _HEAD_KV, n)
    dense = _whole(kv, _DENSE, 0)
    idx = kv.get(_key(_INDEXER_TYPES))
    if idx is None:
        idx = [True] * trunk  # absent: every indexer is full
    elif not isinstance(idx, (list, tuple)) or len(idx) != trunk:
        raise FormatError(f"{_key(_INDEXER_TYPES)}: the loader expects {trunk} entries (one per trunk block)")
    return [BlockKind(kda=not bool(head_kv[i]), dense=i < dense, nextn=i >= trunk,
                      indexer=bool(idx[i]) if i < trunk else True) for i in range(n)]


def _dims(kv: dict[str, Any], n_blocks: int) -> list[Dims]:
    """Each block's widths; keys a block kind does not use may be absent (0 then: nothing asks for them)."""
    common = {s: _whole(kv, t, 0) for s, t in _DIM_KEYS.items()}
    common["D"] = _whole(kv, _DIM_KEYS["D"])
    tokens = kv.get(TOKENS_KEY)
    if not isinstance(tokens, (list, tuple)):
        raise FormatError(f"{TOKENS_KEY}: missing (the loader takes the vocabulary size from it)")
    ff = _per_block(kv, _EXPERT_FF, n_blocks, 0)
    if any(isinstance(f, bool) or not isinstance(f, int) for f in ff):
        raise FormatError(f"{_key(_EXPERT_FF)}: not whole numbers")
    return [Dims(vocab=len(tokens), F=int(f), **common) for f in ff]


def _needed_keys(kinds: list[BlockKind]) -> list[str]:
    """The width keys the blocks present need (a missing one is named; the widths it sets are not checked)."""
    need = ["D", "hc"] if any(not k.nextn for k in kinds) else ["D"]
    if any(k.kda for k in kinds):
        need += ["H", "c", "d"]
    if any(not k.kda for k in kinds):
        need += ["H", "r_q", "r_kv", "rope", "k_mla", "v", "Hi", "di", "P"]
    if any(k.dense for k in kinds):
        need += ["ff"]
    if any(not k.dense for k in kinds):
        need += ["E", "ns"]
    return [s for i, s in enumerate(need) if s not in need[:i]]


def required_tensors(kv: dict[str, Any], kinds: list[BlockKind]) -> dict[str, tuple[tuple[int, ...], bool]]:
    """{tensor name: (ne, optional)} of every tensor the glm5-next loader reads for this metadata and these
    `block_kinds(kv)`. Raises FormatError when the metadata itself cannot say (see `loader_problems`)."""
    dims = _dims(kv, len(kinds))
    for s in _needed_keys(kinds):
        if _key(_DIM_KEYS[s]) not in kv:
            raise FormatError(f"{_key(_DIM_KEYS[s])}: missing (the glm5-next loader needs it)")
    out: dict[str, tuple[tuple[int, ...], bool]] = {}
    for row in ROWS:
        if row.where == "global":
            out[row.name] = (row.ne(dims[0]), row.optional)
            continue
        for i, k in enumerate(kinds):
            if k.carries(row.where):
                optional = row.optional or (row.where == "indexer" and not k.indexer)
                out[row.name.format(i=i)] = (row.ne(dims[i]), optional)
    return out


def _trim(ne: tuple[int, ...]) -> tuple[int, ...]:
    """A shape with trailing 1s dropped (the loader compares shapes that way)."""
    ne = tuple(ne)
    while len(ne) > 1 and ne[-1] == 1:
        ne = ne[:-1]
    return ne


def loader_problems(kv: dict[str, Any], tensors: dict[str, tuple[int, ...]]) -> list[str]:
    """What the glm5-next loader would refuse in a file with metadata `kv` and tensors {name: ne (ggml order)}:
    each missing tensor, each tensor of another shape, each tensor it does not read, or the metadata key that
    makes the file unloadable. Empty when the file's tensors are exactly what its metadata asks for."""
    if kv.get(ARCH_KEY) != ARCH:
        return []  # another architecture: its loader is not described here
    n = kv.get(_key(_BLOCK_COUNT))
    if isinstance(n, int) and n > len(tensors):  # every block has tens of tensors: bound the walk below
        return [f"{_key(_BLOCK_COUNT)}: {n} blocks, but the file holds {len(tensors)} tensors in all"]
    try:
        kinds = block_kinds(kv)
        want = required_tensors(kv, kinds)
    except FormatError as e:  # the metadata cannot say what the loader reads: that key is the problem
        return [str(e)]
    problems = []
    for name, (ne, optional) in want.items():
        if name not in tensors:
            if not optional:
                b = _block_of(name)
                where = "" if b is None else f" in block {b} ({kinds[b].describe()})"
                problems.append(f"{name}: missing; llama.cpp's glm5-next loader requires it{where} for this file's "
                                f"{_key(_BLOCK_COUNT)} {len(kinds)}, so it will not load the file")
            continue
        if _trim(tensors[name]) != _trim(ne):
            problems.append(f"{name}: ne {list(tensors[name])}, the glm5-next loader expects {list(ne)} "
                            "from this file's metadata")
    for name in tensors:
        if name not in want:
            problems.append(f"{name}: not read by the glm5-next loader for this file's {len(kinds)} blocks "
                            "(llama.cpp refuses a file with tensors it does not read)")
    return problems


def _block_of(name: str) -> int | None:
    if not name.startswith("blk."):
        return None
    return int(name.split(".")[1])
