"""Write glm5-next GGUF files (one file or `NAME-0000k-of-0000N.gguf` shards) through gguf-py's GGUFWriter.

- `glm5next_kv(ckpt, ...)` : every KV key the upstream loader needs, with the exact GGUF value types
  (../shared/reference/gguf-glm5-next.md §1.2-1.3: scalars through typed adders, per-layer arrays with the
  right element type and length).
- `write_gguf(path, kv, tensors, produce, ...)` : streams tensor data (one tensor in memory at a time) into files
  under a temporary directory next to the output, then renames them into place.
"""
from __future__ import annotations

import glob
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import gguf
import numpy as np
from gguf import Keys
from gguf.gguf_writer import SHARD_NAME_FORMAT
from tqdm import tqdm

from mixq.errors import FormatError, InputError, escape
from mixq.formats.gguf_integrity import data_sha256, seal, sealed_writer
from mixq.formats.gguf_layout import ggml_type, tensor_bytes
from mixq.formats.io_counts import count_written
from mixq.formats.partials import make_partial_dir, publish

ARCH = "glm5-next"
LLM, Attn = Keys.LLM, Keys.Attention


@dataclass
class KV:
    key: str
    vtype: str          # gguf-py GGUFValueType name: UINT32, FLOAT32, BOOL, STRING, UINT16, INT32, ARRAY
    value: Any
    sub_type: str | None = None  # element type for arrays


@dataclass
class TensorOut:
    """One tensor to write: numpy element shape (outermost first) and ggml type name ("F32", "BF16", "Q4_K"...)."""

    name: str
    shape: tuple[int, ...]
    qtype: str

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.qtype, self.shape)


def _file_type(ftype: str | None) -> int | None:
    if ftype is None:
        return None
    name = {"F32": "ALL_F32"}.get(ftype.upper(), "MOSTLY_" + ftype.upper())
    try:
        return int(gguf.LlamaFileType[name])
    except KeyError:
        return None


def _get(tc: dict, *keys, default=None):
    """First present key; dotted keys look into nested dicts (e.g. linear_attn_config.head_dim)."""
    for k in keys:
        d: Any = tc
        for part in k.split("."):
            d = d.get(part) if isinstance(d, dict) else None
        if d is not None:
            return d
    if default is not None:
        return default
    raise InputError(f"config.json text_config lacks {keys[0]!r} (needed for the glm5-next GGUF)")


