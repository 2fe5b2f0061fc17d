"""A family of GGUFs from one pass: `mixq convert MODEL OUT_DIR --format gguf --size A,B,C` (or `--bpw x,y,z`).

Steps: check every member's target with the planner and every member's output before any work -> one
calibration (the --imatrix given, else one imatrix computed into `OUT_DIR/<model>.imatrix.gguf`, kept for
reruns) -> each member through the single-conversion path (conversion/gguf/pipeline.run_gguf) with one shared
content-addressed encode cache (measurement/encode_cache, `OUT_DIR/.mixq-cache/`): a (tensor, type) that an earlier
member (or an interrupted earlier run) encoded is read back instead of encoded again -> `family.json`.
Because the writer path is the single conversion's own, with only the encode step served from the cache, a
member's bytes are those of `mixq convert MODEL x.gguf --size A --imatrix OUT_DIR/<model>.imatrix.gguf`.
Members are named `<model>-<label>.gguf` (label: the size as written, e.g. 108GB, or `<x>bpw`; split sets
`<model>-<label>-0000i-of-0000N.gguf`). A rerun keeps the members already written for the same target, options
and imatrix (their seal checked) and serves the rest from the cache.
With --rounding hessian each member runs its own calibration pass: the Hessian-rounded codes are tuned on the
member's own quantized streams, so they are neither shared nor cached (the ggml-encoded tensors still are).

Plans: by roles (the default), or from measured curves. `--measure FILE` plans every member from FILE. `--measure
kld` measures them once, after the imatrix, into `OUT_DIR/<model>.gguf-curves.json` (kept for reruns: delete it to
measure again) with that imatrix, calibration and ladder: every tensor encoded in every type of its ladder
(measurement/gguf_errors), each exact encode stored in the family's cache under the key the conversion computes, so
every member's encode of a budgeted tensor is a cache hit and a member costs about its write (the measurement is
measurement/kld.family_curves, by the method the curves file records). The members' bytes are those of
`mixq convert MODEL x.gguf --size A --imatrix ... --measure OUT_DIR/<model>.gguf-curves.json`.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from tqdm import tqdm

from mixq.measurement.encode_cache import CACHE_DIR, EncodeCache
from mixq.conversion.gguf.pipeline import run_gguf
from mixq.conversion.gguf.receipt import cached_file_sha256, receipt_options, receipt_target
from mixq.conversion.gguf.imatrix import make_imatrix
from mixq.measurement.kld import family_curves
from mixq.measurement.trellis import END_TO_END, MEASURE_MODES, load_curves
from mixq.conversion.options import FamilyOptions, FamilyTarget
from mixq.formats.outputs import check_output_file
from mixq.errors import InputError, MixqError, escape
from mixq.formats.atomic import write_json
from mixq.formats.checkpoint import open_checkpoint
from mixq.formats.gguf_integrity import integrity_problems
from mixq.formats.gguf_reader import read_gguf
from mixq.formats.gguf_writer import output_set
from mixq.formats.receipt import read_receipt
from mixq.planning import gguf_mix as gm
from mixq.planning.gguf_measured import measured_units
from mixq.planning.planner import plan_model

# measures a GGUF family's curves end to end into the JSON file at `out` (the format --measure FILE reads), its exact
# encodes stored in `cache`: (ckpt, out, *, calibration, imatrix, ladder, rounding, device, cache, progress,
# method) -> None; measurement/kld.family_curves unless a caller gives another
CurveMeasurer = Callable[..., None]
CURVES_SUFFIX = ".gguf-curves.json"
FAMILY_JSON = "family.json"
FAMILY_VERSION = 1
CLOSE = 0.001  # a size member within 0.1% of its target (below it, never above)


@dataclass
class FamilyResult:
    """What a family conversion wrote: `members` (the rows of family.json), the imatrix, the cache use."""
    out: str
    members: list[dict]
    imatrix: dict | None
    cache: dict
    seconds: float
    family_json: str
    files: list[str] = field(default_factory=list)
    format: str = "gguf"
    curves: dict | None = None  # EXL3: where the members' curves came from

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        lines = [f"{self.format.upper()} family of {len(self.members)} written to {self.out} ({self.family_json})"]
        for m in self.members:
            target = f"{m['target_bytes']:,} B" if m.get("target_bytes") else f"{m.get('target_bpw')} bpw"
            note = f"  ({m['note']})" if m.get("note") else ""
            lines.append(f"  {m['file']:<40} {m['bytes']:>14,} B  {m['bpw']:.3f} bpw  target {target}"
                         f"{'  kept' if m.get('kept') else ''}{note}")
        if self.curves is not None:
            how = "measured now" if self.curves.get("measured") else \
                "kept from an earlier run" if self.curves.get("method") else "given"
            lines.append(f"  curves     {self.curves.get('file')} ({how}): every member planned from them")
        if self.format == "gguf":
            lines.append(f"  cache      {self.cache['hits']} tensors served, {self.cache['writes']} encoded into "
                         f"{self.cache['dir']}")
        lines.append(f"  time       {self.seconds:.1f} s")
        lines.append(f"next: mixq eval MODEL {self.out} --text HELD_OUT.txt   |   mixq card {self.out}")
        return "\n".join(lines)


def member_path(out_dir: Path, model_name: str, target: FamilyTarget) -> Path:
    """`OUT_DIR/<model>-<label>.gguf`."""
    return Path(out_dir) / f"{model_name}-{target.label}.gguf"


def run_family(model, out_dir, fam: FamilyOptions, measure_curves: CurveMeasurer = family_curves) -> FamilyResult:
    """Convert `model` to every member of `fam` in `out_dir` (see the module doc). Every target is planned and
    every output checked before the calibration starts. `measure_curves`: what measures `--measure kld` or
    `stream`'s curves (measurement/kld.family_curves)."""
    t0 = time.time()
    out = Path(out_dir)
    if out.suffix == ".gguf":
        raise InputError(f"OUT {out}: a family is written into a directory; name it without .gguf")
    if out.exists() and not out.is_dir():
        raise InputError(f"OUT {out} is a file; a family is written into a directory")
    ckpt = open_checkpoint(model)
    name = Path(str(model).rstrip("/")).name  # a hub id's repo name, not its snapshot directory
    members = [(t, member_path(out, name, t)) for t in fam.targets]
    base = fam.base
    curves_path, curves_info = _curves_source(out, name, base)
    planned_with = _check_curves(ckpt, base, curves_path, curves_info)
    for t, _ in members:  # a target the planner refuses is refused before any work
        plan_model(ckpt, "gguf", **{t.kind: t.value}, overrides=base.overrides, include_mtp=base.include_mtp,
                   gguf_ladder=base.gguf_ladder or gm.DEFAULT_LADDER, measure=planned_with, imatrix_given=True,
                   **({"head_bits": base.head_bits} if base.head_bits is not None else {}),
                   **({"mtp_bits": base.mtp_bits} if base.mtp_bits is not None else {}))
    out.mkdir(parents=True, exist_ok=True)
    imatrix, im_info = _calibration(model, out, name, fam)
    cache = EncodeCache(out / CACHE_DIR)
    if curves_info is not None and curves_info.get("measured"):
        measure_curves(ckpt, curves_path, calibration=list(fam.imatrix_calibration or base.calibration) or None,
                       imatrix=imatrix, ladder=base.gguf_ladder or gm.DEFAULT_LADDER, rounding=base.rounding,
                       device=base.device, cache=cache, progress=base.progress, method=curves_info["method"])
        curves_info["sha256"] = cached_file_sha256(curves_path)
    measure = curves_path if curves_path is not None else base.measure
    todo, kept = [], []
    for t, path in members:
        opts = fam.member(t, imatrix=imatrix, measure=measure)
        if not base.overwrite and output_set(path):
            if not _finished(path, t, opts):
                raise InputError(f"OUT {path} already exists and is not this family's member for "
                                 f"--{t.kind} {t.label}; pass --overwrite to replace it")
            kept.append(t)
        else:
            check_output_file(path, overwrite=base.overwrite, suffix=".gguf")
        todo.append((t, path, opts))
    rows = []
    for i, (t, path, opts) in enumerate(todo):
        if t in kept:
            rows.append(_row_from_file(path, t, ckpt.params))
            continue
        if base.progress:
            tqdm.write(f"family member {i + 1}/{len(todo)}: {escape(path.name)}")
        res = run_gguf(model, path, opts, cache=cache)
        rows.append(_row(res.to_dict(), path, t))
    doc = {"version": FAMILY_VERSION, "format": "gguf", "model": name, "ref_params": ckpt.params,
           "imatrix": im_info, "curves": curves_info, "options": receipt_options(base), "members": rows}
    fj = out / FAMILY_JSON
    write_json(fj, doc)
    files = [f for r in rows for f in r["files"]]
    return FamilyResult(str(out), rows, im_info, {"dir": str(cache.root), "hits": cache.hits,
                                                  "writes": cache.writes, "entries": cache.entries()},
                        time.time() - t0, str(fj), [str(out / f) for f in files], curves=curves_info)


