"""Lazy glm5_next checkpoint loader: local directory or Hugging Face repo id, one tensor at a time.

Safetensors headers are read and validated through the safetensors library when the checkpoint is opened (so a
truncated or lying file is reported before any conversion starts); a tensor is read on demand, alone.
FP8 e4m3 weights with a sibling ``<name>_scale_inv`` (128x128 blocks) are dequantized on read; the scale
tensors are never listed as tensors of their own.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from mixq.errors import FormatError, InputError
from mixq.formats.config_limits import check_config_limits
from mixq.formats.finite import check_finite
from mixq.formats.io_counts import count_read
from mixq.formats.glm5next import (TEXT_PREFIX, TensorInfo, classify, in_nextn_block, is_vision,
                                   normalise_layer_type, nextn_only_shapes)
from mixq.formats.model_files import check_model_dir, model_file, read_json
from mixq.formats.safetensors_io import ST_DTYPES, dtype_name, open_safetensors, tensor_entries

_FP8 = ("F8_E4M3", "F8_E5M2")
_SCALE_SUFFIX = "_scale_inv"
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.jinja"]


@dataclass(frozen=True)
class _Entry:
    file: Path | None      # None: shapes-only checkpoint
    dtype: str             # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]


def read_safetensors_header(path: Path) -> dict[str, _Entry]:
    """The tensors of one safetensors file, in data order, through the safetensors library (which validates the
    header against the file); FormatError naming the file/tensor on any inconsistency."""
    return {name: _Entry(path, tag, shape) for name, tag, shape in tensor_entries(path)}


def _load_json(path: Path, what: str) -> dict:
    d = read_json(path, what)
    if not isinstance(d, dict):
        raise InputError(f"{path}: {what} is not a JSON object")
    return d


def _text_config(config: dict, path: Path) -> dict:
    """The text config (nested ``text_config`` or the flat dict); InputError when it is not glm5_next."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    types = {config.get("model_type"), text.get("model_type")}
    archs = " ".join(config.get("architectures") or [])
    if not (types & {"glm5_next", "glm5_next_text"} or "Glm5Next" in archs):
        mt = config.get("model_type") or text.get("model_type") or "missing"
        raise InputError(f"{path}: model_type {mt!r} is not glm5_next (mixq only handles Glm5Next checkpoints)")
    if not isinstance(text.get("num_hidden_layers"), int) or text["num_hidden_layers"] < 1:
        raise InputError(f"{path}: text config has no valid num_hidden_layers")
    check_config_limits(config, text, path)  # before anything is built or listed from these sizes
    return text


def _fp8_block_size(config: dict, text: dict, path: Path) -> tuple[int, int]:
    """quantization_config.weight_block_size (two positive ints; GLM's FP8 release uses [128, 128])."""
    qc = config.get("quantization_config") or text.get("quantization_config") or {}
    if not isinstance(qc, dict):
        raise InputError(f"{path}: quantization_config is not a JSON object")
    block = qc.get("weight_block_size") or (128, 128)
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise InputError(f"{path}: quantization_config.weight_block_size {block!r} is not two positive integers")
    return int(block[0]), int(block[1])


def _layer_types(text: dict, path: Path) -> list[str]:
    n = text["num_hidden_layers"]
    lt = text.get("layer_types")
    if lt is None:  # transformers' default pattern: every 4th layer (i % 4 == 3) is DSA
        return ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    if not isinstance(lt, list) or len(lt) != n:
        raise InputError(f"{path}: layer_types has {len(lt) if isinstance(lt, list) else '?'} entries, "
                         f"num_hidden_layers is {n}")
    try:
        return [normalise_layer_type(t) for t in lt]
    except InputError as e:
        raise InputError(f"{path}: {e}") from None


