"""EXL3 conversion of one GLM-5.3-Flash-width slice on 1 and on N devices: wall time, speed-up, sha256 equality.

The slice is built by bench/release/rehearsal_model.py (every width of the release: hidden 4096, experts 2048 wide,
64 heads, KDA and DSA attention, mHC 4; layers KDA+dense, KDA+MoE, KDA+MoE, DSA+MoE, no NextN block) with E routed
experts (default 8) and a vocabulary cut to 8192. The lm_head is one trellis call that no rank can share; at the release's vocabulary it
would be 9% of this slice's trellis weights (and 0.1% of the release's), here it is 2.4%. Trellis weights at
E = 8: 1.37 G (routed experts 0.60 G, attention 0.51 G, dense MLP 0.15 G). Steps, each conversion its own
process:
  build     the BF16 slice under WORK/bf16 (skipped when present)
  warm-up   the trellis encoder's kernels compiled once for every rate the plan uses (outside the timings)
  N = 1     `python -m mixq convert SLICE OUT1 --bpw B --devices D0`
  N = k     `python -m mixq convert SLICE OUTk --bpw B --devices D0,...`
  compare   sha256 of every file of OUT1 and OUTk
Results go to --json: wall seconds (process start to exit), the conversion's own seconds, the speed-up, and
whether every file is identical. Exit status 1 when they differ.

    python bench/release/exl3_multigpu.py --work DIR --json bench/results/exl3_multigpu.json --devices 0,1
    python bench/release/exl3_multigpu.py --work DIR --json OUT.json --devices cpu,cpu --small   # the script on a CPU
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import rehearsal_model  # noqa: E402
from paths import repo_relative  # noqa: E402

BENCH_VOCAB = 8192  # the fixture tokenizer's vocabulary
KINDS = ("kda-dense", "kda-moe", "kda-moe", "dsa-moe")
WARMUP_SHAPE = (2, 256, 512)  # a stacked call with Hessians: the LDLQ path every calibrated unit takes


def build(work: Path, experts: int, small: bool, device: str) -> dict:
    """The BF16 slice in work/bf16 (rehearsal_model's builder; no FP8 copy, no NextN block, the bench vocabulary:
    the text-only calibration never reaches the release's pad and media token ids)."""
    if rehearsal_model.built(work):
        return {"built": False}
    res = rehearsal_model.build(work, experts=experts, kinds=KINDS, fp8=False, small=small, device=device,
                                nextn=False, vocab=BENCH_VOCAB)
    return {"built": True, "params": res["params"], "bytes": res["bf16_bytes"], "seconds": res["seconds"]}


def plan_rates(model: Path, bpw: float) -> list[float]:
    """The distinct trellis rates of the conversion's plan (shapes only)."""
    from mixq.planning.planner import plan_model
    from mixq.formats.checkpoint import open_checkpoint

    plan = plan_model(open_checkpoint(model), "exl3", bpw=bpw)
    return sorted({float(t.bits) for t in plan.tensors if t.bits is not None and t.bits < 16})


def warm_up(rates: list[float], device: str) -> float:
    """Compile the encoder's kernels for every rate in a child process (the timed runs then find them cached)."""
    code = ("import sys, torch\nfrom mixq.quant import trellis\n"
            f"dev = torch.device({device!r})\n"
            f"for b in {rates!r}:\n"
            f"    w = torch.randn(*{WARMUP_SHAPE!r}, device=dev)\n"
            f"    h = torch.eye({WARMUP_SHAPE[2]}, device=dev).expand({WARMUP_SHAPE[0]}, -1, -1).contiguous()\n"
            "    trellis.quantize(w, b, hessian=h)\n    trellis.quantize(w[0], b)\n")
    t0 = time.time()
    subprocess.run([sys.executable, "-c", code], check=True)
    return round(time.time() - t0, 1)


def convert_once(model: Path, out: Path, devices: list[str], args) -> dict:
    """One `mixq convert` process; its JSON result plus the wall time."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "mixq", "convert", str(model), str(out), "--bpw", str(args.bpw), "--rows",
           str(args.rows), "--seq-len", str(args.seq_len), "--devices", ",".join(devices), "--json"]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    if r.returncode != 0:
        sys.stderr.write(r.stderr[-4000:])
        raise SystemExit(f"convert on {','.join(devices)} failed (exit {r.returncode})")
    res = json.loads(r.stdout[r.stdout.index("{"):])
    return {"devices": devices, "wall_seconds": round(wall, 1), "convert_seconds": round(res["seconds"], 1),
            "bytes": res["bytes"], "device": res["device"], "peak_rss_mib": res["peak_rss_mib"]}


def digests(out: Path) -> dict[str, str]:
    """sha256 of every file under `out`, by relative path."""
    res = {}
    for p in sorted(out.rglob("*")):
        if p.is_file():
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    h.update(chunk)
            res[str(p.relative_to(out))] = h.hexdigest()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="directory for the slice and both outputs")
    ap.add_argument("--json", type=Path, required=True, help="results")
    ap.add_argument("--devices", default="0,1", help="the N-device run's devices; the first alone is N = 1")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--bpw", type=float, default=3.05)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--small", action="store_true", help="toy widths (CPU check of the script)")
    a = ap.parse_args()
    from mixq.runtime.distributed import parse_devices
    from mixq.formats.atomic import write_json

    devices = list(parse_devices(a.devices))
    if len(devices) < 2:
        raise SystemExit("--devices: give at least two devices")
    a.work.mkdir(parents=True, exist_ok=True)
    model = a.work / "bf16"
    res: dict = {"experts": a.experts, "bpw": a.bpw, "rows": a.rows, "seq_len": a.seq_len, "small": a.small,
                 "build": build(a.work, a.experts, a.small, devices[0])}
    res["vocab"] = json.loads((model / "config.json").read_text())["text_config"]["vocab_size"]
    rates = plan_rates(model, a.bpw)
    res.update(rates=rates, warmup_seconds=warm_up(rates, devices[0]))
    write_json(a.json, repo_relative(res))  # partial results survive a run cut short
    res["n1"] = convert_once(model, a.work / "out-n1", devices[:1], a)
    print(f"N=1: {res['n1']['wall_seconds']} s", flush=True)
    write_json(a.json, repo_relative(res))
    res[f"n{len(devices)}"] = nk = convert_once(model, a.work / f"out-n{len(devices)}", devices, a)
    print(f"N={len(devices)}: {nk['wall_seconds']} s", flush=True)
    d1, dk = digests(a.work / "out-n1"), digests(a.work / f"out-n{len(devices)}")
    res.update(files=len(d1), identical=d1 == dk, differing=sorted(k for k in set(d1) | set(dk)
                                                                   if d1.get(k) != dk.get(k)),
               speedup_wall=round(res["n1"]["wall_seconds"] / nk["wall_seconds"], 3),
               speedup_convert=round(res["n1"]["convert_seconds"] / nk["convert_seconds"], 3))
    write_json(a.json, repo_relative(res))
    print(json.dumps({k: res[k] for k in ("identical", "files", "speedup_wall", "speedup_convert")}))
    if not res["identical"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
