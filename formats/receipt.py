"""The receipt every mixq GGUF carries: how it was made, under `mixq.receipt.*` metadata keys.

Keys (all STRING; JSON where the value is structured; llama.cpp skips keys it does not know):
  mixq.receipt.version      "1" (this layout)
  mixq.receipt.mixq         the mixq version that wrote the file
  mixq.receipt.source       the source checkpoint's directory name
  mixq.receipt.target       JSON: {"size": bytes} | {"bpw": x} | {"type": "Q4_K_M"}
  mixq.receipt.plan         JSON: {"tensor_bytes", "bpw", "types": {ggml type: tensors}}
  mixq.receipt.calibration  JSON: {"imatrix": {"file", "sha256", "datasets", "chunks", "chunk_size"}} and/or
                            {"hessian": {"files": [{"file", "sha256"}], "rows", "seq_len", "tune_iters"}};
                            {} when the file was made without calibration
  mixq.receipt.options      JSON: the options that decide the bytes (never threads / device / paths of outputs)
The per-tensor types are not repeated: they are in the file's own tensor infos. File names are stored without their
directory, so the bytes do not depend on where the inputs lie. The keys are written with the rest of the metadata,
before the integrity seal (formats/gguf_integrity) digests the header: the seal covers them. Figures known only
after an evaluation (KLD, top-1, PPL) are not in the GGUF (rewriting a sealed file would change its digests):
they go to `<file>.receipt.json` beside it (`write_receipt_json`) and to the family's family.json.

An EXL3 directory's receipt has the same fields, in `<dir>.receipt.json` beside the directory (inside it every
file is sealed by mixq_manifest.json, and an unsealed JSON file there fails `mixq verify`): its plan gives the
trellis rates ({"tensor_bytes", "bpw", "rates": {bits: units}}), its calibration {"layers": {"files", "rows",
"seq_len"}, "curves": {"file", "sha256", "method"}} (conversion/exl3/family.py writes it for every member).
"""
from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Mapping

from mixq.errors import InputError
from mixq.formats.atomic import write_json
from mixq.formats.gguf_writer import KV
from mixq.formats.model_files import read_json

PREFIX = "mixq.receipt."
LAYOUT = "1"
FIELDS = ("version", "mixq", "source", "target", "plan", "calibration", "options")
JSON_FIELDS = ("target", "plan", "calibration", "options")
RECEIPT_SUFFIX = ".receipt.json"



def mixq_version() -> str:
    """The installed mixq's version, as receipts and the encode cache record it."""
    try:
        return version("mixq")
    except PackageNotFoundError:
        return "unknown"

def _dumps(v: Any) -> str:
    """Canonical JSON (sorted keys, no spaces): the same receipt gives the same bytes."""
    return json.dumps(v, sort_keys=True, separators=(",", ":"), default=str)


def receipt_kv(receipt: Mapping[str, Any]) -> list[KV]:
    """The `mixq.receipt.*` KVs of a receipt dict with the keys of FIELDS (version is filled in)."""
    r = {"version": LAYOUT, **receipt}
    unknown = set(r) - set(FIELDS)
    if unknown:
        raise ValueError(f"receipt fields {sorted(unknown)} are not in {FIELDS}")
    return [KV(PREFIX + k, "STRING", _dumps(r[k]) if k in JSON_FIELDS else str(r[k])) for k in FIELDS if k in r]


def read_receipt(kv: Mapping[str, Any]) -> dict | None:
    """The receipt of a GGUF's metadata (`read_gguf(...).kv`), JSON fields decoded; None when it has none."""
    out: dict[str, Any] = {}
    for k, v in kv.items():
        if not k.startswith(PREFIX):
            continue
        name = k[len(PREFIX):]
        if name in JSON_FIELDS and isinstance(v, str):
            try:
                v = json.loads(v)
            except (ValueError, RecursionError):  # a foreign or damaged value: shown as stored
                pass
        out[name] = v
    return out or None


def receipt_summary(r: Mapping[str, Any]) -> str:
    """One line of `mixq inspect`: version, source, target, planned size and calibration."""
    target = r.get("target") or {}
    plan = r.get("plan") or {}
    cal = r.get("calibration") or {}
    parts = [f"mixq {r.get('mixq', '?')}", f"from {r.get('source', '?')}"]
    if target:
        parts.append("target " + ", ".join(f"{k}={v}" for k, v in target.items()))
    if plan.get("tensor_bytes"):
        parts.append(f"tensors {plan['tensor_bytes']:,} bytes")
    if "imatrix" in cal:
        im = cal["imatrix"]
        parts.append(f"imatrix {im.get('file')} ({im.get('chunks')} x {im.get('chunk_size')} tokens, "
                     f"sha256 {str(im.get('sha256', ''))[:12]})")
    if "hessian" in cal:
        h = cal["hessian"]
        parts.append(f"hessian rounding ({h.get('rows')} x {h.get('seq_len')} tokens)")
    if "layers" in cal:
        c = cal["layers"]
        parts.append(f"layers calibrated on {c.get('rows')} x {c.get('seq_len')} tokens")
    if "curves" in cal:
        c = cal["curves"]
        parts.append(f"planned from curves {c.get('file')} (sha256 {str(c.get('sha256', ''))[:12]})")
    if not cal:
        parts.append("no calibration")
    return "; ".join(parts)


def receipt_json_path(gguf: str | Path) -> Path:
    """`<file>.receipt.json` beside a GGUF (its first file for a split set) or an EXL3 directory."""
    p = Path(gguf)
    return p.with_name(p.name + RECEIPT_SUFFIX)


def read_receipt_json(path: str | Path) -> dict | None:
    """The `<file>.receipt.json` beside `path` ({"file", "receipt", "scores"}), None when there is none or it
    cannot be read as such."""
    try:
        doc = read_json(receipt_json_path(path), "receipt")
    except InputError:
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("receipt"), dict) else None


def write_receipt_json(gguf: str | Path, receipt: Mapping[str, Any], scores: Mapping[str, Any] | None) -> Path:
    """Write `<file>.receipt.json`: the file's receipt and, once evaluated, its scores (KLD mean / p99, top-1, PPL,
    the text and its sha256, the engine), atomically."""
    path = receipt_json_path(gguf)
    write_json(path, {"file": Path(gguf).name, "receipt": dict(receipt), "scores": dict(scores or {})})
    return path