def glm5next_kv(ckpt, *, include_mtp: bool = True, file_type: str | None = None, name: str | None = None) -> list[KV]:
    """The `glm5-next.*` and `general.*` keys for `ckpt` (a Checkpoint, shapes-only is enough)."""
    tc = getattr(ckpt, "text_config", None) or ckpt.config.get("text_config", ckpt.config)
    n_trunk = int(ckpt.num_hidden_layers)
    n_nextn = len(getattr(ckpt, "nextn_layers", None) or []) if include_mtp else 0
    n_blocks = n_trunk + n_nextn
    layer_types = list(getattr(ckpt, "layer_types", None) or tc.get("layer_types") or [])
    if len(layer_types) < n_trunk:
        raise InputError(f"config layer_types has {len(layer_types)} entries for {n_trunk} layers")
    rope = int(tc.get("qk_rope_head_dim") or 0)
    if rope != 0:
        raise InputError(f"glm5-next GGUF needs qk_rope_head_dim == 0 (mla_use_nope), config has {rope}")
    kv_lora = int(_get(tc, "kv_lora_rank"))
    head_kv = [0 if t == "linear_attention" else 1 for t in layer_types[:n_trunk]] + [1] * n_nextn
    dense = tc.get("first_k_dense_replace")
    if dense is None:
        mlt = list(tc.get("mlp_layer_types") or [])
        dense = next((i for i, t in enumerate(mlt) if t != "dense"), len(mlt))
    idx_types = tc.get("indexer_types") or ["full"] * n_trunk
    swiglu = float(_get(tc, "swiglu_limit", default=0.0))
    u32 = _u32_keys(tc, n_blocks, n_nextn, kv_lora, rope, dense)
    f32 = _f32_keys(tc)
    out = [KV(k.format(arch=ARCH), "UINT32", int(v)) for k, v in u32]
    out += [KV(k.format(arch=ARCH), "FLOAT32", float(v)) for k, v in f32]
    out += [
        KV(_INDEXER_KPOOL_SELECT_TAIL.format(arch=ARCH), "BOOL", bool(tc.get("index_kpool_always_select_tail", True))),
        KV(LLM.EXPERT_WEIGHTS_NORM.format(arch=ARCH), "BOOL", bool(tc.get("norm_topk_prob", False))),
        KV(Attn.HEAD_COUNT_KV.format(arch=ARCH), "ARRAY", head_kv, "INT32"),
        # indexer.types has the TRUNK length, the other per-layer arrays block_count (§1.3)
        KV(_INDEXER_TYPES.format(arch=ARCH), "ARRAY", [t == "full" for t in idx_types[:n_trunk]], "BOOL"),
    ]
    if swiglu:
        out += [KV(LLM.SWIGLU_CLAMP_EXP.format(arch=ARCH), "ARRAY", [swiglu] * n_blocks, "FLOAT32"),
                KV(LLM.SWIGLU_CLAMP_SHEXP.format(arch=ARCH), "ARRAY", [swiglu] * n_blocks, "FLOAT32")]
    out.append(KV(Keys.General.QUANTIZATION_VERSION, "UINT32", 2))
    ft = _file_type(file_type)
    if ft is not None:
        out.append(KV(Keys.General.FILE_TYPE, "UINT32", ft))
    out += [KV(Keys.General.TYPE, "STRING", "model"),
            KV(Keys.General.NAME, "STRING", name or Path(str(ckpt.path)).name)]
    return out


# glm5-next keys gguf-py 0.19 does not name (gguf-glm5-next.md §1.2)
_INDEXER = "{arch}.attention.indexer."
_INDEXER_KPOOL_SELECT_TAIL = _INDEXER + "kpool_select_tail"
_INDEXER_TYPES = _INDEXER + "types"
_HC = "{arch}.hyper_connection."


def _u32_keys(tc: dict, n_blocks: int, n_nextn: int, kv_lora: int, rope: int, dense: int) -> list[tuple[str, Any]]:
    """(key template, value) of the UINT32 keys, in the order the file lists them."""
    u32 = [
        (LLM.BLOCK_COUNT, n_blocks), (LLM.CONTEXT_LENGTH, _get(tc, "max_position_embeddings")),
        (LLM.EMBEDDING_LENGTH, _get(tc, "hidden_size")), (LLM.FEED_FORWARD_LENGTH, _get(tc, "intermediate_size")),
        (Attn.HEAD_COUNT, _get(tc, "num_attention_heads")),
        (LLM.EXPERT_COUNT, _get(tc, "n_routed_experts")), (LLM.EXPERT_USED_COUNT, _get(tc, "num_experts_per_tok")),
        (LLM.EXPERT_GROUP_COUNT, _get(tc, "n_group", default=1)),
        (LLM.EXPERT_GROUP_USED_COUNT, _get(tc, "topk_group", default=1)),
        (LLM.VOCAB_SIZE, _get(tc, "vocab_size")),
        (Keys.SSM.CONV_KERNEL, _get(tc, "linear_attn_config.short_conv_kernel_size", "linear_conv_kernel_dim")),
        (Keys.KDA.HEAD_DIM, _get(tc, "linear_attn_config.head_dim", "linear_head_dim")),
        (Attn.Q_LORA_RANK, _get(tc, "q_lora_rank")), (Attn.KV_LORA_RANK, kv_lora),
        (Keys.Rope.DIMENSION_COUNT, rope),
        (Attn.KEY_LENGTH, kv_lora + rope), (Attn.VALUE_LENGTH, kv_lora),
        (Attn.KEY_LENGTH_MLA, int(_get(tc, "qk_nope_head_dim")) + rope),
        (Attn.VALUE_LENGTH_MLA, _get(tc, "v_head_dim")),
        (_INDEXER + "head_count", _get(tc, "index_n_heads")),
        (_INDEXER + "key_length", _get(tc, "index_head_dim")),
        (_INDEXER + "top_k", _get(tc, "index_topk")),
        (_INDEXER + "kpool", _get(tc, "index_kpool")),
        (_HC + "count", _get(tc, "hc_mult")),
        (_HC + "sinkhorn_iterations", _get(tc, "hc_sinkhorn_iters")),
        (LLM.LEADING_DENSE_BLOCK_COUNT, dense),
        (LLM.EXPERT_FEED_FORWARD_LENGTH, _get(tc, "moe_intermediate_size")),
        (LLM.EXPERT_SHARED_COUNT, _get(tc, "n_shared_experts")),
    ]
    if n_nextn:
        u32.append((LLM.NEXTN_PREDICT_LAYERS, n_nextn))
    return u32


