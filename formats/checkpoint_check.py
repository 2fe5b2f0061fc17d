"""Is a glm5_next checkpoint what its config.json says it is? Checked before any output is written.

- `checkpoint_problems(ckpt)` / `validate_checkpoint(ckpt)`: headers and config only, no tensor data read.
  Every safetensors file opens in the safetensors library (which refuses overlapping, aliased or out-of-range
  data_offsets), every tensor of an indexed shard is listed in the index's weight_map, every dtype is a float
  type, FP8 block scales have the shape their weight needs, and the tensors equal, name for name and shape for
  shape, those of the model transformers builds from the config on the meta device
  (`checkpoint.checkpoint_from_config`, the one place that derives shapes from a config). Key config values
  (num_hidden_layers, vocab_size, hidden_size, n_routed_experts) that disagree with the weights are named first,
  since one of them explains every shape error that follows; failing those, an attention head size or rank
  (HEAD_SIZE_KEYS) is named with the value the weights imply, instead of a shape derived from it.
- NaN/Inf in one tensor is `formats/finite.check_finite`; `Checkpoint.get` calls it on every read, so a
  streaming pass (GGUF convert, calibration, eval) checks each tensor as it reads it, at no extra read.
- `scan_finite(ckpt)`: that check over the whole checkpoint up front, for commands that write into OUT
  before they have read every tensor (EXL3 convert keeps its resumable job inside OUT).
"""
from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Iterable

import safetensors  # safetensors.safe_open looked up per call (tests wrap it)
import torch
from safetensors import SafetensorError
from tqdm.auto import tqdm

from mixq.errors import FormatError, InputError, MixqError
from mixq.formats.checkpoint import Checkpoint, checkpoint_from_config
from mixq.formats.finite import check_finite, has_non_finite
from mixq.formats.glm5next import classify

INDEX = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"
# the config keys whose disagreement with the weights explains a whole family of shape errors
_KEY_SIZES = ("num_hidden_layers", "vocab_size", "hidden_size", "n_routed_experts")
# text_config keys that set attention sizes (dotted: nested): one of them off explains every misshapen tensor it sets
HEAD_SIZE_KEYS = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "q_lora_rank",
                  "index_head_dim", "linear_attn_config.head_dim", "linear_head_dim", "head_dim")


def validate_checkpoint(ckpt: "Checkpoint") -> None:
    """Raise InputError/FormatError (one line: the first problem, naming the file or tensor, and how many more)
    when the checkpoint does not match its config; see the module docstring for what is checked."""
    problems = checkpoint_problems(ckpt)
    if problems:
        exc, msg = problems[0]
        more = f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
        raise exc(msg + more)


def checkpoint_problems(ckpt: "Checkpoint") -> list[tuple[type, str]]:
    """Every problem found, most explanatory first, as (error class, message). Empty for a sound checkpoint."""
    if ckpt.shapes_only:
        return []
    out = _file_problems(ckpt)
    if out:  # a file the library refuses makes every later check meaningless
        return out
    out += _dtype_problems(ckpt)
    expected = expected_shapes(ckpt)
    out += _config_value_problems(ckpt, expected)
    out += _tensor_set_problems(ckpt, expected)
    return out


