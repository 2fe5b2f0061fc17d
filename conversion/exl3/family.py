"""A family of EXL3 directories from one pass: `mixq convert MODEL OUT_DIR --format exl3 --bpw x,y,z` (or --size).

Steps: check every member's target with the planner and every member's directory before any work -> one set of
error curves, the family's calibration (`--measure FILE` as given, else the trellis curves measured once into
`OUT_DIR/<model>.exl3-curves.json` and kept for reruns) -> each member planned from those curves and converted
through the single-conversion path (conversion/exl3/pipeline.run_exl3), so a member's bytes are those of
`mixq convert MODEL DIR --bpw x --measure OUT_DIR/<model>.exl3-curves.json` -> `family.json`.
Members are named `<model>-exl3-<label>/` (label `<x>bpw` or the size as written). family.json is rewritten after
every member, so a rerun keeps the members already finished for the same target, options, calibration and curves
(their seal checked) and continues an interrupted one (its job, as --resume does).

Each member's receipt (formats/receipt.FIELDS) is `OUT_DIR/<member>.receipt.json` beside its directory: inside
it every file is sealed by mixq_manifest.json, and an unsealed JSON file there would fail `mixq verify`.

What one pass shares: the curves (the measurement that decides every member's bits; the costly part of a measured
plan). What it cannot share: each member's decoder layers are calibrated on the hidden states of that member's own
quantized layers (as exllamav3 does), so its Hessians, and every trellis encode, are its own.
"""
from __future__ import annotations

import time
from pathlib import Path

from tqdm import tqdm

from mixq.conversion.gguf.family import CLOSE, FAMILY_JSON, FAMILY_VERSION, FamilyResult
from mixq.conversion.gguf.receipt import cached_file_sha256, receipt_options
from mixq.formats.receipt import mixq_version
from mixq.conversion.job import JOB_DIR
from mixq.measurement.streaming import stream_curves
from mixq.measurement.trellis import MEASURE_MODES, curves_meta, load_curves, resolve_measure, save_curves
from mixq.conversion.options import FamilyOptions, FamilyTarget
from mixq.formats.outputs import check_output_dir
from mixq.conversion.exl3.pipeline import run_exl3
from mixq.errors import InputError, MixqError, escape
from mixq.formats.atomic import write_json
from mixq.formats.checkpoint import open_checkpoint
from mixq.formats.exl3_reader import Exl3Dir, verify_exl3
from mixq.formats.exl3_seal import CONFIG, MANIFEST, units_per_rate
from mixq.formats.receipt import read_receipt_json, receipt_json_path, write_receipt_json
from mixq.planning.planner import plan_model
from mixq.formats.model_files import read_json

CURVES_SUFFIX = ".exl3-curves.json"


def member_dir(out_dir: Path, model_name: str, target: FamilyTarget) -> Path:
    """`OUT_DIR/<model>-exl3-<label>` (the ecosystem names EXL3 quants by their bitrate the same way)."""
    return Path(out_dir) / f"{model_name}-exl3-{target.label}"


def run_exl3_family(model, out_dir, fam: FamilyOptions) -> FamilyResult:
    """Convert `model` to every EXL3 member of `fam` in `out_dir` (see the module doc). Every target is planned and
    every member directory checked before the curves are measured."""
    t0 = time.time()
    out = Path(out_dir)
    if out.suffix.lower() == ".gguf":
        raise InputError(f"OUT {out}: an EXL3 family is written into a directory; name it without .gguf")
    if out.exists() and not out.is_dir():
        raise InputError(f"OUT {out} is a file; a family is written into a directory")
    base = fam.base
    ckpt = open_checkpoint(model)
    name = Path(str(model).rstrip("/")).name  # a hub id's repo name, not its snapshot directory
    members = [(t, member_dir(out, name, t)) for t in fam.targets]
    for t, _ in members:  # a target the planner refuses is refused before any work
        _member_plan(ckpt, base, t)
    previous = _previous_rows(out)
    curves_path, curves_info = _curves_source(out, name, base)
    options, calibration = family_options_record(base), calibration_info(base)
    states = [_member_state(path, t, options, calibration, curves_info, previous) for t, path in members]
    out.mkdir(parents=True, exist_ok=True)
    curves = _curves(ckpt, base, curves_path, curves_info)
    doc = {"version": FAMILY_VERSION, "format": "exl3", "model": name, "ref_params": ckpt.params,
           "curves": curves_info, "calibration": calibration, "options": options, "members": []}
    done = {t.label: dict(previous[t.label], kept=True) for (t, _), s in zip(members, states) if s == "kept"}
    fj = out / FAMILY_JSON
    for i, ((t, path), state) in enumerate(zip(members, states)):
        if state == "kept":
            if not receipt_json_path(path).is_file():  # deleted since: written again from family.json
                _write_receipt(path, name, t, done[t.label], calibration, curves_info, options)
            continue
        if base.progress:
            tqdm.write(f"family member {i + 1}/{len(members)}: {escape(path.name)}")
        res = run_exl3(model, path, fam.member(t, measure=curves, resume=state == "resume"))
        done[t.label] = _row(res.to_dict(), path, t, options, calibration, curves_info)
        _write_receipt(path, name, t, done[t.label], calibration, curves_info, options)
        # after every member: an interrupted run leaves the finished members listed, to be kept by the next
        write_json(fj, dict(doc, members=[done[u.label] for u, _ in members if u.label in done]))
    rows = [done[t.label] for t, _ in members]
    write_json(fj, dict(doc, members=rows))
    return FamilyResult(str(out), rows, None, {"dir": None, "hits": 0, "writes": 0, "entries": 0},
                        time.time() - t0, str(fj), [str(out / r["file"]) for r in rows], format="exl3",
                        curves=curves_info)


