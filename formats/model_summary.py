"""`mixq inspect`: what a checkpoint holds, by role (its JSON shape is pinned), a GGUF file's summary, or an EXL3
directory's units and rates (written by mixq or by anyone)."""
from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path

from mixq.errors import InputError
from mixq.formats.checkpoint import Checkpoint, checkpoint_from_config, open_checkpoint
from mixq.formats.exl3_reader import Exl3Dir
from mixq.formats.gguf_inspect import inspect_gguf
from mixq.formats.glm5next import ROLES
from mixq.formats.model_files import check_model_dir, read_json
from mixq.formats.receipt import read_receipt_json, receipt_summary


def inspect_checkpoint(ckpt: Checkpoint) -> dict:
    """Summary dict of an opened checkpoint: every tensor with its role, and per-role counts/params/bytes."""
    tensors = []
    roles = {r: {"tensors": 0, "params": 0, "bytes": 0} for r in ROLES}
    dtypes: Counter[str] = Counter()
    for name in ckpt.names():
        info = ckpt.info(name)
        shape = ckpt.shape(name)
        dt = ckpt.source_dtype(name)
        dtypes[dt] += 1
        tensors.append({"name": name, "shape": list(shape), "dtype": dt, "role": info.role,
                        "layer": info.layer, "mtp": info.mtp})
        agg = roles[info.role]
        agg["tensors"] += 1
        agg["params"] += ckpt.numel(name)
        agg["bytes"] += ckpt.nbytes(name)
    tc = ckpt.text_config
    vc = ckpt.config.get("vision_config") or {}
    return {
        "path": str(ckpt.path),
        "model_type": ckpt.config.get("model_type") or tc.get("model_type"),
        "num_hidden_layers": ckpt.num_hidden_layers,
        "layer_types": ckpt.layer_types,
        "mlp_layer_types": tc.get("mlp_layer_types"),
        "nextn_layers": ckpt.nextn_layers,
        "experts": {"routed": tc.get("n_routed_experts"), "per_token": tc.get("num_experts_per_tok"),
                    "shared": tc.get("n_shared_experts")},
        "vision_depth": vc.get("depth"),
        "shapes_only": ckpt.shapes_only,
        "source_dtypes": dict(dtypes),
        "params": ckpt.params,
        "bytes": sum(r["bytes"] for r in roles.values()),
        "tensors": tensors,
        "roles": {r: v for r, v in roles.items() if v["tensors"]},
    }


def inspect_model(path: str | os.PathLike) -> dict:
    """Inspect a model directory / hub repo id, or a bare config.json (shapes only)."""
    p = Path(path)
    if p.suffix == ".json" and p.is_file():
        return inspect_checkpoint(checkpoint_from_config(p))
    return inspect_checkpoint(open_checkpoint(path))


def is_exl3_dir(path: str | os.PathLike) -> bool:
    """True for a directory whose config.json says quantization_config.quant_method "exl3" (a config that does
    not parse is left to the checkpoint reader, which names the error)."""
    p = Path(path)
    if not p.is_dir() or not (p / "config.json").is_file():
        return False
    check_model_dir(p)  # an untrusted directory: its config.json may not lead out of it
    try:
        qc = read_json(p / "config.json", "config.json").get("quantization_config")
    except (InputError, AttributeError):
        return False  # the checkpoint reader names what is wrong
    return isinstance(qc, dict) and qc.get("quant_method") == "exl3"