def _curves_source(out: Path, name: str, base) -> tuple[Path | None, dict | None]:
    """Where the members' curves come from: None (role plans), --measure FILE or a mapping (as given), or `--measure
    kld`: OUT_DIR/<model>.gguf-curves.json, measured now or kept from an earlier run."""
    m = base.measure
    if m is None:
        return None, None
    if isinstance(m, Mapping):
        return None, {"file": "in-memory", "sha256": receipt_options(base)["measure"]["sha256"], "measured": False}
    if str(m) in MEASURE_MODES and str(m) not in END_TO_END:
        raise InputError(f"--measure {m}: EXL3's measurement; a GGUF family measures with --measure stream or "
                         "kld, or give --measure FILE")
    if str(m) not in END_TO_END:
        p = Path(m)
        if not p.is_file():
            raise InputError(f"--measure {p}: file not found")
        return p, {"file": p.name, "sha256": cached_file_sha256(p), "measured": False}
    path = out / f"{name}{CURVES_SUFFIX}"
    if path.exists() and not path.is_file():
        raise InputError(f"{path} exists and is not a curves file; remove it")
    info = {"file": path.name, "method": str(m), "measured": not path.is_file()}
    if path.is_file():
        info["sha256"] = cached_file_sha256(path)
    return path, info