class Checkpoint:
    """A glm5_next checkpoint: config plus a lazy name -> tensor view (see docs/INTERNALS.md)."""

    def __init__(self, path: Path, config: dict, entries: dict[str, _Entry], scales: dict[str, _Entry],
                 config_path: Path | None = None):
        cfg_path = config_path or path / "config.json"
        self.path = path
        self.config = config
        self.text_config = _text_config(config, cfg_path)
        self.num_hidden_layers: int = self.text_config["num_hidden_layers"]
        self.layer_types = _layer_types(self.text_config, cfg_path)
        k = self.text_config.get("num_nextn_predict_layers", config.get("num_nextn_predict_layers", 0)) or 0
        self.nextn_layers = list(range(self.num_hidden_layers, self.num_hidden_layers + int(k)))
        self._entries = entries
        self._scales = scales
        self._infos: dict[str, TensorInfo] = {}
        self.block_size = _fp8_block_size(config, self.text_config, cfg_path)
        for name, e in entries.items():
            self.info(name)  # classify everything now: an unknown name fails at open, not mid-conversion
            if e.dtype in _FP8 and e.file is not None and name + _SCALE_SUFFIX not in scales:
                raise FormatError(f"{e.file}: FP8 tensor {name!r} has no {name + _SCALE_SUFFIX} block scale")

    # --- listing ----------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Every tensor, FP8 ``*_scale_inv`` excluded, in file order."""
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise InputError(f"{self.path}: no tensor {name!r} in this checkpoint") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def source_dtype(self, name: str) -> str:
        """Storage dtype as torch spells it: "bfloat16", "float8_e4m3fn", ..."""
        return dtype_name(ST_DTYPES[self._entry(name).dtype])

    def is_fp8(self, name: str) -> bool:
        return self._entry(name).dtype in _FP8

    def file_of(self, name: str) -> Path | None:
        return self._entry(name).file

    def info(self, name: str) -> TensorInfo:
        if name not in self._infos:
            self._entry(name)
            self._infos[name] = classify(name, self.num_hidden_layers)
        return self._infos[name]

    def vision_names(self) -> list[str]:
        """The vision tower's tensors, in file order (none: a text-only checkpoint)."""
        return [n for n in self._entries if self.info(n).role == "vision"]

    def infos(self) -> list[TensorInfo]:
        return [self.info(n) for n in self._entries]

    def nbytes(self, name: str) -> int:
        """Bytes the tensor occupies in the source files (its FP8 ``_scale_inv`` included)."""
        e = self._entry(name)
        sc = self._scales.get(name + _SCALE_SUFFIX)
        own = math.prod(e.shape) * ST_DTYPES[e.dtype].itemsize
        return own + (math.prod(sc.shape) * ST_DTYPES[sc.dtype].itemsize if sc else 0)

    def numel(self, name: str) -> int:
        return math.prod(self.shape(name))

    @property
    def params(self) -> int:
        """Parameters of every tensor (NextN and vision included, FP8 scales excluded)."""
        return sum(math.prod(e.shape) for e in self._entries.values())

    @property
    def shapes_only(self) -> bool:
        return any(e.file is None for e in self._entries.values())

    # --- reading ----------------------------------------------------------------------------------------
    def _read(self, name: str, e: _Entry) -> torch.Tensor:
        if e.file is None:
            raise InputError(f"{self.path}: shapes-only checkpoint (from a config): tensor data of {name!r} "
                             "is not available")
        with open_safetensors(e.file) as h:
            try:
                t = h.get_tensor(name)
                count_read(t.numel() * t.element_size())
                return t
            except Exception as err:  # noqa: BLE001 - the library's errors for a file changed since it was opened
                raise FormatError(f"{e.file}: tensor {name!r} cannot be read ({err})") from None

    def get(self, name: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """One tensor as ``dtype``; FP8 weights are dequantized with their 128x128 ``_scale_inv`` blocks.
        ``dtype=None``: as stored, FP8 dequantized to float32 (half the bytes of float32 for BF16 weights, to widen
        where they are used: the same values)."""
        e = self._entry(name)
        t = self._read(name, e)
        if e.dtype in _FP8:
            se = self._scales[name + _SCALE_SUFFIX]
            s = self._read(name + _SCALE_SUFFIX, se).float()
            check_finite(s, name + _SCALE_SUFFIX, se.file)
            t = dequant_fp8_blocks(t, s, self.block_size, name=f"{e.file}: {name!r}")
        check_finite(t, name, e.file)  # every read is checked: a NaN/Inf never reaches an output
        return t if dtype is None else t.to(dtype)


def dequant_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, ...] = (128, 128),
                       name: str = "tensor") -> torch.Tensor:
    """W = fp8 * scale_inv, one scale per (block[0] x block[1]) tile of the last two dims (float32 result)."""
    if w.dim() < 2:
        return w.float() * scale_inv.float().reshape(-1)[0]
    r, c = w.shape[-2:]
    br, bc = int(block[0]), int(block[1])
    want = (*w.shape[:-2], -(-r // br), -(-c // bc))
    if tuple(scale_inv.shape) != want:
        raise FormatError(f"{name}: scale_inv shape {tuple(scale_inv.shape)} does not match "
                          f"{tuple(w.shape)} in {br}x{bc} blocks (want {want})")
    if r % br == 0 and c % bc == 0:  # common case: broadcast the scales over whole tiles, no expanded copy
        tiles = w.float().reshape(*w.shape[:-2], r // br, br, c // bc, bc)
        return (tiles * scale_inv.float()[..., :, None, :, None]).reshape(w.shape)
    s = scale_inv.float().repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)[..., :r, :c]
    return w.float() * s


def _split_scales(entries: dict[str, _Entry]) -> tuple[dict[str, _Entry], dict[str, _Entry]]:
    """Separate ``<fp8 name>_scale_inv`` tensors from the tensors proper."""
    tensors, scales = {}, {}
    for name, e in entries.items():
        base = name[: -len(_SCALE_SUFFIX)] if name.endswith(_SCALE_SUFFIX) else None
        if base is not None and base in entries and entries[base].dtype in _FP8:
            scales[name] = e
        else:
            tensors[name] = e
    return tensors, scales


def _scan_dir(path: Path) -> dict[str, _Entry]:
    index = path / "model.safetensors.index.json"
    entries: dict[str, _Entry] = {}
    if index.exists():
        wm = _load_json(index, "safetensors index").get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise InputError(f"{index}: no weight_map")
        for name, f in wm.items():  # every shard it names must be a file name inside the model directory
            model_file(path, f, f"{index}: weight_map[{name!r}]")
        files = list(dict.fromkeys(wm.values()))  # first-appearance order
        headers: dict[str, dict[str, _Entry]] = {}
        for f in files:
            fp = path / f
            if not fp.is_file():
                raise InputError(f"{fp}: shard named in {index.name} is missing")
            headers[f] = read_safetensors_header(fp)
        where: dict[str, str] = {}
        for f in files:
            for name, e in headers[f].items():
                if name in where:  # which copy is the tensor? the index cannot say for the file's other readers
                    raise FormatError(f"{path / f}: tensor {name!r} is stored in two shards (also in "
                                      f"{where[name]})")
                where[name] = f
                if wm.get(name) == f:
                    entries[name] = e
        for name, f in wm.items():
            if name not in headers[f]:
                raise FormatError(f"{path / f}: tensor {name!r} named in {index.name} is not in this shard")
        return entries
    files = [path / "model.safetensors"] if (path / "model.safetensors").is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise InputError(f"{path}: no model.safetensors, model.safetensors.index.json or *.safetensors files")
    for fp in files:
        for name, e in read_safetensors_header(fp).items():
            if name in entries:
                raise FormatError(f"{fp}: tensor {name!r} also in {entries[name].file}")
            entries[name] = e
    return entries


def _looks_like_repo_id(s: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+", s)) and not s.startswith((".", "/", "~"))


def resolve_model_path(path_or_repo: str | os.PathLike) -> Path:
    """A local model directory, or a hub repo id downloaded (config, tokenizer, safetensors only)."""
    p = Path(path_or_repo).expanduser()
    if p.exists():
        if not p.is_dir():
            raise InputError(f"{p}: not a model directory (expected a directory with config.json and safetensors)")
        if not os.access(p, os.R_OK | os.X_OK):
            raise InputError(f"{p}: directory is not readable")
        return check_model_dir(p)
    s = str(path_or_repo)
    if not _looks_like_repo_id(s):
        raise InputError(f"{p}: no such model directory")
    try:
        from huggingface_hub import snapshot_download  # local: its download stack (httpx), hub ids only

        snapshot = Path(snapshot_download(repo_id=s, allow_patterns=_HUB_PATTERNS))
    except Exception as e:  # noqa: BLE001 - network/auth/offline errors all mean "cannot get this model"
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"{s}: not a local directory and could not be downloaded from the Hugging Face hub "
                         f"(offline or unknown repo?): {type(e).__name__}: {msg[:200]}") from None
    return check_model_dir(snapshot)


def open_checkpoint(path_or_repo: str | os.PathLike) -> Checkpoint:
    """Open a glm5_next checkpoint lazily (headers and config only; no tensor data is read)."""
    path = resolve_model_path(path_or_repo)
    config = _load_json(path / "config.json", "config.json")
    _text_config(config, path / "config.json")  # reject non-glm5next before touching the shards
    tensors, scales = _split_scales(_scan_dir(path))
    return Checkpoint(path, config, tensors, scales)


# --- shapes-only checkpoints (plan a 320B model from its config.json) -------------------------------------
def load_tokenizer(model_dir: str | os.PathLike):
    """The checkpoint's own tokenizer (tokenizer.json in the model directory), via transformers."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        raise InputError(f"{model_dir}: no tokenizer.json in the model directory")
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a broken tokenizer
        raise InputError(f"{model_dir}: cannot load the tokenizer ({type(e).__name__}: {e})") from None


def _meta_state_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint-named tensor shapes of Glm5NextForConditionalGeneration built on the meta device."""
    return dict(_meta_state_shapes_of(json.dumps(config, sort_keys=True)))


@functools.lru_cache(maxsize=8)
def _meta_state_shapes_of(config_json: str) -> dict[str, tuple[int, ...]]:
    """`_meta_state_shapes` of a config as canonical JSON, remembered for the process: building the meta model
    is not free, and a conversion checks its checkpoint against the config several times (plan, fit, write;
    each member of a family)."""
    config = json.loads(config_json)
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    cfg = transformers.Glm5NextConfig(**config) if config.get("text_config") else \
        transformers.Glm5NextConfig(text_config=config)
    with torch.device("meta"):
        model = transformers.Glm5NextForConditionalGeneration(cfg)
    sd = revert_weight_conversion(model, model.state_dict())
    return {k: tuple(v.shape) for k, v in sd.items()}


def nextn_shapes(config: dict, text: dict, layer_types: list[str]) -> dict[str, tuple[int, ...]]:
    """Shapes of the NextN block(s): a DSA + MoE decoder layer (indexer full) without the tensors the table keeps
    out of NextN blocks (mHC), plus the NextN-only tensors of the table (eh_proj, enorm, hnorm, shared_head.norm)."""
    k = int(text.get("num_nextn_predict_layers", 0) or 0)
    if k == 0:
        return {}
    n = text["num_hidden_layers"]
    t = dict(text)  # a one-layer model whose layer 0 is DSA + MoE with a full indexer = the NextN block body
    t.update(num_hidden_layers=1, layer_types=["indexed_attention"], mlp_layer_types=["sparse"],
             indexer_types=["full"], num_nextn_predict_layers=0)
    t.pop("first_k_dense_replace", None)
    cfg = {"text_config": t, "vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 16,
                                               "num_heads": 1, "out_hidden_size": t["hidden_size"]}}
    shapes = _meta_state_shapes(cfg)
    before, after = nextn_only_shapes(int(text["hidden_size"]))
    body = f"{TEXT_PREFIX}layers.0."
    out: dict[str, tuple[int, ...]] = {}
    for j in range(k):
        L = f"{TEXT_PREFIX}layers.{n + j}."
        out.update({L + name: s for name, s in before.items()})
        for name, s in shapes.items():
            if name.startswith(body) and in_nextn_block(name[len(body):]):
                out[L + name[len(body):]] = s
        out.update({L + name: s for name, s in after.items()})
    return out


def checkpoint_from_config(config_path: str | os.PathLike) -> Checkpoint:
    """A shapes-only Checkpoint from a config.json (or a directory holding one): names/shape/info work,
    get() raises InputError. Builds the model on the meta device through transformers (no memory)."""
    p = Path(config_path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    config = _load_json(p, "config.json")
    text = _text_config(config, p)
    lt = _layer_types(text, p)
    c = json.loads(json.dumps(config))
    tc = c["text_config"] if isinstance(c.get("text_config"), dict) else c
    tc["layer_types"] = ["indexed_attention" if x != "linear_attention" else x for x in lt]
    try:
        shapes = _meta_state_shapes(c)
        if not isinstance(config.get("vision_config"), dict):  # text-only config: no vision tower to plan
            shapes = {k: v for k, v in shapes.items() if not is_vision(k)}
        shapes.update(nextn_shapes(c, tc, lt))
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers rejects inconsistent configs with many error types
        raise InputError(f"{p}: transformers cannot build Glm5Next from this config: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from None
    dtype = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(
        str(config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or "bfloat16"), "BF16")
    entries = {k: _Entry(None, dtype, s) for k, s in shapes.items()}
    return Checkpoint(p.parent, config, entries, {}, config_path=p)
