"""Reads an EXL3 directory, written by mixq or by anyone (exllamav3's converter): its units and stored tensors,
and a structural verification.

`Exl3Dir(path)` opens the directory (config, the units and where each stored tensor lives) and reads stored
tensors on demand. mixq's `mixq_manifest.json` is an extra: with it the units and shards are the manifest's;
without it the shards are the directory's `*.safetensors` files (what exllamav3's loader reads) and the units are
derived from config.json and the stored tensors (formats/exl3_foreign). Decoding trellis units into weights is
the runtime's job (runtime/dequant: `read_exl3`, `open_dequant`), as formats do not import the quantizer.
`verify_exl3(path)` re-reads every shard and lists problems (missing / unexpected tensors, wrong shape or dtype,
a broken index, the JSON files against the tensors); with a manifest it also checks the directory's seal
(formats/exl3_seal: every file's sha256, the manifest's own digest), which a directory without one cannot have.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from mixq.errors import FormatError, InputError
from mixq.formats.exl3_foreign import codebook_marker, derive_units
from mixq.formats.exl3_layout import RATES
from mixq.formats.exl3_names import Exl3Unit
from mixq.formats.exl3_seal import (CONFIG, INDEX, MANIFEST, consistency_problems, file_problems, integrity_note,
                                    is_sealed, manifest_problems, units_per_rate)
from mixq.formats.exl3_writer import torch_dtype
from mixq.formats.model_files import check_model_dir, model_file, read_json
from mixq.formats.receipt import read_receipt_json, receipt_json_path
from mixq.formats.safetensors_io import dtype_tag, load_tensor, tensor_entries


def _load_json(p: Path, what: str) -> dict:
    if not os.path.lexists(p):
        raise FormatError(f"{p.parent}: not an EXL3 directory ({p.name} missing)")
    d = read_json(p, what, FormatError)
    if not isinstance(d, dict):
        raise FormatError(f"{p}: {what} is not a JSON object")
    return d


def _units(manifest: dict) -> list[Exl3Unit]:
    out = []
    expected = manifest.get("expected") or {}
    for d in manifest["units"]:
        out.append(Exl3Unit(key=d["key"], kind=d["kind"], hf_names=list(d["hf_names"]), shape=tuple(d["shape"]),
                            role=d["role"], stage=d["stage"], bits_key=d.get("bits_key"), dtype=d.get("dtype"),
                            bias=d.get("bias"), pad_to=d.get("pad_to", 128), split=list(d.get("split") or []),
                            src_shapes=[tuple(s) for s in d.get("src_shapes") or [d["shape"]]],
                            marker=codebook_marker(expected, d["key"]) if d["kind"] == "trellis" else None))
    return out


class Exl3Dir:
    """An opened EXL3 directory: config, units (the manifest's, or derived), lazy access to every stored tensor."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise InputError(f"{self.path}: not a directory")
        check_model_dir(self.path)  # an untrusted directory: no link may lead out of it
        self.config = _load_json(self.path / CONFIG, CONFIG)
        qc = self.config.get("quantization_config") or {}
        if not isinstance(qc, dict) or qc.get("quant_method") != "exl3":
            raise FormatError(f"{self.path}/{CONFIG}: quantization_config.quant_method is not 'exl3'")
        self.manifest = _load_json(self.path / MANIFEST, "manifest") if (self.path / MANIFEST).exists() else None
        self.stored: dict[str, tuple[str, tuple[int, ...]]] = {}  # tensor -> (dtype tag, shape)
        self.where: dict[str, str] = {}
        self.duplicates: list[str] = []  # a tensor in two shards (a loader would read one of them)
        if self.manifest is not None:
            self.shards = sorted(self.manifest.get("shards", {}))
            what = f"{self.path / MANIFEST}: shards"
        else:
            self.shards = sorted(p.name for p in self.path.glob("*.safetensors") if not p.name.startswith("."))
            what = f"{self.path}: shard"
            if not self.shards:
                raise FormatError(f"{self.path}: no *.safetensors shard in the EXL3 directory")
        for shard in self.shards:
            p = model_file(self.path, shard, what)
            if not p.exists():
                continue
            for n, tag, shape in tensor_entries(p):
                if n in self.where:
                    self.duplicates.append(f"tensor {n} is stored in {self.where[n]} and in {shard}")
                self.stored[n] = (tag, shape)
                self.where[n] = shard
        if self.manifest is not None:
            self.units = _units(self.manifest)
            self.bits = {d["key"]: d.get("bits") for d in self.manifest["units"]}
        else:
            self.units, self.bits = derive_units(self.path / CONFIG, self.stored)

    @property
    def has_manifest(self) -> bool:
        """True for a directory that carries mixq's manifest (and so can carry its seal)."""
        return self.manifest is not None

    def tensor(self, name: str) -> torch.Tensor:
        shard = self.where.get(name)
        if shard is None:
            raise FormatError(f"{self.path}: tensor {name!r} is not in any shard")
        return load_tensor(self.path / shard, name)

    def unit_tensors(self, u: Exl3Unit) -> dict[str, torch.Tensor]:
        return {n: self.tensor(n) for n in u.tensor_specs(self.bits.get(u.key))}


def _index_problems(d: Exl3Dir) -> list[str]:
    """model.safetensors.index.json against the shards: every stored tensor mapped to its shard, and (without a
    manifest, whose shards are the directory's files) no entry for a tensor no shard holds."""
    try:
        wm = _load_json(d.path / INDEX, "index").get("weight_map", {})
    except FormatError as e:  # a damaged index is one problem, not the end of the report
        return [str(e)]
    if not isinstance(wm, dict):
        return [f"{INDEX}: weight_map is not a JSON object"]
    problems = [f"{INDEX}: maps {n} to {wm.get(n)}, it is in {s}" for n, s in d.where.items() if wm.get(n) != s]
    if not d.has_manifest:
        problems += [f"{INDEX}: maps {n} to {s}, no shard holds it" for n, s in sorted(wm.items()) if n not in d.where]
    return problems


def _tensor_problems(d: Exl3Dir, expected: dict[str, dict]) -> list[str]:
    """Every planned tensor stored with its planned dtype and shape, and no tensor planned for no unit."""
    problems = []
    for n, spec in expected.items():
        if n not in d.where:
            problems.append(f"tensor {n} missing")
            continue
        tag, shape = d.stored[n]
        if list(shape) != list(spec["shape"]) or tag != dtype_tag(torch_dtype(spec["dtype"])):
            problems.append(f"tensor {n}: stored {tag} {list(shape)}, planned {spec['dtype']} {list(spec['shape'])}")
    for n in sorted(set(d.where) - set(expected)):
        problems.append(f"unexpected tensor {n}")
    return problems


def _derived_expected(d: Exl3Dir) -> tuple[dict[str, dict], list[str]]:
    """The tensors the derived units store, and the problems of units whose rate cannot be read."""
    expected, problems = {}, []
    for u in d.units:
        b = d.bits.get(u.key)
        if u.kind == "trellis":
            if f"{u.key}.trellis" not in d.stored:
                problems.append(f"tensor {u.key}.trellis missing")
                continue
            if b not in RATES:
                problems.append(f"tensor {u.key}.trellis: shape {list(d.stored[u.key + '.trellis'][1])} gives "
                                f"{'no' if b is None else f'{b:g}'} bits per weight, not an EXL3 rate")
                continue
        for n, (shape, dtype) in u.tensor_specs(b).items():
            expected[n] = {"shape": list(shape), "dtype": dtype}
    return expected, problems


def verify_exl3(path: str | Path) -> dict:
    """Re-read an EXL3 directory (shards, index, every planned tensor's dtype and shape, the JSON files against
    the tensors; with mixq's manifest also its seal; a family member's `<dir>.receipt.json` against the units
    the directory holds); returns {"ok", "problems": [...], "tensors", "shards", "quantized", "bytes", "bits",
    "sealed_files", "manifest", "integrity", "receipt"}. Each problem is one line naming the file (and key or
    tensor). "quantized" counts decoded units: 0 here, the trellis decode is the runtime's
    (runtime/dequant.exl3_decode_check, run by `mixq verify`); "integrity" says what could be checked; "receipt"
    is "checked" when a receipt lies beside the directory, else None."""
    d = Exl3Dir(path)
    problems = list(d.duplicates)
    sealed = 0
    if d.has_manifest:
        shards = d.manifest.get("shards", {})
        problems += manifest_problems(d.manifest)
        files, sealed = file_problems(d.path, d.manifest)
        problems += files
        if len(shards) > 1 and not (d.path / INDEX).exists() and not is_sealed(d.manifest):
            problems.append(f"{INDEX}: missing (several shards)")  # a sealed index that is gone: file_problems
        expected = d.manifest.get("expected", {})
        size = sum(int(s.get("bytes", 0)) for s in shards.values())
    else:
        expected, bad = _derived_expected(d)
        problems += bad
        size = sum((d.path / s).stat().st_size for s in d.shards)
    if (d.path / INDEX).exists() and (len(d.shards) > 1 or not d.has_manifest):
        problems += _index_problems(d)
    problems += _tensor_problems(d, expected)
    problems += consistency_problems(d.path, d.config, d.units, d.bits, d.stored, manifest=d.has_manifest)
    receipt, bad = _receipt_check(d)
    problems += bad
    return {"ok": not problems, "problems": problems, "path": str(d.path), "tensors": len(d.where),
            "shards": len(d.shards), "quantized": 0, "bytes": size,
            "bits": d.config["quantization_config"].get("bits"), "sealed_files": sealed,
            "manifest": d.has_manifest, "integrity": integrity_note(d.has_manifest, sealed, decoded=False),
            "receipt": receipt}


def _receipt_check(d: Exl3Dir) -> tuple[str | None, list[str]]:
    """The receipt beside the directory (`<dir>.receipt.json`, a family member's) against what the directory
    holds: its plan's units per rate and its bpw. ("checked" | None when there is none, problems)."""
    side = receipt_json_path(d.path)
    if not side.exists():
        return None, []
    doc = read_receipt_json(d.path)
    if doc is None:
        return None, [f"{side.name}: not a receipt (unreadable, or no \"receipt\" object)"]
    plan = doc["receipt"].get("plan") if isinstance(doc["receipt"].get("plan"), dict) else {}
    problems = []
    rates, held = plan.get("rates"), units_per_rate(d.units, d.stored)
    if rates is not None and rates != held:
        problems.append(f"{side.name}: plan has trellis units per rate {rates}, the directory holds {held}")
    bpw, bits = plan.get("bpw"), d.config["quantization_config"].get("bits")
    if isinstance(bpw, (int, float)) and isinstance(bits, (int, float)) and abs(bpw - bits) > 0.005:
        problems.append(f"{side.name}: plan bpw {bpw:g}, the directory's quantization_config bits {bits:g}")
    return "checked", problems
