"""Read glm5-next GGUF files (single or split) back into HF-named float tensors, and verify them.

- `read_gguf(path)` -> `GGUFFile` (KVs + tensor entries over all shards, via gguf-py's GGUFReader).
- `read_gguf_weights(path)` -> {hf_name: float32 tensor}: dequantized with gguf-py and with every glm5-next
  transform undone (experts unstacked, k_b/v_b merged into kv_b, ssm_a -> A_log, conv reshaped back).
- `verify_gguf(path, model=None)` -> report dict: every tensor present, byte sizes right, data decodes finite.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mixq.errors import FormatError, InputError
from mixq.formats.gguf_names import GGUFTensorSpec, merge_kv_b, unbuild_tensor

HF_PREFIX = "model.language_model."
_SPLIT_RE = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")

# GGUF block suffix -> (HF suffix after `layers.{i}.`, transform). {a}/{b} are copied from the GGUF name.
_REVERSE: list[tuple[str, str, str]] = [
    (r"attn_norm\.weight", "input_layernorm.weight", "none"),
    (r"ffn_norm\.weight", "post_attention_layernorm.weight", "none"),
    (r"hc_(?P<a>attn|ffn)_(?P<b>fn|base|scale)\.weight", "hc_{a}_{b}", "none"),
    (r"attn_(?P<a>[qkv])\.weight", "self_attn.{a}_proj.weight", "none"),
    (r"ssm_conv1d_(?P<a>[qkv])\.weight", "self_attn.{a}_conv1d.weight", "conv"),
    (r"ssm_(?P<a>[fg])_(?P<b>[ab])\.weight", "self_attn.{a}_{b}_proj.weight", "none"),
    (r"ssm_beta\.weight", "self_attn.b_proj.weight", "none"),
    (r"ssm_a", "self_attn.A_log", "neg_exp"),
    (r"ssm_dt\.bias", "self_attn.dt_bias", "none"),
    (r"ssm_norm\.weight", "self_attn.o_norm.weight", "none"),
    (r"attn_output\.weight", "self_attn.o_proj.weight", "none"),
    (r"attn_q_a\.weight", "self_attn.q_a_proj.weight", "none"),
    (r"attn_q_a_norm\.weight", "self_attn.q_a_layernorm.weight", "none"),
    (r"attn_q_b\.weight", "self_attn.q_b_proj.weight", "none"),
    (r"attn_kv_a_mqa\.weight", "self_attn.kv_a_proj_with_mqa.weight", "none"),
    (r"attn_kv_a_norm\.weight", "self_attn.kv_a_layernorm.weight", "none"),
    (r"attn_k_b\.weight", "self_attn.kv_b_proj.weight", "kv_b_k"),
    (r"attn_v_b\.weight", "self_attn.kv_b_proj.weight", "kv_b_v"),
    (r"indexer\.attn_q_b\.weight", "self_attn.indexer.wq_b.weight", "none"),
    (r"indexer\.attn_k\.weight", "self_attn.indexer.wk.weight", "none"),
    (r"indexer\.k_norm\.(?P<a>weight|bias)", "self_attn.indexer.k_norm.{a}", "none"),
    (r"indexer\.proj\.weight", "self_attn.indexer.weights_proj.weight", "none"),
    (r"indexer_compressor_(?P<a>gate|ape)\.weight", "self_attn.indexer.index_kpool_compress_{a}", "none"),
    (r"ffn_(?P<a>gate|up|down)\.weight", "mlp.{a}_proj.weight", "none"),
    (r"ffn_gate_inp\.weight", "mlp.gate.weight", "none"),
    (r"exp_probs_b\.bias", "mlp.gate.e_score_correction_bias", "none"),
    (r"ffn_(?P<a>gate|up|down)_exps\.weight", "mlp.experts.{e}.{a}_proj.weight", "stack"),
    (r"ffn_(?P<a>gate|up|down)_shexp\.weight", "mlp.shared_experts.{a}_proj.weight", "none"),
    (r"nextn\.eh_proj\.weight", "eh_proj.weight", "none"),
    (r"nextn\.(?P<a>enorm|hnorm)\.weight", "{a}.weight", "none"),
    (r"nextn\.shared_head_norm\.weight", "shared_head.norm.weight", "none"),
    (r"nextn\.shared_head_head\.weight", "shared_head.head.weight", "none"),
    (r"nextn\.embed_tokens\.weight", "embed_tokens.weight", "none"),
]
_REVERSE_RES = [(re.compile(p + r"\Z"), h, t) for p, h, t in _REVERSE]
_GLOBAL_REV = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight"}


@dataclass
class GGUFTensorEntry:
    name: str
    qtype: str
    shape: tuple[int, ...]   # numpy order (outermost first)
    n_bytes: int
    shard: int
    _reader: Any = field(repr=False, default=None)
    _index: int = field(repr=False, default=0)

    def raw(self) -> np.ndarray:
        return self._reader.tensors[self._index].data

    def dequantize(self) -> np.ndarray:
        """float32 array of `shape` (gguf-py's dequantizers)."""
        import gguf

        t = self._reader.tensors[self._index]
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.asarray(arr, dtype=np.float32).reshape(self.shape)


@dataclass
class GGUFFile:
    paths: list[Path]
    kv: dict[str, Any]
    tensors: dict[str, GGUFTensorEntry]


def shard_paths(path: Path) -> list[Path]:
    """All shards of a split GGUF given its first shard (or any shard); [path] for a single file."""
    m = _SPLIT_RE.match(path.name)
    if not m:
        return [path]
    n = int(m.group(3))
    return [path.with_name(f"{m.group(1)}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def _open(p: Path):
    import gguf

    if not p.is_file():
        raise InputError(f"{p}: no such GGUF file")
    try:
        return gguf.GGUFReader(p, "r")
    except Exception as e:  # noqa: BLE001 - any parse failure means a malformed file
        raise FormatError(f"{p}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def read_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF (or every shard of a split GGUF) without loading tensor data (memory-mapped)."""
    path = Path(path)
    paths = shard_paths(path)
    kv: dict[str, Any] = {}
    tensors: dict[str, GGUFTensorEntry] = {}
    for si, p in enumerate(paths):
        r = _open(p)
        if si == 0:
            kv = {k: f.contents() for k, f in r.fields.items()}
        if len(paths) > 1:
            no = r.fields.get("split.no")
            if no is None or int(no.contents()) != si:
                raise FormatError(f"{p}: split.no is {None if no is None else no.contents()}, expected {si}")
        for i, t in enumerate(r.tensors):
            if t.name in tensors:
                raise FormatError(f"{p}: tensor {t.name} also in shard {tensors[t.name].shard}")
            shape = tuple(int(x) for x in reversed(list(t.shape)))
            tensors[t.name] = GGUFTensorEntry(t.name, t.tensor_type.name, shape, int(t.n_bytes), si, r, i)
    if len(paths) > 1:
        want = int(kv.get("split.tensors.count", -1))
        if want != len(tensors):
            raise FormatError(f"{paths[0]}: split.tensors.count {want} but the shards hold {len(tensors)} tensors")
    return GGUFFile(paths, kv, tensors)


def spec_from_gguf(name: str, shape: tuple[int, ...], prefix: str = HF_PREFIX) -> GGUFTensorSpec:
    """Invert the glm5-next mapping for one GGUF tensor: its HF name(s) and transform."""
    if name == "output.weight":
        return GGUFTensorSpec(name, ["lm_head.weight"], shape, "lm_head", None, False, "none")
    if name in _GLOBAL_REV:
        return GGUFTensorSpec(name, [prefix + _GLOBAL_REV[name]], shape, "", None, False, "none")
    m = re.match(r"blk\.(\d+)\.(.+)\Z", name)
    if m:
        layer, rest = int(m.group(1)), m.group(2)
        for rx, tmpl, tr in _REVERSE_RES:
            mm = rx.match(rest)
            if not mm:
                continue
            base = f"{prefix}layers.{layer}."
            g = mm.groupdict()
            if tr == "stack":
                hf = [base + tmpl.format(e=e, **g) for e in range(shape[0])]
            else:
                hf = [base + tmpl.format(**g)]
            extra = {}
            if tr == "kv_b_k":
                extra = {"heads": shape[0], "nope": shape[2]}
            elif tr == "kv_b_v":
                extra = {"heads": shape[0], "v": shape[1]}
            return GGUFTensorSpec(name, hf, shape, "", layer, False, tr, extra)
    raise FormatError(f"GGUF tensor {name!r} is not part of the glm5-next mapping")


def read_gguf_weights(path: str | Path, prefix: str = HF_PREFIX) -> dict[str, torch.Tensor]:
    """HF-named float32 weights of a glm5-next GGUF file (or split set): the dequantized candidate for eval."""
    g = read_gguf(path)
    parts: dict[str, torch.Tensor] = {}
    for name, e in g.tensors.items():
        spec = spec_from_gguf(name, e.shape, prefix)
        t = torch.from_numpy(np.array(e.dequantize()))
        parts.update(unbuild_tensor(spec, t))
    return merge_kv_b(parts)


def verify_gguf(path: str | Path, model: str | Path | None = None, decode: bool = True) -> dict:
    """Check a GGUF: arch, tensor count, each tensor's byte size, data decodes to finite values; with `model`
    (the source checkpoint) also that exactly the expected tensors with the expected shapes are present.
    Returns a report dict; problems are listed in report["problems"] (empty = OK)."""
    from mixq.formats.gguf_writer import ARCH
    from mixq.quant.gguf_mix import tensor_nbytes

    g = read_gguf(path)
    problems: list[str] = []
    arch = g.kv.get("general.architecture")
    if arch != ARCH:
        problems.append(f"general.architecture is {arch!r}, expected {ARCH!r}")
    n_bytes = 0
    for name, e in g.tensors.items():
        try:
            want = tensor_nbytes(e.qtype, e.shape)
        except Exception as ex:  # noqa: BLE001
            problems.append(f"{name}: {ex}")
            continue
        if want != e.n_bytes:
            problems.append(f"{name}: {e.n_bytes} bytes stored, {e.qtype} {e.shape} needs {want}")
        n_bytes += e.n_bytes
        if decode:
            try:
                spec_from_gguf(name, e.shape)
                if not np.isfinite(e.dequantize()).all():
                    problems.append(f"{name}: non-finite values after decoding {e.qtype}")
            except Exception as ex:  # noqa: BLE001 - report, keep checking the rest
                problems.append(f"{name}: does not decode ({ex})")
    if model is not None:
        from mixq.formats.checkpoint import open_checkpoint
        from mixq.formats.gguf_names import gguf_tensors

        ckpt = open_checkpoint(model)
        has_mtp = int(g.kv.get(f"{ARCH}.nextn_predict_layers", 0) or 0) > 0
        want_specs = {s.name: s for s in gguf_tensors(ckpt, include_mtp=has_mtp)}
        for n in sorted(set(want_specs) - set(g.tensors)):
            problems.append(f"{n}: missing")
        for n in sorted(set(g.tensors) - set(want_specs)):
            problems.append(f"{n}: not expected for this model")
        for n in sorted(set(want_specs) & set(g.tensors)):
            if tuple(want_specs[n].shape) != g.tensors[n].shape:
                problems.append(f"{n}: shape {g.tensors[n].shape}, expected {tuple(want_specs[n].shape)}")
    types: dict[str, int] = {}
    for e in g.tensors.values():
        types[e.qtype] = types.get(e.qtype, 0) + 1
    quantized = sum(n for t, n in types.items() if t not in ("F32", "F16", "BF16"))
    return {"path": str(g.paths[0]), "files": [str(p) for p in g.paths], "tensors": len(g.tensors),
            "quantized": quantized if decode else 0, "bytes": n_bytes, "types": types, "problems": problems, "ok": not problems}
