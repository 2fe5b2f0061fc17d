"""The seal of an EXL3 directory written by mixq: a digest of every file and of the manifest itself, and the
checks of the sealed JSON files against the stored tensors.

`mixq_manifest.json` carries, next to its units and tensors:
  files  {file name: {"sha256", "bytes"}} for every other file of the directory as written: the shards, the
         index, config.json, quantization_config.json, the tokenizer, chat template and other side files
  seal   {"algorithm": "sha256", "manifest_sha256": sha256 of the manifest's canonical JSON without "seal"}
`seal_manifest` adds both when the directory is finalised (formats/exl3_writer). On reading (formats/exl3_reader
`verify_exl3`): `manifest_problems` re-computes the self-digest, `file_problems` re-hashes every sealed file once
(streamed in chunks) and lists unsealed files a loader would read, and `consistency_problems` holds the JSON
against the tensors: each unit's bits against its trellis shape (last dim 16·K, exl3-format.md §1.4),
config.json's hidden_size and layer count against the stored norms, quantization_config.json's rates and
tensor_storage against the trellis shapes and config.json. A manifest without `files` (no seal) gets the
structural checks only: its shards against their recorded hashes and the two config files present. A directory
without mixq's manifest at all (exllamav3's own output) has nothing to seal: it gets the consistency checks that
hold for any writer (`consistency_problems(..., manifest=False)`), and `integrity_note` says so.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from mixq.errors import InputError
from mixq.formats.exl3_layout import RATES, trellis_shape
from mixq.formats.exl3_names import Exl3Unit
from mixq.formats.safetensors_io import ST_DTYPES, sha256_file
from mixq.formats.model_files import read_json

MANIFEST = "mixq_manifest.json"
ALGORITHM = "sha256"
CONFIG = "config.json"
QUANT_CONFIG = "quantization_config.json"
INDEX = "model.safetensors.index.json"
# an unsealed file with one of these endings would be read by a loader (weights, configs, tokenizer, template)
LOADED_SUFFIXES = (".safetensors", ".json", ".jinja", ".model", ".tiktoken", ".txt")
RATE_KEYS = ("bits", "head_bits", "mtp_bits", "vision_bits")
_LAYER_NORM = re.compile(r"(?:^|\.)layers\.(\d+)\.input_layernorm\.weight$")


# ---------------------------------------------------------------------------------------------- sealing

def bytes_digest(data: bytes) -> dict:
    """The seal entry of a file whose bytes are ``data``."""
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def file_digest(path: Path) -> dict:
    """The seal entry of a file on disk (read in chunks)."""
    return {"sha256": sha256_file(path), "bytes": Path(path).stat().st_size}


def manifest_sha256(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON (sorted keys, no whitespace) without its "seal" field."""
    body = {k: v for k, v in manifest.items() if k != "seal"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def seal_manifest(manifest: dict, files: dict[str, dict]) -> dict:
    """The manifest with `files` (every other file of the directory) and its own digest under `seal`."""
    out = dict(manifest, files={n: dict(files[n]) for n in sorted(files)})
    out["seal"] = {"algorithm": ALGORITHM, "manifest_sha256": manifest_sha256(out)}
    return out


# ---------------------------------------------------------------------------------------------- checks

def is_sealed(manifest: dict) -> bool:
    """True for a manifest that records its directory's files."""
    return isinstance(manifest.get("files"), dict)


def manifest_problems(manifest: dict) -> list[str]:
    """The manifest's self-digest: a manifest edited after conversion (a unit's bits, a hash) is named."""
    seal = manifest.get("seal")
    if not isinstance(seal, dict) or not is_sealed(manifest):
        # a mixq manifest always carries both: without them nothing but the shards would be checked
        return [f"{MANIFEST}: no seal (no 'files' / 'seal' fields): the JSON and side files cannot be checked"]
    if seal.get("algorithm") != ALGORITHM:
        return [f"{MANIFEST}: seal.algorithm is {seal.get('algorithm')!r}, expected {ALGORITHM!r}"]
    if seal.get("manifest_sha256") != manifest_sha256(manifest):
        return [f"{MANIFEST}: content differs from its seal (seal.manifest_sha256 mismatch: edited after "
                "conversion)"]
    return []


def _check_file(directory: Path, name: str, want: Any, *, shard: bool) -> str | None:
    """One line when the file `name` is absent or differs from its recorded size / sha256, else None (shards
    keep their own wording: "shard NAME: ...")."""
    label = f"shard {name}" if shard else name
    if Path(name).name != name or name in (".", ".."):  # the seal names files of this directory only
        return f"{MANIFEST}: sealed name {name!r} is not a file name of this directory"
    want = want if isinstance(want, dict) else {}
    p = directory / name
    if not p.is_file():
        return f"{label} is missing" if shard else f"{label}: missing (sealed in {MANIFEST})"
    size = p.stat().st_size
    if size != want.get("bytes"):
        return f"{label}: {size} bytes, {MANIFEST} says {want.get('bytes')}"
    if sha256_file(p) != want.get("sha256"):
        return f"{label}: sha256 mismatch" if shard else \
            f"{label}: sha256 differs from the seal in {MANIFEST} (changed after conversion)"
    return None


def file_problems(directory: Path, manifest: dict) -> tuple[list[str], int]:
    """Every sealed file present with its size and sha256 (each hashed once), every shard sealed, and no
    unsealed file a loader would read. Returns (problems, files checked). Without a seal: the shards against
    their recorded hashes, config.json and quantization_config.json present, no stray shard."""
    directory = Path(directory)
    shards = manifest.get("shards") or {}
    problems: list[str] = []
    if is_sealed(manifest):
        recorded = dict(manifest["files"])
        problems += [f"shard {s}: not sealed in {MANIFEST}" for s in sorted(set(shards) - set(recorded))]
        loaded, why = LOADED_SUFFIXES, f"not sealed in {MANIFEST}"
    else:
        recorded = dict(shards)
        problems += [f"{n}: missing" for n in (CONFIG, QUANT_CONFIG) if not (directory / n).is_file()]
        loaded, why = (".safetensors",), f"not a shard of {MANIFEST}"  # only the shards are recorded
    for name in sorted(recorded):
        line = _check_file(directory, name, recorded[name], shard=name in shards)
        if line:
            problems.append(line)
    known = set(recorded) | {MANIFEST}
    for p in sorted(directory.iterdir()):
        if p.is_file() and p.name not in known and p.name.endswith(loaded) and not p.name.startswith("."):
            problems.append(f"unexpected file {p.name}: {why} (a loader would read it)")
    return problems, len(recorded)


def _load_quant_config(directory: Path) -> tuple[dict | None, list[str]]:
    p = directory / QUANT_CONFIG
    if not p.is_file():
        return None, []  # reported by file_problems
    try:
        d = read_json(p, QUANT_CONFIG)
    except InputError as e:  # verify lists it as a problem of the directory
        return None, [str(e)]
    return (d, []) if isinstance(d, dict) else (None, [f"{QUANT_CONFIG}: not a JSON object"])


def _stored_bits(u: Exl3Unit, stored: dict[str, tuple[str, tuple[int, ...]]]) -> float | None:
    """K of a trellis unit from its stored trellis tensor (last dim / 16), None when it is not stored."""
    entry = stored.get(f"{u.key}.trellis")
    if entry is None or len(entry[1]) != 3:
        return None
    return entry[1][-1] / 16


def _unit_problems(units: list[Exl3Unit], bits: dict, stored: dict) -> list[str]:
    """Each trellis unit's manifest bits against its stored trellis shape (k/16, n/16, 16·K)."""
    problems = []
    for u in units:
        if u.kind != "trellis":
            continue
        b = bits.get(u.key)
        try:
            b = float(b)
        except (TypeError, ValueError):
            problems.append(f"{MANIFEST}: unit {u.key} has bits {b!r}, not a number")
            continue
        if b not in RATES:
            problems.append(f"{MANIFEST}: unit {u.key} has bits {b:g}, not an EXL3 rate ({', '.join(map(str, RATES))})")
            continue
        entry = stored.get(f"{u.key}.trellis")
        if entry is None:
            continue  # a missing tensor is reported by the tensor checks
        k, n = u.padded
        want = trellis_shape(k, n, b)
        if tuple(entry[1]) != want:
            have = entry[1][-1] / 16 if len(entry[1]) == 3 else None
            problems.append(f"{MANIFEST}: unit {u.key} has bits {b:g} (trellis {list(want)}), the stored "
                            f"{u.key}.trellis is {list(entry[1])}" + (f" ({have:g} bits)" if have is not None else ""))
    return problems


def _config_int(config: dict, key: str) -> tuple[str, Any]:
    """(where, value) of a model width: text_config (glm5_next), dflash_config (drafter) or the top level."""
    for sub in ("text_config", "dflash_config"):
        d = config.get(sub)
        if isinstance(d, dict) and key in d:
            return f"{sub}.{key}", d[key]
    return key, config.get(key)


def _config_problems(config: dict, units: list[Exl3Unit], stored: dict) -> list[str]:
    """config.json's hidden_size against the stored norms / embedding, num_hidden_layers against the layers
    stored (input_layernorm of each decoder layer; the NextN layers of the manifest's mtp stages apart)."""
    problems = []
    where, hidden = _config_int(config, "hidden_size")
    if not isinstance(hidden, int) or isinstance(hidden, bool):
        problems.append(f"{CONFIG}: {where} is {hidden!r}, not an integer")
    else:
        bad = [(n, s) for n, (_, s) in sorted(stored.items())
               if (n.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")) and tuple(s) != (hidden,))
               or (n.endswith("embed_tokens.weight") and (len(s) != 2 or s[1] != hidden))]
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            problems.append(f"{CONFIG}: {where} {hidden}, the stored {bad[0][0]} is {list(bad[0][1])}{more}")
    where, layers = _config_int(config, "num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool):
        problems.append(f"{CONFIG}: {where} is {layers!r}, not an integer")
        return problems
    idx = sorted({int(m.group(1)) for n in stored for m in [_LAYER_NORM.search(n)] if m})
    if idx:
        nextn = len({u.stage for u in units if u.stage.startswith("mtp.")})
        if layers != len(idx) - nextn:
            problems.append(f"{CONFIG}: {where} {layers}, the shards hold {len(idx) - nextn} decoder layers"
                            + (f" (+{nextn} NextN)" if nextn else ""))
        elif idx != list(range(len(idx))):
            problems.append(f"{CONFIG}: the stored decoder layers are {idx}, not 0..{len(idx) - 1}")
    return problems


def units_per_rate(units: list[Exl3Unit], stored: dict) -> dict[str, int]:
    """Trellis units per rate ({"2.5": 40, "4": 3, ...}, ascending), K read from the stored trellis shapes: what a
    receipt's plan records as "rates"."""
    counts: dict[float, int] = {}
    for u in units:
        k_bits = _stored_bits(u, stored) if u.kind == "trellis" else None
        if k_bits is not None:
            counts[k_bits] = counts.get(k_bits, 0) + 1
    return {f"{k:g}": counts[k] for k in sorted(counts)}


def _rates(units: list[Exl3Unit], stored: dict) -> dict[str, float]:
    """Per budget key, Σ K·k·n / Σ k·n over the trellis units with K read from the stored trellis shapes,
    rounded to 2 decimals as quantization_config records it."""
    acc: dict[str, list[float]] = {}
    for u in units:
        k_bits = _stored_bits(u, stored) if u.kind == "trellis" and u.bits_key else None
        if k_bits is None:
            continue
        k, n = u.padded
        a = acc.setdefault(u.bits_key, [0.0, 0.0])
        a[0] += k_bits * k * n
        a[1] += k * n
    return {key: round(num / den, 2) for key, (num, den) in acc.items() if den}


def _quant_config_problems(qcfile: dict, config: dict, units: list[Exl3Unit], stored: dict, *,
                           rates: bool = True) -> list[str]:
    """quantization_config.json against config.json's quantization_config, its rates against the trellis shapes,
    its tensor_storage against the units and the stored tensors."""
    problems = []
    cqc = config.get("quantization_config") or {}
    qc = {k: v for k, v in qcfile.items() if k != "tensor_storage"}
    for key in sorted(set(qc) | set(cqc)):
        if qc.get(key) != cqc.get(key):
            problems.append(f"{QUANT_CONFIG}: {key} is {qc.get(key)!r}, {CONFIG}'s quantization_config.{key} is "
                            f"{cqc.get(key)!r}")
    achieved = _rates(units, stored) if rates else {}
    for key in RATE_KEYS:
        if key in achieved and key in qc:
            v = qc[key]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or abs(float(v) - achieved[key]) > 1e-6:
                problems.append(f"{QUANT_CONFIG}: {key} is {v!r}, the stored trellis tensors of the {key} units "
                                f"give {achieved[key]:g}")
    storage = qcfile.get("tensor_storage")
    if not isinstance(storage, dict):
        return problems + [f"{QUANT_CONFIG}: tensor_storage missing"]
    by_key = {u.key: u for u in units}
    for mod in sorted(storage):
        entry = storage[mod] if isinstance(storage[mod], dict) else {}
        if "bits_per_weight" in entry:
            u = by_key.get(mod)
            k_bits = _stored_bits(u, stored) if u is not None and u.kind == "trellis" else None
            if k_bits is None:
                problems.append(f"{QUANT_CONFIG}: tensor_storage.{mod} has bits_per_weight, no stored trellis "
                                "unit has that key")
            elif entry["bits_per_weight"] != k_bits:
                problems.append(f"{QUANT_CONFIG}: tensor_storage.{mod}.bits_per_weight is "
                                f"{entry['bits_per_weight']!r}, {mod}.trellis holds {k_bits:g} bits")
        for name, spec in sorted((entry.get("stored_tensors") or {}).items()):
            have = stored.get(name)
            shape = list(have[1]) if have else None
            if not isinstance(spec, dict):
                spec = {}
            dtype = str(ST_DTYPES.get(have[0])) if have else None
            if have is None or spec.get("shape") != shape or spec.get("dtype") != dtype:
                problems.append(f"{QUANT_CONFIG}: tensor_storage.{mod}.stored_tensors.{name} is "
                                f"{spec.get('dtype')} {spec.get('shape')}, stored "
                                f"{f'{dtype} {shape}' if have else 'nowhere'}")
    return problems


def consistency_problems(directory: Path, config: dict, units: list[Exl3Unit], bits: dict,
                         stored: dict[str, tuple[str, tuple[int, ...]]], *, manifest: bool = True) -> list[str]:
    """The sealed JSON against the tensors (see module docstring): one line per disagreement, naming the file
    and the key or tensor. `stored`: tensor name -> (dtype tag, shape) read from the shards' headers.
    `manifest` False: units derived from the stored tensors (no mixq manifest): their bits are the trellis
    shapes' by construction, and quantization_config.json's rates are not held against the tensors (exllamav3
    records the rates it was asked for, mixq the ones achieved); its tensor_storage still is."""
    problems = _unit_problems(units, bits, stored) if manifest else []
    problems += _config_problems(config, units, stored)
    qcfile, bad = _load_quant_config(Path(directory))
    problems += bad
    if qcfile is not None:
        problems += _quant_config_problems(qcfile, config, units, stored, rates=manifest)
    return problems


def integrity_note(manifest: bool, sealed_files: int, *, decoded: bool) -> str:
    """The line `mixq verify` prints about what it could check: the seal of a directory with mixq's manifest,
    or the structure (and trellis decode) alone of one without."""
    what = "structure and decode checked" if decoded else "structure checked"
    if not manifest:
        return f"no mixq manifest: {what}"
    return f"mixq manifest: {sealed_files} sealed files' sha256 and {what}"