def _f32_keys(tc: dict) -> list[tuple[str, Any]]:
    """(key template, value) of the FLOAT32 keys, in the order the file lists them."""
    f32 = [
        (Attn.LAYERNORM_RMS_EPS, _get(tc, "rms_norm_eps")),
        (Attn.LAYERNORM_EPS, 1e-6),  # indexer k_norm LayerNorm eps (fixed in the reference)
        ("{arch}.kda.gate_lower_bound", _get(tc, "linear_attn_config.gate_lower_bound", "linear_lower_bound")),
        (_HC + "epsilon", _get(tc, "hc_eps")),
        (LLM.EXPERT_WEIGHTS_SCALE, _get(tc, "routed_scaling_factor")),
    ]
    rope_theta = tc.get("rope_theta") or (tc.get("rope_parameters") or {}).get("rope_theta")
    if rope_theta:
        f32.append((Keys.Rope.FREQ_BASE, rope_theta))
    return f32


def add_kv(writer, kvs: Iterable[KV]) -> None:
    """Add KVs to a GGUFWriter with explicit types (never gguf-py's int->INT32 inference)."""
    for kv in kvs:
        vt = gguf.GGUFValueType[kv.vtype]
        st = gguf.GGUFValueType[kv.sub_type] if kv.sub_type else None
        if vt == gguf.GGUFValueType.ARRAY and len(kv.value) == 0:
            continue
        if vt == gguf.GGUFValueType.STRING and kv.value == "":
            continue
        writer.add_key_value(kv.key, kv.value, vt, sub_type=st)


def shard_names(path: Path, n: int) -> list[Path]:
    """llama.cpp's shard naming (gguf-py's SHARD_NAME_FORMAT): `<stem>-00001-of-0000N.gguf`; `path` when n == 1."""
    if n == 1:
        return [path]
    return [path.with_name(SHARD_NAME_FORMAT.format(path.stem, i + 1, n)) for i in range(n)]


