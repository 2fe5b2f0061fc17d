"""Hessian rounding (`quantize_hessian`, what `convert --rounding hessian` runs per tensor) at GLM-5.3-Flash widths.

One call per (type, shape kind) as the converter makes it: a routed-expert slice (E experts of 2048 x 4096 with
one 4096 x 4096 Hessian each, E = `convert.gguf_rounding.expert_slice` on the device unless --experts says) and a
4096 x 4096 Linear, with the
converter's damping and refinement passes. Each call runs once to warm up (kernel compiles, tables) and is then
timed, synchronised, with the seconds split by phase (exclusive: a phase's time excludes the phases it calls):
the factorisation, ggml's encoder per block, the level grid and code write-back, the host decodes, the walk,
and each refinement. Prints M weights/s per call and the JSON.

    python bench/speed/hessian_rounding_speed.py --json OUT.json [--types IQ2_S,Q4_K] [--experts 8,32] [--device cuda]
    python bench/speed/hessian_rounding_speed.py --project R1.json [R2.json ...]   # hours of the release's rounding

`--project` prices the rounding of the release's 108 GB `--gguf-ladder iq` plan (the glm-5.3-flash shape config,
every tensor `convert --rounding hessian` covers): each (type, kind) at its measured rate, in the given files'
order of preference; a pair not measured takes its type's rate on the other kind, else the mean rate of the
measured K-quant matrices, and says so. The down stacks (4096 x 2048) take the gate/up rate unless measured.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for paths.py
from paths import SHARED  # noqa: E402

from mixq.conversion.gguf import rounding as gr
from mixq.quant.ggml.rounding import hessian as kh
from mixq.quant.ggml.rounding import levels as gl

EXPERT_SHAPE = (2048, 4096)   # a routed expert's gate/up (out, in)
EXPERT_DOWN = (4096, 2048)    # its down
MATRIX_SHAPE = (4096, 4096)   # an attention / shared-expert Linear
TOKENS = 1024                 # calibration tokens behind each Hessian (a routed expert sees ~1/36 of 64 x 512)

# (module, attribute, phase): the calls timed; the walk is what quantize_hessian spends outside them
PHASES = [(kh, "upper_inverse_factor", "factorise"), (kh, "_encode_block", "ggml_encode"),
          (gl, "decode_blocks", "decode"), (gl, "level_grid_on", "level_grid"),
          (gl, "super_scale_basis_on", "level_grid"),
          (gl, "set_levels_on", "write_codes"), (gl, "set_iq2_groups_on", "write_codes"),
          (gl, "iq2_group_scales_on", "level_grid"), (gl, "iq2_groups_on", "level_grid"), (kh, "refine_codes", "refine_codes"),
          (kh, "refine_iq2", "refine_codes"), (kh, "refine_sub_scales", "refine_sub_scales"),
          (kh, "refit_super_scales", "refit_super_scales")]


class PhaseTimer:
    """Exclusive seconds per phase of wrapped module functions (synchronised on `dev`)."""

    def __init__(self, dev: torch.device) -> None:
        self.dev, self.seconds, self.stack, self.saved = dev, {}, [], []

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def install(self) -> None:
        for mod, attr, phase in PHASES:
            fn = getattr(mod, attr)
            self.saved.append((mod, attr, fn))
            setattr(mod, attr, self._wrap(fn, phase))

    def remove(self) -> None:
        for mod, attr, fn in reversed(self.saved):
            setattr(mod, attr, fn)
        self.saved = []

    def _wrap(self, fn, phase: str):
        def timed(*a, **k):
            self.sync()
            t0 = time.perf_counter()
            self.stack.append(0.0)
            try:
                return fn(*a, **k)
            finally:
                self.sync()
                total = time.perf_counter() - t0
                inner = self.stack.pop()
                self.seconds[phase] = self.seconds.get(phase, 0.0) + total - inner
                if self.stack:
                    self.stack[-1] += total
        return timed


def inputs(e: int, shape: tuple[int, int], dev: torch.device, seed: int = 0):
    """E weights N(0, 0.02) with a few loud input channels, and Hessians X^T X / T of outlier-scaled inputs."""
    g = torch.Generator(device=dev).manual_seed(seed)
    out_f, in_f = shape
    w = torch.randn(e, out_f, in_f, generator=g, device=dev) * 0.02
    scale = torch.ones(in_f, device=dev)
    scale[: max(1, in_f // 200)] = 8.0
    x = torch.randn(e, TOKENS, in_f, generator=g, device=dev) * scale
    h = torch.bmm(x.transpose(1, 2), x) / TOKENS
    return w, h


PROFILE = False  # --profile: also one call under torch.profiler (its top operators by device time)


def profile_top(call, dev: torch.device, rows: int = 15) -> list[dict]:
    """The operators of one `call` with the most device (else host) time, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        call()
    key = "device_time_total" if dev.type == "cuda" else "cpu_time_total"
    ev = sorted(prof.key_averages(), key=lambda e: -getattr(e, key, 0.0))[:rows]
    return [{"op": e.key, "calls": e.count, "ms": round(getattr(e, key, 0.0) / 1e3, 1)} for e in ev]