def family_options_record(base) -> dict:
    """The options that decide a member's bytes, as family.json records them: the receipt's, less --measure (the
    curves are recorded on their own, by sha256, whether given or measured)."""
    return {k: v for k, v in receipt_options(base).items() if k != "measure"}


def calibration_info(base) -> dict:
    """The layer calibration every member runs on its own: the text files (name and sha256; none: the built-in
    sample) and rows x seq_len tokens. Part of what decides a member's bytes, so a rerun compares it."""
    files = [{"file": Path(f).name, "sha256": cached_file_sha256(f)} if Path(f).is_file() else {"file": str(f)}
             for f in base.calibration]
    return {"files": files or [{"file": "builtin"}], "rows": base.rows, "seq_len": base.seq_len}


def _member_plan(ckpt, base, t: FamilyTarget):
    """The member's plan by roles: the check every target passes before the curves are measured."""
    return plan_model(ckpt, "exl3", **{t.kind: t.value}, overrides=base.overrides, head_bits=base.head_bits,
                      mtp_bits=base.mtp_bits, vision_bits=base.vision_bits, include_mtp=base.include_mtp)


def _curves_source(out: Path, name: str, base) -> tuple[Path | None, dict]:
    """Where the family's curves come from: --measure FILE (or curves given in memory), else
    OUT_DIR/<model>.exl3-curves.json (measured now, or kept from an earlier run: delete it to measure again)."""
    m = base.measure
    if isinstance(m, (str, Path)) and str(m) not in MEASURE_MODES:
        p = Path(m)
        if not p.is_file():
            raise InputError(f"--measure {p}: file not found")
        return p, {"file": p.name, "sha256": cached_file_sha256(p), "measured": False}
    if m is not None and not isinstance(m, (str, Path)):  # a mapping: named by the digest receipt_options gives it
        return None, {"file": "in-memory", "sha256": receipt_options(base)["measure"]["sha256"], "measured": False}
    if m == "kld":
        raise InputError("--measure kld runs the model end to end: measure with `mixq plan MODEL --format exl3 "
                         "--measure kld --measure-out CURVES.json`, then give the family --measure CURVES.json")
    path = out / f"{name}{CURVES_SUFFIX}"
    if path.exists() and not path.is_file():
        raise InputError(f"{path} exists and is not a curves file; remove it")
    info = {"file": path.name, "method": str(m or "trellis"), "measured": not path.is_file()}
    if path.is_file():  # kept from an earlier run: its own record says how it was measured
        info["sha256"] = cached_file_sha256(path)
        info["method"] = _measured_with(path) or info["method"]
    return path, info


def _measured_with(path: Path) -> str | None:
    """The method a curves file records (save_curves writes it), None when it records none."""
    method = curves_meta(path).get("method")
    return str(method) if method else None