def output_set(path: str | Path) -> list[Path]:
    """The existing files of the GGUF output `path`: the single file and/or a split set `<stem>-0000i-of-0000N`."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    pat = re.compile(re.escape(path.stem) + r"-\d{5}-of-\d{5}\.gguf")
    split = sorted(p for p in path.parent.glob(f"{glob.escape(path.stem)}-*-of-*.gguf") if pat.fullmatch(p.name))
    return ([path] if path.is_file() else []) + split


def _headed_writer(path: Path, kv: list[KV], tensors: list[TensorOut], tokenizer, shard_size: int,
                   shard_max_tensors: int, arch: str):
    """A sealed GGUFWriter for `path` with the header, metadata and tensor infos of every file written: what
    `write_gguf` writes before the tensor data, and what `gguf_file_nbytes` measures."""
    # every file gets mixq.integrity.* placeholders, filled by seal() once the data is written
    w = sealed_writer(path, arch, split_max_size=int(shard_size), split_max_tensors=int(shard_max_tensors))
    # GGUFWriter already wrote general.architecture in its constructor
    add_kv(w, [k for k in kv if k.key != Keys.General.ARCHITECTURE])
    if tokenizer is not None:
        tokenizer(w)
    for t in tensors:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=ggml_type(t.qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    return w


def gguf_file_nbytes(kv: list[KV], tensors: list[TensorOut], *, tokenizer: Callable[[Any], None] | None = None,
                     shard_size: int = 0, shard_max_tensors: int = 0, arch: str = ARCH) -> int:
    """The exact bytes on disk of the file(s) `write_gguf` would write with these arguments: each file's header
    (metadata, seal placeholders, tensor infos) is written to a scratch directory and measured, and the tensor
    data, each tensor padded to the alignment, is added. No tensor data is produced (a --size plan checks its
    real file size with it before encoding)."""
    with tempfile.TemporaryDirectory(prefix=".mixq-size-") as tmp:
        w = _headed_writer(Path(tmp) / "size.gguf", kv, tensors, tokenizer, shard_size, shard_max_tensors, arch)
        try:
            align = w.data_alignment
            per_file = [list(ts.values()) for ts in w.tensors]
            for f in w.fout:
                f.flush()
            heads = [f.tell() for f in w.fout]
        finally:
            w.close()
    pad = lambda n: (n + align - 1) // align * align  # noqa: E731
    return sum(pad(h) + sum(pad(ti.nbytes) for ti in tis) for h, tis in zip(heads, per_file))


def write_gguf(path: str | Path, kv: list[KV], tensors: list[TensorOut],
               produce: Callable[[TensorOut], np.ndarray], *, tokenizer: Callable[[Any], None] | None = None,
               shard_size: int = 0, shard_max_tensors: int = 0, progress: bool = True, arch: str = ARCH,
               overwrite: bool = False) -> list[Path]:
    """Write a GGUF (or shards) and return the final paths.

    `produce(t)` returns the tensor's data: float32/float16 arrays for F32/F16, otherwise the raw ggml bytes
    (uint8) of exactly `t.nbytes`. `tokenizer(writer)` adds tokenizer keys. Shards split on `shard_size`
    (bytes of tensor data) or `shard_max_tensors`; split.* keys go into every shard (gguf-facts §2), and the
    integrity keys of formats/gguf_integrity too. The files are written in a marked partial directory next to
    `path` and renamed at the end: without `overwrite` an existing file is never replaced (another run that
    published the same name meanwhile makes this one fail); with it, the earlier set of `path` is replaced whole
    (its shards that the new set does not reuse are removed).
    """
    path = Path(path)
    if path.suffix != ".gguf":
        raise InputError(f"{path}: GGUF output must end in .gguf")
    tmpdir = make_partial_dir(path)
    try:
        w = _headed_writer(tmpdir / path.name, kv, tensors, tokenizer, shard_size, shard_max_tensors, arch)
        n_files = len(w.tensors)
        digests: dict[str, str] = {}
        for t in tqdm(tensors, desc=f"write {escape(path.name)}", unit="tensor", disable=not progress, leave=False):
            arr = np.ascontiguousarray(produce(t))
            if arr.nbytes != t.nbytes:
                raise FormatError(f"{t.name}: produced {arr.nbytes} bytes, {t.qtype} {t.shape} needs {t.nbytes}")
            digests[t.name] = data_sha256(arr)
            w.write_tensor_data(arr)
            count_written(arr.nbytes)
        w.close()
        tmp_files = shard_names(tmpdir / path.name, n_files)
        seal(tmp_files, digests)
        finals = shard_names(path, n_files)
        stale = [p for p in output_set(path) if p not in finals] if overwrite else []
        publish(list(zip(tmp_files, finals)), overwrite=overwrite)
        count_written(sum(p.stat().st_size for p in finals) - sum(t.nbytes for t in tensors))  # headers, padding
        for p in stale:  # the replaced set's other files would still load (and verify) beside the new one
            p.unlink(missing_ok=True)
        return finals
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