def measure(qtype: str, e: int, shape: tuple[int, int], dev: torch.device, stack: bool,
            refine: int = gr.REFINE_PASSES) -> dict:
    """One warm-up, then one timed `quantize_hessian` call split by phase (`stack`: an (E, rows, n) call)."""
    w, h = inputs(e, shape, dev)
    im = torch.diagonal(h, dim1=-2, dim2=-1).cpu().numpy()
    args = dict(damp=gr.DAMP, refine=refine, device=dev)
    ww, hh, ii = (w, h, im) if stack else (w[0], h[0], im[0])
    kh.quantize_hessian(ww[:1] if stack else ww[:256], hh[:1] if stack else hh, qtype,
                        ii[:1] if stack else ii, **args)
    timer = PhaseTimer(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    timer.install()
    try:
        timer.sync()
        t0 = time.perf_counter()
        kh.quantize_hessian(ww, hh, qtype, ii, **args)
        timer.sync()
        sec = time.perf_counter() - t0
    finally:
        timer.remove()
    top = profile_top(lambda: kh.quantize_hessian(ww, hh, qtype, ii, **args), dev) if PROFILE else None
    phases = {k: round(v, 3) for k, v in sorted(timer.seconds.items(), key=lambda kv: -kv[1])}
    phases["walk (the rest)"] = round(sec - sum(timer.seconds.values()), 3)
    n = w.numel() if stack else w[0].numel()
    return {"type": qtype, "kind": "stack" if stack else "matrix", "experts": e, "shape": list(shape),
            "weights": n, "seconds": round(sec, 3), "mweights_per_s": round(n / sec / 1e6, 3), "phases": phases,
            "profile_top": top, "peak_gpu_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if dev.type == "cuda" else None}


SHAPE_CONFIG = SHARED / "models" / "glm-5.3-flash-shape" / "config.json"


def release_covered() -> dict[tuple[str, str, int], int]:
    """Weights per (type, kind, row length) that Hessian rounding covers in the release's 108 GB i-quant plan."""
    from mixq.formats.checkpoint import checkpoint_from_config
    from mixq.formats.gguf_names import gguf_tensors
    from mixq.planning.planner import plan_model

    ck = checkpoint_from_config(SHAPE_CONFIG)
    by = {t.name: t.type for t in plan_model(ck, "gguf", size=108 * 10**9, gguf_ladder="iq").tensors}
    out: dict[tuple[str, str, int], int] = {}
    for spec in gguf_tensors(ck):
        t = by.get(spec.name)
        if t is not None and gr.covered(spec, t):
            key = (t, "stack" if spec.transform == "stack" else "matrix", int(spec.shape[-1]))
            out[key] = out.get(key, 0) + math.prod(spec.shape)
    return out


def project(paths: list[Path]) -> dict:
    """Hours of Hessian rounding for the release plan at the rates measured in `paths` (first file wins)."""
    rates: dict[tuple[str, str, int], float] = {}
    for path in paths:
        for r in json.loads(path.read_text())["rows"]:
            rates.setdefault((r["type"], r["kind"], r["shape"][1]), r["mweights_per_s"])
    def kquant_mean(stacked: bool) -> tuple[float, str]:
        """The mean measured K-quant rate of the same kind (stacks or matrices), else of the matrices."""
        got = [v for (t, k, _), v in rates.items() if t.startswith("Q") and k.startswith("stack") == stacked]
        if stacked and got:
            return sum(got) / len(got), "mean of the measured K-quant stacks"
        got = [v for (t, k, _), v in rates.items() if t.startswith("Q") and k == "matrix"]
        return sum(got) / len(got), "mean of the measured K-quant matrices"

    rows, total = [], 0.0
    for (t, kind, n), weights in sorted(release_covered().items(), key=lambda kv: -kv[1]):
        same = [v for (tt, kk, nn), v in rates.items() if tt == t and kk == kind]
        if (t, kind, n) in rates:
            rate, src = rates[(t, kind, n)], "measured"
        elif same:
            rate, src = same[0], f"{t} {kind} at another row length"
        elif [v for (tt, _, _), v in rates.items() if tt == t]:
            rate = next(v for (tt, _, _), v in rates.items() if tt == t)
            src = f"{t} on the other kind"
        else:
            rate, src = kquant_mean(kind.startswith("stack"))
        sec = weights / (rate * 1e6)
        total += sec
        rows.append({"type": t, "kind": kind, "row": n, "gweights": round(weights / 1e9, 3),
                     "mweights_per_s": rate, "rate_from": src, "hours": round(sec / 3600, 3)})
    return {"files": [p.name for p in paths], "rounding_hours": round(total / 3600, 2), "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--project", type=Path, nargs="+", help="result files to price the release's rounding with")
    ap.add_argument("--types", default="IQ2_S,Q4_K")
    ap.add_argument("--refine", type=int, default=gr.REFINE_PASSES,
                    help="descent passes after the walk (the converter's --refine-passes)  [default: %(default)s]")
    ap.add_argument("--experts", default="",
                    help="experts per stacked call, comma-separated for several (default: the converter's slice on "
                         "this device)")
    ap.add_argument("--kinds", default="stack,stack_down,matrix",
                    help="stack: experts' gate/up (2048 x 4096), stack_down: their down (4096 x 2048), matrix: 4096^2")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="quarter widths (a CPU smoke run)")
    ap.add_argument("--profile", action="store_true", help="also profile each call (torch.profiler, top operators)")
    ap.add_argument("--fused-iq2s", action="store_true",
                    help="let the fused IQ2_S group descent serve (after its check), where the loop serves by default")
    a = ap.parse_args(argv)
    if a.project:
        out = project(a.project)
        for r in out["rows"]:
            print(f"{r['type']:6s} {r['kind']:6s} row {r['row']:5d}: {r['gweights']:8.3f} G weights at "
                  f"{r['mweights_per_s']:7.3f} M w/s = {r['hours']:6.3f} h  ({r['rate_from']})")
        print(f"Hessian rounding of the release's 108 GB plan: {out['rounding_hours']} h")
        if a.json:
            a.json.write_text(json.dumps(out, indent=1) + "\n")
        return 0
    if a.json is None:
        ap.error("--json is required to measure")
    global PROFILE
    PROFILE = a.profile
    dev = torch.device(a.device)
    if a.fused_iq2s:
        print(f"fused IQ2_S descent: {'serves' if kh.allow_fused_sweep('iq2s', dev) else 'refused by its check'}")
    div = 4 if a.small else 1
    stacks = [int(x) for x in a.experts.split(",")] if a.experts else [gr.expert_slice(*EXPERT_SHAPE, dev)]
    down = [gr.expert_slice(*EXPERT_DOWN, dev)] if not a.experts else stacks
    runs = [(kind, e) for kind in a.kinds.split(",")
            for e in {"stack": stacks, "stack_down": down}.get(kind, [1])]
    rows = []
    for q in a.types.split(","):
        for kind, e in runs:
            shape = {"stack": EXPERT_SHAPE, "stack_down": EXPERT_DOWN}.get(kind, MATRIX_SHAPE)
            shape = (shape[0] // div, shape[1] // div)
            r = measure(q, e, shape, dev, kind != "matrix", a.refine)
            rows.append(r)
            print(f"{q:6s} {kind:6s} E={e:3d} {shape[0]}x{shape[1]}: {r['seconds']:8.2f} s "
                  f"{r['mweights_per_s']:8.3f} M w/s  {r['phases']}", flush=True)
            write(a.json, dev, rows, a.refine)  # after every row: a run cut by its time limit keeps what it measured
    return 0


def write(path: Path, dev: torch.device, rows: list[dict], refine: int = gr.REFINE_PASSES) -> None:
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "damp": gr.DAMP,
           "refine": refine, "tokens_per_hessian": TOKENS, "rows": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