def _check_curves(ckpt, base, path: Path | None, info: dict | None) -> Mapping | None:
    """The curves to check the members' targets with before any work: the family's own when it has them, a flat
    stand-in over the measured units when they are still to be measured (what a target can reach does not depend
    on the errors), None for role plans."""
    if info is None:
        return None
    if path is None:
        return base.measure
    if not info.get("measured"):
        return load_curves(path)
    units = measured_units(ckpt, base.include_mtp, base.gguf_ladder or gm.DEFAULT_LADDER)
    return {name: {gm.type_bpw(t): 1.0 for t in types} for name, (_, types) in units.items()}


def _calibration(model, out: Path, name: str, fam: FamilyOptions) -> tuple[Path | object | None, dict | None]:
    """The family's one imatrix: --imatrix as given, else `OUT_DIR/<model>.imatrix.gguf` (computed now, or kept
    from an earlier run of this family: delete it to compute it again)."""
    base = fam.base
    if base.imatrix is not None:
        p = base.imatrix
        if isinstance(p, (str, Path)):
            return p, {"file": str(p), "sha256": cached_file_sha256(p), "computed": False}
        return p, {"file": "in-memory", "computed": False}
    path = out / f"{name}.imatrix.gguf"
    computed = not path.is_file()
    if computed:
        cal = list(fam.imatrix_calibration or base.calibration) or None
        rows = fam.imatrix_rows if fam.imatrix_calibration or base.rounding == "exact" else base.rows
        seq = fam.imatrix_seq_len if base.rounding == "exact" else base.seq_len
        make_imatrix(model, path, cal, rows=rows, seq_len=seq, device=base.device, progress=base.progress)
    return path, {"file": path.name, "sha256": cached_file_sha256(path), "computed": computed}


def _finished(path: Path, t: FamilyTarget, opts) -> bool:
    """Whether the existing `path` is this member: sealed and intact, with this target, options and imatrix."""
    try:
        g = read_gguf(path)
        r = read_receipt(g.kv) or {}
        problems, _ = integrity_problems(list(g.paths))
    except (MixqError, OSError, ValueError):
        return False
    im = (r.get("calibration") or {}).get("imatrix") or {}
    want_im = cached_file_sha256(opts.imatrix) if isinstance(opts.imatrix, (str, Path)) else None
    return (not problems and r.get("target") == receipt_target(opts) and r.get("options") == receipt_options(opts)
            and im.get("sha256") == want_im)


def _row(res: dict, path: Path, t: FamilyTarget) -> dict:
    """One member of family.json from its ConvertResult dict."""
    row = {"file": path.name, "files": [Path(f).name for f in res["files"]], "label": t.label,
           "target_bytes": int(t.value) if t.kind == "size" else None,
           "target_bpw": float(t.value) if t.kind == "bpw" else None,
           "bytes": res["file_bytes"], "bpw": res["file_bpw"],
           "plan": {"tensor_bytes": res["bytes"], "types": res["types"], "tensors": res["tensors"]},
           "seconds": round(res["seconds"], 2), "kept": False, "note": None}
    if t.kind == "size":
        gap = (t.value - row["bytes"]) / t.value
        row["under_target"] = gap
        row["within_0.1%"] = 0 <= gap <= CLOSE
        if gap < 0:  # the --size fit never lets this happen; reported, never hidden
            row["note"] = f"{-gap:.3%} above the target"
        elif gap > CLOSE:
            row["note"] = (f"{gap:.3%} below the target: the planner found no closer plan (the type ladder "
                           "is coarse for a model this small)")
    return row


def _row_from_file(path: Path, t: FamilyTarget, ref_params: int | None) -> dict:
    """A member kept from an earlier run: its row from the file itself."""
    g = read_gguf(path)
    nbytes = sum(p.stat().st_size for p in g.paths)
    r = read_receipt(g.kv) or {}
    plan = r.get("plan") or {}
    res = {"files": [str(p) for p in g.paths], "file_bytes": nbytes,
           "file_bpw": nbytes * 8 / ref_params if ref_params else None, "bytes": plan.get("tensor_bytes"),
           "types": plan.get("types"), "tensors": len(g.tensors), "seconds": 0.0}
    row = _row(res, path, t)
    row["kept"] = True
    return row
