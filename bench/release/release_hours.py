"""GLM-5.3-Flash release hours from `--profile` files of a run on the rehearsal model (one layer of each kind).

    python bench/release/release_hours.py --rehearsal-config WORK/rehearsal/config.json \
        --run exl3=exl3-1.json,exl3-2.json --run imatrix=imatrix.json --absent imatrix:nextn,vision \
        --run gguf=gguf.json --absent gguf:vision --out bench/results/release_hours.json

Each `--run LABEL=FILE[,FILE...]` is one verb's run (several files: one run continued with --resume across calls,
their stages taken together). Its stages are priced by what they belong to:

- a decoder layer's stages by its kind, `{attention}-{mlp}` (kda = linear attention, dsa = DeepSeek sparse
  attention; dense or moe MLP), read from the profile's own `layers`; NextN blocks, the embedding, the head and the
  vision tower are kinds of their own. Each kind's measured seconds per layer (the mean over the rehearsal's layers
  of that kind, normally one) are counted ×N, N its number in the real model's config.json (`kind_counts`,
  computed from layer_types / mlp_layer_types / first_k_dense_replace / num_nextn_predict_layers and the vision
  config, never written here). That count is the only scaling of a layer's stages: a rehearsal layer has the real
  widths, so one layer costs what one real layer costs.
- whole-run stages (layer null: open, plan, scan, finalize, seal, write, ...): one that moved bytes (scan reads
  every weight, finalize and seal write the files) is scaled ×r_bytes, the real model's source bytes over the
  rehearsal's; one that moved none (open, plan: names, shapes and the plan, tensor by tensor) ×r_tensors, the
  real model's tensor count over the rehearsal's. Both come from the two config.json files through the checkpoint
  reader's shapes (every tensor at its storage type); the output names each stage's scale and why.
- peak host and GPU memory: the largest of any stage, not scaled (one layer is held at a time).

A kind the real model has that a run never measured is an error, not 0 s, unless the run is declared not to touch
it (`--absent LABEL:KIND,...`: imatrix runs no NextN block, a GGUF conversion no vision tower); declared kinds are
listed as such in the output. Time outside every stage (the total's seconds less the stages' sum) is reported, not
projected; overlapped stages (the EXL3 writes behind the next layer) are summed as if they were not, an upper bound.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Iterable, Mapping

HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(HERE), str(HERE.parent)) if p not in sys.path]

from paths import SHARED, repo_relative  # noqa: E402

from mixq.runtime.profile import check_profile, layer_kinds  # noqa: E402

ATTENTION = {"linear_attention": "kda", "deepseek_sparse_attention": "dsa"}
SINGLE = ("embed", "head", "vision")  # parts the model has once, whatever its depth
FLASH_CONFIG = SHARED / "models" / "glm-5.3-flash-shape" / "config.json"
SCALE_WHY = {
    "bytes": "a whole-run stage that moved bytes reads, checks or writes every tensor once: it scales with the "
             "model's source bytes, the real model's over the rehearsal's (both from config.json, storage types)",
    "tensors": "a whole-run stage that moved no bytes (names, shapes, the plan) walks the tensor list: it scales "
               "with the tensor count, the real model's over the rehearsal's (both from config.json)"}


class MissingKind(ValueError):
    """A kind the real model has and the run never measured (and was not declared absent)."""


def kind_of(layer: str, layers: Mapping[str, Mapping[str, str]]) -> str:
    """The kind a profile's layer label belongs to: "kda-dense", "kda-moe", "dsa-moe", ... for decoder layers,
    "nextn" for NextN blocks, the label itself for embed / head / vision."""
    if layer in SINGLE:
        return layer
    if layer == "nextn" or layer.startswith("nextn."):
        return "nextn"
    k = layers.get(layer)
    if k is None:
        raise ValueError(f"profile layer {layer!r} is not in the profile's layers")
    return f"{ATTENTION[k['attention']]}-{k['mlp']}"


def kind_counts(config: Mapping) -> dict[str, int]:
    """How many layers of each kind the model of `config` has (its layer kinds from runtime/profile.layer_kinds;
    one embedding and head; a vision tower when the config has one)."""
    layers = layer_kinds(config)
    counts = Counter(kind_of(label, layers) for label in layers)
    out = {"embed": 1, "head": 1, **dict(sorted(counts.items()))}
    if config.get("vision_config"):
        out["vision"] = 1
    return out


def merge(profiles: Iterable[Mapping]) -> dict:
    """One run's profiles (a run continued with --resume across calls) as one: stages in order, totals summed,
    peaks the largest; every profile must be of the same verb and format and describe the same layers."""
    ps = [check_profile(p) for p in profiles]
    if not ps:
        raise ValueError("no profile given")
    first = ps[0]
    for p in ps[1:]:
        for k in ("verb", "format", "layers"):
            if p[k] != first[k]:
                raise ValueError(f"profiles of one run differ in {k!r}: {first[k]!r} and {p[k]!r}")
    total = {k: sum(p["total"][k] for p in ps) for k in ("seconds", "bytes_read", "bytes_written")}
    total.update({k: max(p["total"][k] for p in ps) for k in ("peak_host_bytes", "peak_gpu_bytes")})
    return {**first, "stages": [s for p in ps for s in p["stages"]], "total": total,
            "device": sorted({p["device"] for p in ps})}


def project(profile: Mapping, counts: Mapping[str, int], scale: Mapping[str, float], *,
            absent: Iterable[str] = ()) -> dict:
    """The release seconds of one run (`profile`, merged) for a model with `counts` layers of each kind and
    whole-run stages ×`scale["bytes"]` (those that moved bytes) or ×`scale["tensors"]` (the others); every term
    named (module docstring). MissingKind for a kind with a count the run never measured, unless it is in
    `absent`."""
    absent = set(absent)
    layers = profile["layers"]
    per_kind: dict[str, dict[str, float]] = {}
    seen: dict[str, set[str]] = {}
    whole: dict[str, float] = {}
    moved: set[str] = set()
    for s in profile["stages"]:
        if s["layer"] is None:
            whole[s["stage"]] = whole.get(s["stage"], 0.0) + s["seconds"]
            if s["bytes_read"] or s["bytes_written"]:
                moved.add(s["stage"])
            continue
        kind = kind_of(s["layer"], layers)
        seen.setdefault(kind, set()).add(s["layer"])
        st = per_kind.setdefault(kind, {})
        st[s["stage"]] = st.get(s["stage"], 0.0) + s["seconds"]
    unknown = sorted(set(per_kind) - set(counts))
    if unknown:
        raise ValueError(f"the rehearsal measured kind {unknown[0]!r}, which the real model does not have")
    kinds, total = {}, 0.0
    for kind, n in counts.items():
        if n == 0:
            continue
        if kind not in per_kind:
            if kind in absent:
                kinds[kind] = {"count": n, "absent": "not run by this verb (declared)", "counted_seconds": 0.0}
                continue
            raise MissingKind(f"no stage of a {kind} layer in the {profile['verb']} profile: the real model has {n}; "
                              "measure one (or declare it absent where the verb never runs it)")
        measured = sorted(seen[kind], key=lambda x: (len(x), x))
        per_layer = {st: sec / len(measured) for st, sec in per_kind[kind].items()}
        seconds = sum(per_layer.values())
        kinds[kind] = {"measured_layers": measured, "stages_per_layer": per_layer, "seconds_per_layer": seconds,
                       "count": n, "counted_seconds": seconds * n}
        total += seconds * n
    whole_terms = {}
    for name, sec in whole.items():
        by = "bytes" if name in moved else "tensors"
        whole_terms[name] = {"measured_seconds": sec, "scale_by": by, "scale": scale[by],
                             "scaled_seconds": sec * scale[by]}
    whole_scaled = sum(t["scaled_seconds"] for t in whole_terms.values())
    total += whole_scaled
    stage_sum = sum(s["seconds"] for s in profile["stages"])
    return {
        "verb": profile["verb"], "format": profile["format"], "device": profile["device"],
        "kinds": kinds,
        "whole_run": {"stages": whole_terms, "measured_seconds": sum(whole.values()), "scale_why": SCALE_WHY,
                      "scaled_seconds": whole_scaled},
        "outside_stages_seconds": profile["total"]["seconds"] - stage_sum,
        "projected_seconds": total, "projected_hours": total / 3600,
        "peak": {"host_bytes": max(s["peak_host_bytes"] for s in profile["stages"]),
                 "gpu_bytes": max(s["peak_gpu_bytes"] for s in profile["stages"]),
                 "why": "the largest of any stage, not scaled: the run holds one layer at a time"},
    }


def source_size(config_path: str | Path) -> tuple[int, int]:
    """(bytes of every tensor at its storage type, tensor count) of the model `config_path` describes (shapes
    only)."""
    from mixq.formats.checkpoint import checkpoint_from_config

    ck = checkpoint_from_config(config_path)
    return sum(ck.nbytes(n) for n in ck.names()), len(ck.names())


def _runs(specs: list[str]) -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for spec in specs:
        label, sep, files = spec.partition("=")
        if not sep or not label or not files:
            raise SystemExit(f"--run {spec!r}: expected LABEL=FILE[,FILE...]")
        out[label] = [Path(f) for f in files.split(",") if f]
    return out


def _absent(specs: list[str]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for spec in specs:
        label, sep, kinds = spec.partition(":")
        if not sep:
            raise SystemExit(f"--absent {spec!r}: expected LABEL:KIND[,KIND...]")
        out.setdefault(label, set()).update(k for k in kinds.split(",") if k)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", required=True, help="LABEL=FILE[,FILE...]: one run's profiles")
    ap.add_argument("--absent", action="append", default=[], help="LABEL:KIND[,KIND...]: kinds that run never runs")
    ap.add_argument("--rehearsal-config", required=True, help="the rehearsal model's config.json")
    ap.add_argument("--config", default=str(FLASH_CONFIG), help="the real model's config.json")
    ap.add_argument("--out", help="write the JSON result here (else print it)")
    a = ap.parse_args(argv)
    real = json.loads(Path(a.config).read_text())
    counts = kind_counts(real)
    (real_bytes, real_n), (reh_bytes, reh_n) = source_size(a.config), source_size(a.rehearsal_config)
    scale = {"bytes": real_bytes / reh_bytes, "tensors": real_n / reh_n}
    absent = _absent(a.absent)
    runs = {}
    for label, files in _runs(a.run).items():
        prof = merge(json.loads(f.read_text()) for f in files)
        runs[label] = {"profiles": [str(f) for f in files], **project(prof, counts, scale, absent=absent.get(label, ()))}
    result = {"model": a.config, "rehearsal": a.rehearsal_config, "counts": counts,
              "source": {"real": {"bytes": real_bytes, "tensors": real_n},
                         "rehearsal": {"bytes": reh_bytes, "tensors": reh_n}, "ratios": scale},
              "runs": runs}
    text = json.dumps(repo_relative(result), indent=2) + "\n"
    if a.out:
        Path(a.out).write_text(text)
    else:
        sys.stdout.write(text)
    return result


if __name__ == "__main__":
    main()
