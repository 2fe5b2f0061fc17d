"""Reads an EXL3 directory written by mixq: its units and stored tensors, and a structural verification.

`Exl3Dir(path)` opens the directory (config, manifest, the units and where each stored tensor lives) and reads
stored tensors on demand; decoding trellis units into weights is convert's job (convert/dequant: `read_exl3`,
`open_dequant`), as formats do not import the quantizer. `verify_exl3(path)` re-reads every shard and lists
problems (missing / unexpected tensors, wrong shape or dtype, a broken index) and checks the directory's seal
(formats/exl3_seal: every file's sha256, the manifest's own digest, the JSON files against the tensors).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from mixq.errors import FormatError, InputError
from mixq.formats.exl3_names import Exl3Unit
from mixq.formats.exl3_seal import (INDEX, MANIFEST, consistency_problems, file_problems, is_sealed,
                                    manifest_problems)
from mixq.formats.exl3_writer import torch_dtype
from mixq.formats.model_files import check_model_dir, model_file
from mixq.formats.safetensors_io import dtype_tag, load_tensor, tensor_entries


def _load_json(p: Path, what: str) -> dict:
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise FormatError(f"{p.parent}: not an EXL3 directory written by mixq ({p.name} missing)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise FormatError(f"{p}: unreadable {what} ({e})") from None


def _units(manifest: dict) -> list[Exl3Unit]:
    out = []
    for d in manifest["units"]:
        out.append(Exl3Unit(key=d["key"], kind=d["kind"], hf_names=list(d["hf_names"]), shape=tuple(d["shape"]),
                            role=d["role"], stage=d["stage"], bits_key=d.get("bits_key"), dtype=d.get("dtype"),
                            bias=d.get("bias"), pad_to=d.get("pad_to", 128), split=list(d.get("split") or []),
                            src_shapes=[tuple(s) for s in d.get("src_shapes") or [d["shape"]]]))
    return out


class Exl3Dir:
    """An opened EXL3 directory: config, manifest, and lazy access to every stored tensor."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise InputError(f"{self.path}: not a directory")
        check_model_dir(self.path)  # an untrusted directory: no link may lead out of it
        self.config = _load_json(self.path / "config.json", "config.json")
        qc = self.config.get("quantization_config") or {}
        if qc.get("quant_method") != "exl3":
            raise FormatError(f"{self.path}/config.json: quantization_config.quant_method is not 'exl3'")
        self.manifest = _load_json(self.path / MANIFEST, "manifest")
        self.units = _units(self.manifest)
        self.bits = {d["key"]: d.get("bits") for d in self.manifest["units"]}
        self.stored: dict[str, tuple[str, tuple[int, ...]]] = {}  # tensor -> (dtype tag, shape)
        self.where: dict[str, str] = {}
        for shard in sorted(self.manifest.get("shards", {})):
            p = model_file(self.path, shard, f"{self.path / MANIFEST}: shards")
            if not p.exists():
                continue
            for n, tag, shape in tensor_entries(p):
                self.stored[n] = (tag, shape)
                self.where[n] = shard

    def tensor(self, name: str) -> torch.Tensor:
        shard = self.where.get(name)
        if shard is None:
            raise FormatError(f"{self.path}: tensor {name!r} is not in any shard")
        return load_tensor(self.path / shard, name)

    def unit_tensors(self, u: Exl3Unit) -> dict[str, torch.Tensor]:
        return {n: self.tensor(n) for n in u.tensor_specs(self.bits.get(u.key))}


def verify_exl3(path: str | Path) -> dict:
    """Re-read an EXL3 directory (seal, shards, index, every planned tensor's dtype and shape, the JSON files
    against the tensors); returns {"ok", "problems": [...], "tensors", "shards", "quantized", "bytes", "bits",
    "sealed_files"}. Each problem is one line naming the file (and key or tensor). "quantized" counts decoded
    units: 0 here, the trellis decode is convert's (convert/dequant.exl3_decode_check, run by `mixq verify`)."""
    d = Exl3Dir(path)
    shards = d.manifest.get("shards", {})
    problems = manifest_problems(d.manifest)
    files, sealed = file_problems(d.path, d.manifest)
    problems += files
    if len(shards) > 1:
        if (d.path / INDEX).exists():
            try:
                wm = _load_json(d.path / INDEX, "index").get("weight_map", {})
            except FormatError as e:  # a damaged index is one problem, not the end of the report
                problems.append(str(e))
                wm = dict(d.where)  # no map to compare
            for n, s in d.where.items():
                if wm.get(n) != s:
                    problems.append(f"{INDEX}: maps {n} to {wm.get(n)}, it is in {s}")
        elif not is_sealed(d.manifest):  # a sealed index that is gone is named by file_problems
            problems.append(f"{INDEX}: missing (several shards)")
    expected = d.manifest.get("expected", {})
    for n, spec in expected.items():
        shard = d.where.get(n)
        if shard is None:
            problems.append(f"tensor {n} missing")
            continue
        tag, shape = d.stored[n]
        if list(shape) != list(spec["shape"]) or tag != dtype_tag(torch_dtype(spec["dtype"])):
            problems.append(f"tensor {n}: stored {tag} {list(shape)}, planned {spec['dtype']} {spec['shape']}")
    for n in sorted(set(d.where) - set(expected)):
        problems.append(f"unexpected tensor {n}")
    problems += consistency_problems(d.path, d.config, d.units, d.bits, d.stored)
    return {"ok": not problems, "problems": problems, "path": str(d.path), "tensors": len(d.where),
            "shards": len(shards), "quantized": 0,
            "bytes": sum(int(s.get("bytes", 0)) for s in shards.values()),
            "bits": d.config["quantization_config"].get("bits"), "sealed_files": sealed}