def _curves(ckpt, base, path: Path | None, info: dict) -> dict:
    """The curves every member is planned from (measured here when the family has none yet)."""
    if path is None:
        return resolve_measure(ckpt, base.measure, "exl3")
    if info.get("measured") and info["method"] == "stream":
        curves = stream_curves(ckpt, "exl3", list(base.calibration) or None, device=base.device,
                               progress=base.progress)
        save_curves(curves, path, meta={"model": str(ckpt.path), "method": "stream"})
    elif info.get("measured"):
        resolve_measure(ckpt, info["method"], "exl3", calibration=list(base.calibration) or None,
                        measure_out=str(path), device=base.device, progress=base.progress)
        info["sha256"] = cached_file_sha256(path)
    return load_curves(path)


def _previous_rows(out: Path) -> dict[str, dict]:
    """The members an earlier run of an EXL3 family in `out` recorded, by label ({} when there is none to read)."""
    try:
        doc = read_json(out / FAMILY_JSON, FAMILY_JSON)
        return {r["label"]: r for r in doc["members"] if isinstance(r, dict) and "label" in r} \
            if doc.get("format") == "exl3" else {}
    except (InputError, KeyError, TypeError, AttributeError):
        return {}


def _member_state(path: Path, t: FamilyTarget, options: dict, calibration: dict, curves: dict,
                  previous: dict[str, dict]) -> str:
    """"new" (convert it), "resume" (an interrupted conversion of it is there) or "kept" (finished for the same
    target, options, calibration and curves, seal intact); InputError when the directory holds anything else."""
    if (path / JOB_DIR / "job.json").is_file():
        return "resume"  # Job.open refuses a job of other settings
    if path.is_file() or (path.is_dir() and any(path.iterdir())):
        prev = previous.get(t.label) or {}
        same = prev.get("options") == options and prev.get("calibration") == calibration \
            and curves.get("sha256") is not None and prev.get("curves_sha256") == curves.get("sha256")
        if same and (path / MANIFEST).is_file() and (path / CONFIG).is_file() and _sealed(path):
            return "kept"
        raise InputError(f"OUT {path} already exists and is not this family's member for --{t.kind} {t.label} "
                         "(with these options and curves); remove it to convert it again")
    check_output_dir(path)
    return "new"


def _sealed(path: Path) -> bool:
    try:
        return bool(verify_exl3(path)["ok"])
    except (MixqError, OSError, ValueError):
        return False


def _row(res: dict, path: Path, t: FamilyTarget, options: dict, calibration: dict, curves: dict) -> dict:
    """One member of family.json from its ConvertResult dict. `bpw` is the achieved trellis rate (how EXL3
    quants are named and what quantization_config records); `file_bpw` is the directory's bytes x 8 / params."""
    nbytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    ref = res.get("ref_params")
    row = {"file": path.name, "files": [path.name], "label": t.label,
           "target_bytes": int(t.value) if t.kind == "size" else None,
           "target_bpw": float(t.value) if t.kind == "bpw" else None,
           "bytes": nbytes, "bpw": res["bits"], "file_bpw": nbytes * 8 / ref if ref else None,
           "head_bits": res["head_bits"], "plan": {"tensor_bytes": res["bytes"], "tensors": res["tensors"],
                                                   "quantized": res["quantized"], "rates": _rates(path)},
           "seconds": round(res["seconds"], 2), "kept": False, "note": None,
           "options": options, "calibration": calibration, "curves_sha256": curves.get("sha256")}
    if t.kind == "size":
        gap = (t.value - nbytes) / t.value
        row["under_target"] = gap
        row["within_0.1%"] = 0 <= gap <= CLOSE
        if gap < 0:
            row["note"] = f"{-gap:.3%} above the target"
    return row


def _rates(path: Path) -> dict[str, int]:
    """Trellis units per rate of the member directory (what its receipt records and `mixq verify` checks)."""
    d = Exl3Dir(path)
    return units_per_rate(d.units, d.stored)


def _write_receipt(path: Path, name: str, t: FamilyTarget, row: dict, calibration: dict, curves: dict,
                   options: dict) -> None:
    """`<member>.receipt.json` beside the member (its scores, once evaluated, are kept when it is rewritten)."""
    old = read_receipt_json(path)
    receipt = {"mixq": mixq_version(), "source": name, "target": {t.kind: t.value},
               "plan": {"tensor_bytes": row["plan"]["tensor_bytes"], "bpw": row["bpw"],
                        "rates": row["plan"].get("rates") or {}},
               "calibration": {"layers": calibration,
                               "curves": {k: curves[k] for k in ("file", "sha256", "method") if k in curves}},
               "options": options}
    write_receipt_json(path, receipt, (old or {}).get("scores"))
