"""What `--gpu-memory` does on a real-width MoE layer: per verb and budget, seconds and peak GPU / host memory.

The model: `--model DIR` (the release rehearsal's checkpoint, when built), else a GLM-5.3-Flash slice of one
KDA + MoE layer at the release's widths with `--experts` routed experts (default 288, the release's), built by
bench/release/rehearsal_model.py (BF16 only, no NextN block). Then, for each budget of `--budgets` (default 80GB,24GB),
each verb of `--verbs` runs as its own `mixq` process with `--gpu-memory BUDGET`:

  imatrix   mixq imatrix MODEL OUT.gguf
  exl3      mixq convert MODEL OUT-exl3 --bpw 3.05
  gguf      mixq convert MODEL OUT.gguf --type Q4_K_M --rounding hessian --tune-iters 0 --imatrix (the imatrix
            of that budget, or of any budget that made one) (`--gguf-args` replaces the target and rounding flags)
  eval      mixq eval MODEL (the GGUF of that budget) --text heldout.txt --ctx --windows

Under a budget below one whole MoE layer (24GB on the release's layer) the calibration and eval's forward stream the
routed experts through the device a group at a time (runtime/expert_groups.py); each run's reported estimate names
the group (`memory.stages[calibration|eval_forward].piece`, of `default_piece` experts).

Recorded per run (JSON under bench/results): exit status, seconds, the child's peak resident set (wait4), the
GPU's peak used memory over the child's life less what was used before it (nvidia-smi, sampled every 0.2 s; None
without a GPU), the up-front line (`mixq VERB: memory: ...`) and the estimate the verb reports (`memory` of its
--json), or its refusal line (`mixq: error: ...`, exit 2) when the budget is below the smallest piece of a stage.
`--deadline-s` bounds the whole run: a run is killed when the deadline passes (recorded "killed": true), a run
not started is recorded under "skipped".

    python bench/release/memory_budget.py --work DIR --json bench/results/memory_budget.json
    python bench/release/memory_budget.py --estimate-only --json bench/results/memory_budget_estimate_glm53.json
        # no run: every verb's up-front estimate for GLM-5.3-Flash's config (shapes only) on a CUDA device
    python bench/release/memory_budget.py --work DIR --json OUT.json --small --device cpu --budgets 4GB,1MB \\
        --verbs imatrix,gguf,eval --gguf-args="--type Q8_0"      # the same code on a toy slice, on the CPU

On one H200, within 10 minutes (the slice is 14.5 GB BF16 under /tmp; results and logs under $OUT; wheels in .whl/,
shared/ holding models/glm-5.3-flash-shape/config.json and models/glm5next-mini/tokenizer*.json, data/*.txt):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
      .whl/*.whl && export PYTHONPATH=/tmp/site:/tmp/pp && mkdir -p /tmp/pp && ln -sfn "$PWD" /tmp/pp/mixq && \\
    export MIXQ_SHARED="$PWD/shared" && python3 bench/release/memory_budget.py --work /tmp/mb \\
      --json $OUT/memory_budget.json --deadline-s 560 --rows 16 --seq-len 512 --verbs imatrix,exl3 \\
      > $OUT/log.txt 2>&1; tail -c 3000 $OUT/log.txt
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from paths import SHARED, repo_relative  # noqa: E402

BUILDER = REPO / "bench" / "release" / "rehearsal_model.py"
VERBS = ("imatrix", "exl3", "gguf", "eval")
DEFAULT_GGUF_ARGS = "--type Q4_K_M --rounding hessian --tune-iters 0"  # untuned: the tuning holds a whole layer
GPU_SAMPLE_S = 0.2


def gpu_used_mib() -> float | None:
    """Used memory of GPU 0 in MiB (nvidia-smi), None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        return float(out.splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


class GpuPeak:
    """The peak of `gpu_used_mib` while a child runs, sampled on a thread."""

    def __init__(self) -> None:
        self.base = gpu_used_mib()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(GPU_SAMPLE_S):
            v = gpu_used_mib()
            if v is not None and (self.peak is None or v > self.peak):
                self.peak = v

    def __enter__(self) -> "GpuPeak":
        if self.base is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def growth(self) -> float | None:
        return None if self.base is None else round(self.peak - self.base, 1)


def run_child(cmd: list[str], log: Path, limit_s: float | None, stdout: Path | None = None) -> dict:
    """Run `cmd` (its own process group) with stderr to `log` (and stdout, unless `stdout` names its own file);
    its exit status, seconds, peak resident set (wait4) and GPU peak; killed after `limit_s`."""
    t0 = time.time()
    with open(log, "w") as f, open(stdout or os.devnull, "w") as so, GpuPeak() as gpu:
        p = subprocess.Popen(cmd, stdout=so if stdout is not None else f, stderr=f, start_new_session=True)
        killed = False
        timer = None
        if limit_s is not None:
            def kill() -> None:
                nonlocal killed
                killed = True
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            timer = threading.Timer(max(1.0, limit_s), kill)
            timer.start()
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        if timer is not None:
            timer.cancel()
    return {"rc": p.returncode, "killed": killed, "seconds": round(time.time() - t0, 1),
            "peak_host_mib": round(usage.ru_maxrss / 1024, 1), "peak_gpu_mib": gpu.growth}


def read_run(log: Path, json_out: Path | None) -> dict:
    """The up-front memory line, the refusal line and the verb's reported estimate from a child's outputs."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    lines = [ln.strip() for ln in re.split(r"[\r\n]", text) if ln.strip()]
    d: dict = {"memory_line": next((ln for ln in lines if re.match(r"mixq \w+: memory:", ln)), None),
               "refusal": next((ln for ln in lines if ln.startswith("mixq: error:")), None)}
    if json_out is not None and json_out.is_file():
        try:
            d["memory"] = json.loads(json_out.read_text()).get("memory")
        except (json.JSONDecodeError, AttributeError):
            pass
    return d


def build_model(args, work: Path) -> tuple[Path, dict]:
    """--model, or the slice built by rehearsal_model.py (one KDA + MoE layer, BF16, no NextN block)."""
    if args.model is not None:
        return args.model, {"model": str(args.model)}
    cmd = [sys.executable, str(BUILDER), str(work / "slice"), "--json", str(work / "build.json"),
           "--experts", str(args.experts), "--kinds", "kda-moe", "--no-fp8", "--no-nextn"]
    if args.small:
        cmd.append("--small")
    if args.device:
        cmd += ["--device", args.device]
    res = run_child(cmd, work / "build.log", None)
    if res["rc"] != 0:
        raise SystemExit(f"build failed: {(work / 'build.log').read_text()[-2000:]}")
    return work / "slice" / "bf16", {"built": res, "experts": args.experts, "small": args.small}


def verb_command(verb: str, model: Path, work: Path, tag: str, budget: str, args, other: Path | None) -> tuple:
    """(argv, OUT, the --json file) of one verb's run; `other`: the gguf verb's imatrix, the eval verb's candidate
    when this budget made none (that of an earlier budget)."""
    mixq = [sys.executable, "-m", "mixq"]
    cal = ["--rows", str(args.rows), "--seq-len", str(args.seq_len)]
    dev = ["--device", args.device] if args.device else []
    js = work / f"{verb}-{tag}.json"
    if verb == "imatrix":
        out = work / f"imatrix-{tag}.gguf"
        return mixq + ["imatrix", str(model), str(out), "--gpu-memory", budget, "--overwrite", "--json"] + cal + \
            dev, out, js
    if verb == "exl3":
        out = work / f"exl3-{tag}"
        shutil.rmtree(out, ignore_errors=True)
        return mixq + ["convert", str(model), str(out), "--bpw", "3.05", "--gpu-memory", budget, "--json"] + cal + \
            dev, out, js
    if verb == "gguf":
        out = work / f"gguf-{tag}.gguf"
        extra = args.gguf_args.split()
        hessian = "hessian" in extra
        cmd = mixq + ["convert", str(model), str(out), *extra, "--gpu-memory", budget, "--overwrite", "--json"]
        if hessian:
            cmd += cal
        if other is not None:
            cmd += ["--imatrix", str(other)]
        return cmd + dev, out, js
    cand = work / f"gguf-{tag}.gguf"
    cand = cand if cand.is_file() or other is None else other
    return mixq + ["eval", str(model), str(cand), "--text", str(SHARED / "data" / "heldout.txt"), "--ctx",
                   str(args.eval_ctx), "--windows", str(args.eval_windows), "--gpu-memory", budget, "--json",
                   str(js), "--overwrite"] + dev, None, js


def estimates(config: Path, budgets: list[str], args) -> dict:
    """Every verb's up-front estimate and pieces (runtime/memory_budget.py) for a checkpoint's shapes (`config`: a
    config.json, shapes only) on a CUDA device under each budget, as the verbs compute them, without running."""
    import torch

    from mixq.conversion.exl3.pipeline import MAX_BATCH
    from mixq.conversion.gguf.rounding import expert_slice
    from mixq.conversion.gguf.tuning import BYTES_PER_TUNED_WEIGHT
    from mixq.errors import InputError
    from mixq.eval.streamed import state_bytes
    from mixq.formats.checkpoint import checkpoint_from_config
    from mixq.formats.gguf_names import gguf_tensors
    from mixq.planning.sizes import parse_size
    from mixq.quant.ggml.torch_encoders import chunk_weights
    from mixq.runtime import memory_budget as mb
    from mixq.runtime.kl_stats import ROW_CHUNK

    ck = checkpoint_from_config(config)
    shapes = mb.checkpoint_shapes(ck)
    cuda = torch.device("cuda")
    specs = gguf_tensors(ck, include_mtp=False)
    stack = max((s for s in specs if s.transform == "stack"), key=lambda s: s.shape[-2] * s.shape[-1])
    largest = max(int(torch.Size(s.shape).numel()) for s in specs)
    out: dict = {"config": str(config), "shapes": {k: v for k, v in vars(shapes).items() if k != "layer_inputs"},
                 "calibration": {"rows": args.rows, "seq_len": args.seq_len},
                 "eval": {"ctx": args.eval_ctx, "windows": args.eval_windows}, "budgets": {}}
    def gguf(budget, tune: bool):
        return mb.gguf_estimate(budget, shapes, hessian=True, rows=args.rows, seq_len=args.seq_len, tune=tune,
                                tune_bytes_per_weight=BYTES_PER_TUNED_WEIGHT,
                                rounding_default=min(stack.shape[0], expert_slice(stack.shape[-2], stack.shape[-1],
                                                                                  cuda)),
                                encode_default=chunk_weights("Q4_K", cuda), largest_tensor=largest)

    for b in budgets:
        budget = mb.MemoryBudget(cuda, parse_size(b), True)
        ests = {
            "exl3": mb.exl3_estimate(budget, shapes, rows=args.rows, seq_len=args.seq_len, batch_rows=4,
                                     default_batch=MAX_BATCH),
            "gguf_hessian": gguf(budget, True),
            # --tune-iters 0: no stage holds the whole layer, so the calibration streams its routed experts
            "gguf_hessian_untuned": gguf(budget, False),
            "imatrix": mb.imatrix_estimate(budget, shapes, rows=args.rows, seq_len=args.seq_len),
            "eval": mb.eval_estimate(budget, shapes, ctx=args.eval_ctx, batch_windows=1, models=2,
                                     state_bytes=state_bytes(ck.config, args.eval_windows, args.eval_ctx),
                                     kl_default=ROW_CHUNK)[0],
        }
        row = {}
        for verb, est in ests.items():
            d = est.to_dict()
            d["line"] = est.line()
            try:
                est.check()
                d["refusal"] = None
            except InputError as e:
                d["refusal"] = f"mixq: error: {e}"
            row[verb] = d
        out["budgets"][b] = row
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=None, help="directory for the slice and every output")
    ap.add_argument("--json", type=Path, required=True, help="results (rewritten after every run)")
    ap.add_argument("--model", type=Path, default=None, help="a glm5_next checkpoint instead of the built slice")
    ap.add_argument("--experts", type=int, default=288)
    ap.add_argument("--small", action="store_true", help="toy widths (CPU test of the script)")
    ap.add_argument("--device", default=None, help="cuda|cpu [default: cuda when present]")
    ap.add_argument("--budgets", default="80GB,24GB")
    ap.add_argument("--verbs", default=",".join(VERBS))
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--gguf-args", default=DEFAULT_GGUF_ARGS)
    ap.add_argument("--eval-ctx", type=int, default=4096)
    ap.add_argument("--eval-windows", type=int, default=4)
    ap.add_argument("--deadline-s", type=float, default=None, help="the whole run (build included)")
    ap.add_argument("--estimate-only", action="store_true",
                    help="no run: the verbs' estimates for --model's (or GLM-5.3-Flash's) config under each budget")
    args = ap.parse_args(argv)
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    if args.estimate_only:
        config = (args.model / "config.json") if args.model is not None else \
            SHARED / "models" / "glm-5.3-flash-shape" / "config.json"
        result = {"argv": sys.argv[1:] if argv is None else argv, **estimates(config, budgets, args)}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(repo_relative(result), indent=2) + "\n")
        return result
    if args.work is None:
        ap.error("--work is required unless --estimate-only")
    t_start = time.time()
    verbs = [v.strip() for v in args.verbs.split(",") if v.strip()]
    bad = [v for v in verbs if v not in VERBS]
    if bad:
        raise SystemExit(f"--verbs: unknown {bad[0]}; use {', '.join(VERBS)}")
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    env_note = {"device": args.device or "cuda when present", "gpu": _gpu_name()}
    given = list(sys.argv[1:] if argv is None else argv)
    # the scratch directory is this machine's, not part of the result
    shown = ["WORK" if i > 0 and given[i - 1] == "--work" else a for i, a in enumerate(given)]
    result: dict = {"argv": shown, "env": env_note, "runs": [], "skipped": []}
    model, result["model"] = build_model(args, work)

    def save() -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(repo_relative(result), indent=2) + "\n")

    imatrix_any: Path | None = None
    gguf_any: Path | None = None
    for budget in budgets:
        tag = re.sub(r"[^A-Za-z0-9]+", "", budget)
        imatrix: Path | None = None
        for verb in verbs:
            left = None if args.deadline_s is None else args.deadline_s - (time.time() - t_start)
            if left is not None and left < 5:
                result["skipped"].append({"verb": verb, "budget": budget, "why": "deadline"})
                continue
            imx = imatrix or imatrix_any
            cmd, out, js = verb_command(verb, model, work, tag, budget, args, imx if verb == "gguf" else gguf_any)
            log = work / f"{verb}-{tag}.log"
            js.unlink(missing_ok=True)
            res = run_child(cmd, log, left, stdout=None if verb == "eval" else js)  # --json on stdout
            entry = {"verb": verb, "budget": budget, **res, **read_run(log, js)}
            result["runs"].append(entry)
            if verb == "imatrix" and res["rc"] == 0 and out is not None and out.is_file():
                imatrix = imatrix_any = out
            if verb == "gguf" and res["rc"] == 0 and out is not None and out.is_file():
                gguf_any = out
            save()
    result["seconds"] = round(time.time() - t_start, 1)
    save()
    return result


def _gpu_name() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    main()
