"""`mixq inspect FILE.gguf`: metadata, tensor types and sizes, and chat-template warnings of a GGUF (or split set),
so published files can be audited without loading them."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from mixq.errors import FormatError
from mixq.formats.chat_template import check_template
from mixq.formats.gguf_integrity import PREFIX as INTEGRITY_PREFIX
from mixq.formats.gguf_reader import read_gguf
from mixq.formats.receipt import read_receipt, receipt_summary

_BIG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.scores")


def _kv_summary(kv: dict) -> dict:
    out = {}
    for k, v in kv.items():
        if k.startswith("GGUF."):
            continue
        if k == "tokenizer.chat_template" and isinstance(v, str):
            out[k] = f"<{len(v)} chars>"
        elif isinstance(v, list) and (k in _BIG_ARRAYS or len(v) > 64):
            out[k] = f"<array of {len(v)}>"
        else:
            out[k] = v
    return out


def inspect_gguf(path: str | Path, tensors: bool = True) -> dict:
    """Summary of a GGUF (any writer's: mixq, llama-quantize, gguf-py): files, architecture, metadata (big arrays
    summarised), per-type tensor counts, bytes and bits per weight, whether mixq's seal is present, and the chat
    template's llama.cpp-compatibility warnings."""
    g = read_gguf(path)
    types: dict[str, dict] = {}
    params = 0
    rows = []
    for name, e in g.tensors.items():
        n = int(np.prod(e.shape)) if e.shape else 1
        params += n
        t = types.setdefault(e.qtype, {"tensors": 0, "params": 0, "bytes": 0})
        t["tensors"] += 1
        t["params"] += n
        t["bytes"] += e.n_bytes
        rows.append({"name": name, "type": e.qtype, "shape": list(e.shape), "bytes": e.n_bytes, "shard": e.shard})
    total = sum(t["bytes"] for t in types.values())
    for t in types.values():
        t["bpw"] = round(8.0 * t["bytes"] / max(t["params"], 1), 4)
    warnings: list[str] = []
    tmpl = g.kv.get("tokenizer.chat_template")
    if tmpl is not None and not isinstance(tmpl, str):
        raise FormatError(f"{g.paths[0]}: key 'tokenizer.chat_template' is not a string ({type(tmpl).__name__})")
    if tmpl:
        try:
            warnings = [str(i) for i in check_template(tmpl)]
        except FormatError as e:
            warnings = [str(e)]
    d = {
        "path": str(g.paths[0]), "format": "gguf", "files": [str(p) for p in g.paths],
        "architecture": g.kv.get("general.architecture"), "file_type": g.kv.get("general.file_type"),
        "tensors": len(g.tensors), "params": params, "bytes": total, "bpw": round(8.0 * total / max(params, 1), 4),
        "types": dict(sorted(types.items())), "chat_template": bool(tmpl), "chat_template_warnings": warnings,
        # written by mixq (sealed) or by anyone else (llama-quantize, gguf-py): both read the same
        "mixq_seal": any(k.startswith(INTEGRITY_PREFIX) for k in g.kv),
        "metadata": _kv_summary(g.kv),
    }
    # one-line strings for the plain-text `mixq inspect` view (lists/dicts are JSON-only there)
    d["type_summary"] = ", ".join(f"{t} x{v['tensors']} ({v['bytes'] / 1e6:.2f} MB)" for t, v in d["types"].items())
    d["template_check"] = "; ".join(warnings) if warnings else ("ok" if tmpl else "no template")
    receipt = read_receipt(g.kv)  # how a mixq file was made (formats/receipt.py); None for other writers' files
    d["receipt"] = receipt
    d["receipt_summary"] = receipt_summary(receipt) if receipt else "none (not written by mixq's converter)"
    for k in ("block_count", "expert_count", "nextn_predict_layers"):
        v = g.kv.get(f"{d['architecture']}.{k}")
        if v is not None:
            d[k] = v
    if tensors:
        d["tensor_list"] = rows
    return d