def expected_shapes(ckpt: "Checkpoint") -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} the config implies (transformers' meta-device model plus the NextN block). A
    checkpoint without any vision tensor is a text-only release: the vision tower is then not expected."""

    skeleton = checkpoint_from_config(Path(ckpt.path) / "config.json")
    shapes = {n: tuple(skeleton.shape(n)) for n in skeleton.names()}
    if not ckpt.vision_names():
        shapes = {n: s for n, s in shapes.items() if skeleton.info(n).role != "vision"}
    return shapes


# --- files -------------------------------------------------------------------------------------------------
def _source_files(ckpt: "Checkpoint") -> list[Path]:
    files = {ckpt.file_of(n) for n in ckpt.names()}
    return sorted(f for f in files if f is not None)


def _file_problems(ckpt: "Checkpoint") -> list[tuple[type, str]]:
    """The safetensors library's own header checks per file, tensors a shard holds that the index does not list,
    and FP8 scale dtypes/shapes (the scales are not tensors of the Checkpoint)."""
    out: list[tuple[type, str]] = []
    listed = set(ckpt.names())
    indexed = (Path(ckpt.path) / INDEX).is_file()
    for f in _source_files(ckpt):
        try:
            with safetensors.safe_open(str(f), framework="pt") as h:
                keys = list(h.keys())
                scales = {k: (h.get_slice(k).get_dtype(), tuple(h.get_slice(k).get_shape()))
                          for k in keys if k.endswith(SCALE_SUFFIX) and k[: -len(SCALE_SUFFIX)] in listed}
        except (SafetensorError, OSError, ValueError) as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            out.append((FormatError, f"{f}: the safetensors library refuses this file ({msg})"))
            continue
        for k in keys:
            if indexed and k not in listed and not (k.endswith(SCALE_SUFFIX) and k[: -len(SCALE_SUFFIX)] in listed):
                out.append((InputError, f"{f}: tensor {k!r} is in this shard but not in {INDEX}'s weight_map"))
        for k, (dtype, shape) in scales.items():
            base = k[: -len(SCALE_SUFFIX)]
            if not ckpt.is_fp8(base):
                continue
            if not dtype.startswith(("F", "BF")):
                out.append((InputError, f"{f}: FP8 block scale {k!r} has dtype {dtype}, expected a float type"))
            want = _scale_shape(ckpt.shape(base), ckpt.block_size)
            if shape != want:
                out.append((InputError, f"{f}: FP8 block scale {k!r} has shape {list(shape)}, its weight "
                                        f"{list(ckpt.shape(base))} in {ckpt.block_size[0]}x{ckpt.block_size[1]} "
                                        f"blocks needs {list(want)}"))
    return out


def _scale_shape(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) < 2:
        return (1,)
    return (*shape[:-2], -(-shape[-2] // int(block[0])), -(-shape[-1] // int(block[1])))


def _dtype_problems(ckpt: "Checkpoint") -> list[tuple[type, str]]:
    out = []
    for n in ckpt.names():
        dt = ckpt.source_dtype(n)
        if not getattr(torch, dt).is_floating_point:
            out.append((InputError, f"{ckpt.file_of(n)}: tensor {n!r} has dtype {dt}; glm5_next weights are "
                                    "floating point (bf16, fp16, fp32 or block-scaled fp8)"))
    return out


# --- config against weights --------------------------------------------------------------------------------
def _info(ckpt: "Checkpoint", name: str):
    """The table's TensorInfo of a name, whether the checkpoint holds it or only the config implies it."""

    return ckpt.info(name) if name in ckpt else classify(name, ckpt.num_hidden_layers)


def _first(ckpt: "Checkpoint", names: Iterable[str], role: str) -> str | None:
    """The first trunk (non-NextN) tensor of `role` among `names`."""
    return next((n for n in names if _info(ckpt, n).role == role and not _info(ckpt, n).mtp), None)


def _config_value_problems(ckpt: "Checkpoint", expected: dict[str, tuple[int, ...]]) -> list[tuple[type, str]]:
    """Name the config key behind a family of mismatches: layers present, embedding rows/width, experts."""
    cfg = f"{ckpt.path}/config.json"
    tc = ckpt.text_config
    out: list[tuple[type, str]] = []
    trunk_have = sorted({ckpt.info(n).layer for n in ckpt.names()
                         if ckpt.info(n).layer is not None and not ckpt.info(n).mtp})
    if trunk_have and trunk_have != list(range(ckpt.num_hidden_layers)):
        out.append((InputError, f"{cfg}: num_hidden_layers is {ckpt.num_hidden_layers} but the weights hold decoder "
                                f"layers {_spans(trunk_have)}"))
    embed = _first(ckpt, ckpt.names(), "embed")
    if embed is not None and embed in expected and len(ckpt.shape(embed)) == 2:
        rows, width = ckpt.shape(embed)
        if rows != expected[embed][0]:
            out.append((InputError, f"{cfg}: vocab_size is {tc.get('vocab_size')} but {embed} has {rows} rows"))
        if width != expected[embed][-1]:
            out.append((InputError, f"{cfg}: hidden_size is {tc.get('hidden_size')} but {embed} is {width} wide"))
    # the key is to blame when every MoE layer holds the same, other expert set (one odd layer is a tensor problem)
    have, want = _experts_per_layer(ckpt, ckpt.names()), _experts_per_layer(ckpt, expected)
    sets = {frozenset(v) for v in have.values()}
    if len(sets) == 1 and set(have) == set(want) and have != want:
        layer = min(have)
        out.append((InputError, f"{cfg}: n_routed_experts is {tc.get('n_routed_experts')} but every MoE layer "
                                f"holds experts {_spans(sorted(have[layer]))}"))
    if not out:  # a wrong key size above explains every shape; otherwise a head size may
        out += _head_size_problems(ckpt, expected)
    return out


def _head_size_problems(ckpt: "Checkpoint", expected: dict[str, tuple[int, ...]]) -> list[tuple[type, str]]:
    """The HEAD_SIZE_KEYS key that disagrees with the weights, with the value they imply. Each key is moved by one
    in a reduced skeleton, which shows the dimensions it sets (each affine in it); a key is reported when a single
    other value gives every tensor it sets its checkpoint shape (checked in one more skeleton)."""
    have = {n: tuple(ckpt.shape(n)) for n in ckpt.names()}
    bad = [n for n in have if n in expected and have[n] != tuple(expected[n])]
    if not bad:
        return []
    base = _skeleton_shapes(ckpt.config, {})
    if base is None:
        return []
    for key in HEAD_SIZE_KEYS:
        v = _get_key(ckpt.text_config, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            continue
        moved = _skeleton_shapes(ckpt.config, {key: v + 1})
        if moved is None:
            continue
        deps = [n for n in have if n in base and n in moved and base[n] != moved[n]
                and len(base[n]) == len(moved[n])]
        culprit = next((n for n in bad if n in deps), None)
        if culprit is None:
            continue
        w = _implied_value(deps, have, base, moved, v)
        if w is None or w == v:
            continue
        check = _skeleton_shapes(ckpt.config, {key: w})
        if check is None or any(check.get(n) != have[n] for n in deps):
            continue
        return [(InputError, f"{ckpt.path}/config.json: {key} is {v} but the weights imply {w} ({culprit} has "
                             f"shape {list(have[culprit])}; {key} {v} gives {list(expected[culprit])})")]
    return []


def _implied_value(deps: list[str], have: dict, base: dict, moved: dict, v: int) -> int | None:
    """The one value of a key (now `v`; `moved`: the shapes at v + 1) that gives every tensor in `deps` its
    checkpoint shape, each dimension affine in the key; None when no single whole value does."""
    values = set()
    for n in deps:
        if len(have[n]) != len(base[n]):
            return None
        for h, d0, d1 in zip(have[n], base[n], moved[n]):
            if d1 == d0:
                if h != d0:  # a dimension the key does not set is off: another key is to blame
                    return None
                continue
            k, r = divmod(h - d0, d1 - d0)
            if r:
                return None
            values.add(v + k)
    w = values.pop() if len(values) == 1 else None
    return w if w is not None and w >= 0 else None


def _get_key(tc: dict, key: str):
    """text_config[key], a dotted key reaching into a nested object; None when absent."""
    d = tc
    for part in key.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def _skeleton_shapes(config: dict, changes: dict[str, int]) -> dict[str, tuple[int, ...]] | None:
    """{name: shape} transformers builds from `config` with `changes` (text_config keys, dotted when nested), the
    routed experts cut to the number a token picks (attention sizes do not depend on them, and the build then
    takes a fraction of the time); None when transformers refuses the changed config."""

    c = json.loads(json.dumps(config))
    tc = c["text_config"] if isinstance(c.get("text_config"), dict) else c
    k, e = tc.get("num_experts_per_tok"), tc.get("n_routed_experts")
    if isinstance(k, int) and isinstance(e, int) and 0 < k < e:
        tc["n_routed_experts"] = k
    for key, v in changes.items():
        *path, last = key.split(".")
        d = tc
        for part in path:
            d = d.setdefault(part, {})
        d[last] = v
    with tempfile.TemporaryDirectory(prefix="mixq-config-") as tmp:
        f = Path(tmp) / "config.json"
        f.write_text(json.dumps(c))
        try:
            sk = checkpoint_from_config(f)
        except MixqError:
            return None
        return {n: tuple(sk.shape(n)) for n in sk.names()}


def _experts_per_layer(ckpt: "Checkpoint", names: Iterable[str]) -> dict[int, set[int]]:
    per: dict[int, set[int]] = defaultdict(set)
    for n in names:
        info = _info(ckpt, n)
        if info.expert is not None and info.layer is not None:
            per[info.layer].add(info.expert)
    return dict(per)


def _spans(xs: list[int]) -> str:
    """[0,1,2,5] -> '0..2, 5'."""
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}..{xs[j]}")
        i = j + 1
    return ", ".join(out)


def _optional_shape(ckpt: "Checkpoint", name: str, expected: dict[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    """NextN copies of the embedding / head are optional (GLM ships neither: the block borrows the trunk's);
    when present they have the trunk tensor's shape."""
    info = ckpt.info(name)
    if not info.mtp or info.role not in ("embed", "lm_head"):
        return None
    twin = _first(ckpt, expected, info.role)
    return expected.get(twin) if twin else None


def _tensor_set_problems(ckpt: "Checkpoint", expected: dict[str, tuple[int, ...]]) -> list[tuple[type, str]]:
    cfg = f"{ckpt.path}/config.json"
    out: list[tuple[type, str]] = []
    have = set(ckpt.names())
    missing = [n for n in expected if n not in have]
    nextn = {n for n in expected if _info(ckpt, n).mtp}
    if nextn and nextn <= set(missing):
        out.append((InputError, f"{cfg}: num_nextn_predict_layers is {len(ckpt.nextn_layers)} but the checkpoint "
                                f"holds no tensor of the NextN block (layer {ckpt.nextn_layers[0]})"))
        missing = [n for n in missing if n not in nextn]
    where = f" (nor in {INDEX}'s weight_map)" if (Path(ckpt.path) / INDEX).is_file() else ""
    for n in missing:
        out.append((InputError, f"{ckpt.path}: tensor {n!r} {list(expected[n])} that config.json implies is "
                                f"missing from the checkpoint{where}"))
    for n in ckpt.names():
        want = expected.get(n) or _optional_shape(ckpt, n, expected)
        if want is None:
            out.append((InputError, f"{ckpt.file_of(n)}: tensor {n!r} is not part of the model config.json "
                                    "describes"))
        elif tuple(ckpt.shape(n)) != tuple(want):
            out.append((InputError, f"{ckpt.file_of(n)}: tensor {n!r} has shape {list(ckpt.shape(n))}, "
                                    f"config.json implies {list(want)}"))
    return out


# --- NaN / Inf ---------------------------------------------------------------------------------------------
def scan_finite(ckpt: "Checkpoint", names: Iterable[str] | None = None, *, progress: bool = True,
                chunk_bytes: int = 1 << 28) -> int:
    """Read every tensor (or `names`) once, with the FP8 block scales, in chunks of about `chunk_bytes` rows
    through the safetensors library, and raise on the first NaN/Inf (fp8 weights are checked on their raw
    bytes, so no dequantization is paid). Returns the bytes read."""
    todo = list(ckpt.names() if names is None else names)
    wanted = set(todo) | {n + SCALE_SUFFIX for n in todo if ckpt.is_fp8(n)}
    total = sum(ckpt.nbytes(n) for n in todo)
    done = 0
    with tqdm(total=total, desc="check weights", unit="B", unit_scale=True, disable=not progress,
              leave=False) as bar:
        for f in _source_files(ckpt):
            with safetensors.safe_open(str(f), framework="pt") as h:
                for k in (k for k in h.keys() if k in wanted):
                    sl = h.get_slice(k)
                    shape = sl.get_shape()
                    row_bytes = max(1, _nbytes(sl.get_dtype(), shape[1:]))
                    step = max(1, chunk_bytes // row_bytes)
                    for a in range(0, shape[0] if shape else 1, step):
                        part = sl[a:a + step] if shape else h.get_tensor(k)
                        if part.is_floating_point() and part.numel() and has_non_finite(part.reshape(-1)):
                            check_finite(h.get_tensor(k), k, f)  # the whole tensor, for the message
                        bar.update(part.numel() * part.element_size())
                        done += part.numel() * part.element_size()
    return done


def _nbytes(dtype: str, shape) -> int:
    size = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}.get(dtype, 1)
    n = 1
    for d in shape:
        n *= int(d)
    return n * size