def inspect_exl3(path: str | os.PathLike) -> dict:
    """Summary of an EXL3 directory: who wrote it, its units by kind, the rate and codebook of every quantized
    Linear (per budget key: bits, head_bits, mtp_bits, vision_bits; 16 = an fp16 Linear), bytes and bpw; and
    the receipt (and scores) of `<dir>.receipt.json` beside it when there is one (a family member's)."""
    d = Exl3Dir(path)
    qc = {k: v for k, v in d.config["quantization_config"].items() if k != "original_quantization_config"}
    kinds: Counter[str] = Counter(u.kind for u in d.units)
    codebooks: Counter[str] = Counter(u.marker or "3inst" for u in d.units if u.kind == "trellis")
    rates: dict[str, dict] = {}
    rows, params = [], 0
    for u in d.units:
        params += math.prod(u.shape)
        bits = d.bits.get(u.key) if u.kind == "trellis" else 16.0 if u.kind == "fp16_linear" else None
        if u.bits_key and bits is not None:
            k, n = u.padded
            r = rates.setdefault(u.bits_key, {"units": 0, "weights": 0, "bits": 0.0})
            r["units"] += 1
            r["weights"] += k * n  # padded, as exllamav3 counts a Linear's rate
            r["bits"] += bits * k * n
        rows.append({"key": u.key, "kind": u.kind, "role": u.role, "stage": u.stage, "shape": list(u.shape),
                     "bits": bits, "codebook": (u.marker or "3inst") if u.kind == "trellis" else None})
    for r in rates.values():
        r["bpw"] = round(r.pop("bits") / r["weights"], 4) if r["weights"] else None
    size = sum((d.path / s).stat().st_size for s in d.shards if (d.path / s).is_file())
    version = qc.get("version")
    writer = "mixq" if d.has_manifest or qc.get("quantizer") == "mixq" else \
        f"exllamav3 {version}" if version else "unknown"
    out = {
        "path": str(d.path), "format": "exl3", "writer": writer, "mixq_manifest": d.has_manifest,
        "quantization_config": qc, "shards": len(d.shards), "tensors": len(d.stored), "units": len(d.units),
        "params": params, "bytes": size, "bpw": round(8.0 * size / max(params, 1), 4),
        "kinds": dict(sorted(kinds.items())), "codebooks": dict(sorted(codebooks.items())), "rates": rates,
        # one-line strings for the plain-text `mixq inspect` view (lists/dicts are JSON-only there)
        "unit_summary": ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())),
        "rate_summary": ", ".join(f"{k} {r['bpw']:g} ({r['units']} units)" for k, r in rates.items()),
        "codebook_summary": ", ".join(f"{k} x{v}" for k, v in sorted(codebooks.items())) or "none",
        "unit_list": rows,
    }
    side = read_receipt_json(d.path)  # a family member's receipt lies beside its sealed directory
    if side is not None:
        out["receipt"], out["scores"] = side["receipt"], side.get("scores") or {}
        out["receipt_summary"] = receipt_summary(side["receipt"])
    return out


def inspect_path(path: str | os.PathLike) -> dict:
    """Dispatch on what ``path`` is: a ``.gguf`` file (formats/gguf_inspect), an EXL3 directory, or an HF
    checkpoint."""
    if str(path).endswith(".gguf"):
        return inspect_gguf(path)
    if is_exl3_dir(path):
        return inspect_exl3(path)
    return inspect_model(path)


def _human(n: float, unit: str = "") -> str:
    for suf in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or suf == "T":
            return f"{n:.0f}{unit}" if suf == "" else f"{n:.2f}{suf}{unit}"
        n /= 1000
    return str(n)


def _runs(items: list[str]) -> str:
    """Compress a list into 'a×3 b×1' runs; a repeating pattern becomes '(a×3 b×1)×11 a×1'."""
    n = len(items)
    for p in range(2, n // 2 + 1):
        reps = n // p
        if reps >= 2 and items[: p * reps] == items[:p] * reps and items[p * reps:] == items[: n - p * reps]:
            if len(set(items[:p])) > 1:
                tail = _runs(items[p * reps:]) if p * reps < n else ""
                return f"({_runs(items[:p])})×{reps}" + (f" {tail}" if tail else "")
    out: list[list] = []
    for x in items:
        if out and out[-1][0] == x:
            out[-1][1] += 1
        else:
            out.append([x, 1])
    return " ".join(f"{x}×{k}" for x, k in out)


def format_report(d: dict) -> str:
    """Readable table of ``inspect_model``'s dict (for checkpoints; other dicts are printed key: value)."""
    if "roles" not in d or "layer_types" not in d:
        return "\n".join(f"{k}: {v}" for k, v in d.items() if not isinstance(v, (list, dict)))
    short = {"linear_attention": "KDA", "deepseek_sparse_attention": "DSA"}
    ex = d["experts"]
    lines = [
        f"model        {d['path']}{'  (shapes only)' if d['shapes_only'] else ''}",
        f"model_type   {d['model_type']}",
        f"layers       {d['num_hidden_layers']}: {_runs([short.get(t, t) for t in d['layer_types']])}",
    ]
    if d.get("mlp_layer_types"):
        lines.append(f"mlp          {_runs(d['mlp_layer_types'])}")
    lines += [
        f"experts      {ex['routed']} routed, top-{ex['per_token']}, {ex['shared']} shared",
        f"nextn        {d['nextn_layers'] or 'none'}",
        f"vision       {'depth ' + str(d['vision_depth']) if d['vision_depth'] else 'none'}",
        f"dtypes       {', '.join(f'{k} ×{v}' for k, v in d['source_dtypes'].items())}",
        f"tensors      {len(d['tensors'])}   params {d['params']:,} ({_human(d['params'])})   "
        f"bytes {_human(d['bytes'], 'B')}",
        "",
        f"{'role':<14}{'tensors':>9}{'params':>18}{'bytes':>12}{'share':>8}",
    ]
    for role, r in d["roles"].items():
        share = 100 * r["params"] / d["params"] if d["params"] else 0.0
        lines.append(f"{role:<14}{r['tensors']:>9}{r['params']:>18,}{_human(r['bytes'], 'B'):>12}{share:>7.1f}%")
    return "\n".join(lines)
