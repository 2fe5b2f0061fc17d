"""The release rehearsal: the plain mixq CLI on the rehearsal model (bench/release/rehearsal_model.py), step by step.

Every step is a subprocess (`python -m mixq VERB ...`, or a bench script for the engines), so what is timed is what a
user runs; the product's own `--profile FILE` (per layer and per stage: seconds, bytes, peak host and GPU memory)
is passed to every verb that takes it (convert, imatrix, eval; WORK/profiles/STEP.callN.json, one per call, since
a resumed conversion is one profile per call) and read back into the result. Steps, in order:

  build           the rehearsal model under WORK/model (skipped when built; `--fp8` also writes its FP8 copy)
  convert-exl3    `mixq convert --format exl3` at the release plan's 3.05 bpw rates (below), continued with
                  `--resume` when an earlier call was cut
  verify-exl3     `mixq verify` of the EXL3 directory
  eval-exl3       `mixq eval` of the EXL3 against the BF16 model (torch engine)
  eval-exllamav3  `mixq eval --engine exllamav3` of the EXL3 (when exllamav3 imports)
  load-exl3       exllamav3 loads the EXL3 and generates a few tokens (bench/engines/generate_check.py)
  free-exl3       removes the EXL3 directory (the disk of a 64 GB machine holds the model and one output)
  imatrix         `mixq imatrix`
  convert-gguf    `mixq convert` to GGUF with `--gguf-target` (default: the i-quant ladder with `--rounding
                  hessian`) and the imatrix, every budgeted tensor pinned to the release's 108 GB plan's type (below)
  verify-gguf     `mixq verify` of the GGUF file
  eval-gguf       `mixq eval` of the GGUF against the BF16 model (torch engine)
  load-gguf       llama.cpp loads the GGUF and generates a few tokens
  measure-exl3    `mixq plan --format exl3 --bpw 3.05 --measure stream`: the measured allocation at one layer in
                  memory (its curves kept in WORK), profiled per layer like the verbs above
  measure-gguf    the same for GGUF (MEASURE_GGUF_TARGET, exact rounding, the imatrix when made)
  project         the release hours of each run from its profiles (bench/release/release_hours.py, when present)

Each candidate is scored in its own `mixq eval` (the reference forward runs once per candidate): the two outputs
and the BF16 model do not fit a 64 GB disk together, and a saved reference of 16 x 4096 tokens over the 154880-token
vocabulary would be 40 GB. Peak host memory is the step's main process's (VmHWM, sampled twice a second); the
profile holds the verb's own peaks.

`--steps` picks steps (aliases: convert, verify, eval, engines, exl3, gguf, measure, all; free-exl3 only by name).
The EXL3 rates: a three-layer model planned at 3.05 bpw is another budget than the release (its attention, dense MLP and head are a larger share), so it is
converted at `--bpw 8` with every budgeted role pinned by `--override ROLE=BITS` to the rate the release's 3.05 bpw
plan gives it, the NextN block at the default --mtp-bits as there (rehearsal_model.release_exl3_overrides);
`--exl3-plain` converts at the plain `--bpw 3.05` instead. The GGUF likewise: each budgeted tensor gets, by `--override
^NAME$=TYPE`, the type the release's 108 GB i-quant plan gives most of that tensor's weights over the release layers
of its kind (rehearsal_model.release_gguf_overrides: the routed experts IQ2_S, the NextN block Q4_K, ...; 2.63 bpw at
real widths); `--no-gguf-pin` plans by the target alone.

Time: `--deadline-s` bounds this call; a step is not started with less than MIN_STEP_S left, a running step is
stopped at the deadline or at its `--limits` share (SIGTERM, then SIGKILL); it is then recorded as "incomplete"
with what cut it (never as done, never as 0 s), and an EXL3 conversion continues with `--resume` on the next call.
State lives in WORK (WORK/rehearsal_state.json): a second call on the same WORK skips the finished steps, so one
long rehearsal is a few calls; `--state-from` continues the calls of another machine's WORK (a finished step whose
output is gone there runs again). A GGUF convert cut at its `--gguf-target` is followed, with `--gguf-fallback`,
by one of the same types without `--rounding hessian`, the file verify, eval and llama.cpp read. The result (`--json`): every step's command line, exit code, status, seconds, peak
host memory, its profile, the tail of its output, and what was cut or skipped, over all calls on this WORK.

    python bench/release/rehearsal.py --work /tmp/reh --json OUT.json --steps build,convert-exl3 --deadline-s 540
    python bench/release/rehearsal.py --work /tmp/reh --json OUT.json --small --device cpu --no-profile \\
        --steps build,convert-gguf,verify --gguf-target "--type Q8_0"        # the same driver on a toy model
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(REPO / "bench")]
import rehearsal_model as rm  # noqa: E402
from paths import SHARED  # noqa: E402

STEPS = ("build", "convert-exl3", "verify-exl3", "eval-exl3", "eval-exllamav3", "load-exl3", "free-exl3", "imatrix",
         "convert-gguf", "verify-gguf", "eval-gguf", "load-gguf", "measure-exl3", "measure-gguf", "project")
ALIASES = {"convert": ("convert-exl3", "convert-gguf"), "verify": ("verify-exl3", "verify-gguf"),
           "eval": ("eval-exl3", "eval-gguf"), "engines": ("load-gguf", "load-exl3"),
           "exl3": ("convert-exl3", "verify-exl3", "eval-exl3", "eval-exllamav3", "load-exl3"),
           "gguf": ("imatrix", "convert-gguf", "verify-gguf", "eval-gguf", "load-gguf"),
           "measure": ("measure-exl3", "measure-gguf"),
           "all": tuple(s for s in STEPS if s != "free-exl3")}
PROFILED = {"convert-exl3", "imatrix", "convert-gguf", "eval-exl3", "eval-gguf", "eval-exllamav3",  # take --profile
            "measure-exl3", "measure-gguf"}
EXL3_BPW = 3.05
# every budgeted tensor pinned to the 108 GB plan's type (--gguf-pin), so the target only has to admit them
GGUF_TARGET = "--bpw 8 --gguf-ladder iq --rounding hessian"
# the GGUF measurement's plan (the curves do not depend on it): the IQ ladder the release plans from, exact rounding
MEASURE_GGUF_TARGET = ["--bpw", "4", "--gguf-ladder", "iq"]
EXL3_CHECKS = ("verify-exl3", "eval-exl3", "eval-exllamav3", "load-exl3")
# parts of the model a run never touches, declared to release_hours (any other unmeasured kind is an error there)
ABSENT = {"imatrix": ("nextn", "vision"), "gguf": ("vision",), "gguf-fallback": ("vision",),
          "eval-exl3": ("nextn", "vision"), "eval-gguf": ("nextn", "vision"), "eval-exllamav3": ("nextn", "vision")}
MIN_STEP_S = 20.0  # a step is not started with less than this left before the deadline
KILL_GRACE_S = 10.0  # SIGTERM, then SIGKILL this much later
TAIL = 2000  # characters of a step's output kept in the result


def parse_steps(spec: str) -> list[str]:
    """`a,b,...` (step names or aliases) -> the steps in their run order."""
    want: set[str] = set()
    for s in (x.strip() for x in spec.split(",") if x.strip()):
        if s in ALIASES:
            want.update(ALIASES[s])
        elif s in STEPS:
            want.add(s)
        else:
            raise SystemExit(f"--steps: unknown step {s}; use {', '.join(STEPS)} or {', '.join(ALIASES)}")
    return [s for s in STEPS if s in want]


def parse_limits(spec: str) -> dict[str, float]:
    """`step=seconds,...` -> {step: seconds}."""
    out = {}
    for part in (p for p in spec.split(",") if p.strip()):
        k, _, v = part.partition("=")
        if k.strip() not in STEPS or not v:
            raise SystemExit(f"--limits: {part!r} is not STEP=SECONDS with STEP one of {', '.join(STEPS)}")
        out[k.strip()] = float(v)
    return out


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


class Paths:
    """Where each step reads and writes under WORK."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.model = work / "model"
        self.bf16 = self.model / "bf16"
        self.exl3 = work / "rehearsal-exl3"
        self.imatrix = work / "rehearsal.imatrix.gguf"
        self.gguf = work / "rehearsal.gguf"
        self.profiles = work / "profiles"
        self.logs = work / "logs"
        self.state = work / "rehearsal_state.json"


def vm_hwm_mib(pid: int) -> float | None:
    """Peak resident memory of process `pid` so far (Linux VmHWM), MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the step's process group, SIGKILL after KILL_GRACE_S."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(argv: list[str], log: Path, kill_at: float | None, env: dict) -> dict:
    """Run `argv` (its output to `log`) until it exits or `kill_at`; exit code, seconds, peak RSS, cut."""
    t0 = time.time()
    peak = None
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        cut = None
        try:
            while proc.poll() is None:
                peak = max(filter(None, (peak, vm_hwm_mib(proc.pid))), default=None)
                if kill_at is not None and time.time() >= kill_at:
                    cut = "time limit"
                    stop(proc)
                    break
                time.sleep(0.5)
        except KeyboardInterrupt:  # the driver itself is stopped (SIGINT, or SIGTERM through `main`)
            cut = "driver stopped"
            stop(proc)
        rc = proc.wait()
    text = log.read_text(errors="replace")
    return {"rc": rc, "seconds": round(time.time() - t0, 2), "peak_rss_mib": peak, "cut": cut,
            "output_tail": text[-TAIL:]}


class Rehearsal:
    """One call of the driver on WORK: the steps it runs, the state it keeps between calls, the result."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.p = Paths(a.work.resolve())
        self.p.work.mkdir(parents=True, exist_ok=True)
        for d in (self.p.profiles, self.p.logs):
            d.mkdir(exist_ok=True)
        self.t0 = time.time()
        self.deadline = self.t0 + a.deadline_s if a.deadline_s else None
        self.limits = parse_limits(a.limits)
        if not self.p.state.is_file() and a.state_from is not None and a.state_from.is_file():
            shutil.copyfile(a.state_from, self.p.state)  # an earlier machine's calls, continued on this one
        self.state = json.loads(self.p.state.read_text()) if self.p.state.is_file() else {"calls": [], "steps": {}}
        self.call = len(self.state["calls"]) + 1
        self.state["calls"].append({"call": self.call, "steps": a.steps, "deadline_s": a.deadline_s,
                                    "profile": not a.no_profile, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                          time.gmtime())})
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.stopped = False
        self.steps: list[str] = []

    # --- bookkeeping ----------------------------------------------------------------------------------------

    def record(self, step: str, entry: dict) -> None:
        """Append one attempt of `step` to the state and save it (a later call sees it even if this one dies)."""
        st = self.state["steps"].setdefault(step, {"attempts": []})
        st["attempts"].append({"call": self.call, **entry})
        st["status"] = entry["status"]
        self.save()

    def done(self, step: str) -> bool:
        return self.state["steps"].get(step, {}).get("status") == "done"

    def latest(self, step: str) -> dict:
        return (self.state["steps"].get(step, {}).get("attempts") or [{}])[-1]

    def output_present(self, step: str) -> bool:
        """Whether a finished step's output is still in WORK (a fresh machine continuing from a carried state
        has lost it: the step runs again)."""
        if step == "build":
            return rm.built(self.p.model)
        if step == "convert-exl3":
            return (self.p.exl3 / "config.json").is_file() or self.done("free-exl3")
        if step == "imatrix":
            return self.p.imatrix.is_file()
        if step == "convert-gguf":
            return self.p.gguf.is_file()
        return True

    def save(self) -> None:
        tmp = self.p.state.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2) + "\n")
        tmp.replace(self.p.state)

    def cached(self, key: str, make):
        """`make()` once per WORK (the release plans behind the overrides take a while on a busy host)."""
        cache = self.state.setdefault("cache", {})
        if key not in cache:
            cache[key] = make()
            self.save()
        return cache[key]

    def shown(self, argv: list[str]) -> str:
        """The command line as recorded: WORK, SHARED and the repo named, not this machine's paths."""
        text = shlex.join(argv)
        for path, name in ((str(self.p.work), "WORK"), (str(SHARED), "SHARED"), (str(REPO) + "/", ""),
                           (sys.executable, "python")):
            text = text.replace(path, name)
        return text

    def kill_at(self, step: str) -> float | None:
        ends = [t for t in (self.deadline, time.time() + self.limits[step] if step in self.limits else None) if t]
        return min(ends) if ends else None

    # --- running one step -------------------------------------------------------------------------------------

    def execute(self, step: str, argv: list[str], *, profile: bool = True, note: dict | None = None) -> dict:
        """Run one step's command, with `--profile` when its verb takes one; record and return the attempt."""
        prof = self.p.profiles / f"{step}.call{self.call}.json"
        if profile and step in PROFILED and not self.a.no_profile:
            prof.unlink(missing_ok=True)
            argv = argv + ["--profile", str(prof)]
        started = round(time.time() - self.t0, 1)
        res = run_step(argv, self.p.logs / f"{step}.call{self.call}.log", self.kill_at(step), self.env)
        status = "done" if res["rc"] == 0 and res["cut"] is None else ("incomplete" if res["cut"] else "failed")
        entry = {"status": status, "command": self.shown(argv), "started_at_s": started, **res, **(note or {})}
        if prof.is_file():
            try:
                entry["profile"] = json.loads(prof.read_text())
            except ValueError as e:  # a profile cut mid-write by the time limit
                entry["profile"] = {"unreadable": str(e)}
        elif step in PROFILED:
            entry["profile"] = None if self.a.no_profile else "not written"
        self.record(step, entry)
        print(f"[{step}] {status} rc={res['rc']} {res['seconds']} s" + (f" (cut: {res['cut']})" if res["cut"] else ""),
              file=sys.stderr, flush=True)
        return entry

    def skip(self, step: str, why: str) -> None:
        self.record(step, {"status": "skipped", "why": why})
        print(f"[{step}] skipped: {why}", file=sys.stderr, flush=True)

    def mixq(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "mixq", *args]

    def device(self) -> list[str]:
        return ["--device", self.a.device] if self.a.device else []

    # --- the steps --------------------------------------------------------------------------------------------

    def step_build(self) -> None:
        if rm.built(self.p.model) and (not self.a.fp8 or rm.built(self.p.model, "fp8")):
            self.skip("build", "already built in WORK")
            return
        out = self.p.work / "build.json"
        argv = [sys.executable, str(REPO / "bench" / "release" / "rehearsal_model.py"), str(self.p.model),
                "--experts", str(self.a.experts), "--kinds", self.a.kinds, "--json", str(out)]
        argv += ([] if self.a.fp8 else ["--no-fp8"]) + (["--small"] if self.a.small else []) + self.device()
        e = self.execute("build", argv)
        if out.is_file():
            e["built"] = json.loads(out.read_text())
            self.record_update("build", e)

    def record_update(self, step: str, entry: dict) -> None:
        self.state["steps"][step]["attempts"][-1] = {"call": self.call, **entry}
        self.save()

    def step_convert_exl3(self) -> None:
        out = self.p.exl3
        resume = (out / ".mixq-job" / "job.json").is_file()
        if not resume and out.exists():
            shutil.rmtree(out)  # neither a job to continue nor a finished conversion (checked by `done`)
        if self.a.exl3_plain:
            target = ["--bpw", str(EXL3_BPW)]
            rates = None
        else:
            rates = self.cached("exl3_overrides", lambda: rm.release_exl3_overrides(
                EXL3_BPW, len(rm.parse_kinds(self.a.kinds))))
            target = ["--bpw", "8"] + [x for o in rates for x in ("--override", o)]
        argv = self.mixq("convert", str(self.p.bf16), str(out), "--format", "exl3", *target, *self.device())
        argv += ["--resume"] if resume else []
        self.execute("convert-exl3", argv, note={"resumed": resume, "release_overrides": rates,
                                                 "release_bpw": EXL3_BPW})

    def step_imatrix(self) -> None:
        self.execute("imatrix", self.mixq("imatrix", str(self.p.bf16), str(self.p.imatrix), "--overwrite",
                                          *self.device()))

    def step_convert_gguf(self) -> None:
        if "free-exl3" in self.steps and self.p.exl3.exists():
            self.skip("convert-gguf", "the EXL3 output is still on disk (free-exl3 removes it once checked)")
            return
        target, note = self.a.gguf_target, {}
        cut = [a for a in self.state["steps"].get("convert-gguf", {}).get("attempts", [])
               if a.get("cut") and a.get("target") == self.a.gguf_target]
        if cut and self.a.gguf_fallback:  # the file the checks need, at the same types, once the target was timed
            target = self.a.gguf_fallback
            note["fallback"] = f"the convert with {self.a.gguf_target!r} was cut in call {cut[-1]['call']}"
        argv = self.mixq("convert", str(self.p.bf16), str(self.p.gguf), *shlex.split(target), "--overwrite",
                         *self.device())
        if not self.a.no_gguf_pin and ("--bpw" in target or "--size" in target):
            cfg = json.loads((self.p.bf16 / "config.json").read_text())
            pins = self.cached("gguf_overrides", lambda: rm.release_gguf_overrides(cfg))
            argv += [x for o in pins for x in ("--override", o)]
        if self.p.imatrix.is_file():
            argv += ["--imatrix", str(self.p.imatrix)]
        self.execute("convert-gguf", argv, note={"target": target, **note})

    def step_measure(self, step: str, fmt: str) -> None:
        """`mixq plan --measure stream` (one layer in memory): the measured allocation's cost per layer kind, its
        curves kept in WORK; GGUF with the imatrix when one was made (the conversion's own)."""
        curves = self.p.work / f"curves-{fmt}.json"
        target = ["--bpw", str(EXL3_BPW)] if fmt == "exl3" else MEASURE_GGUF_TARGET
        argv = self.mixq("plan", str(self.p.bf16), "--format", fmt, *target, "--measure", "stream",
                         "--measure-out", str(curves), "--overwrite", *self.device())
        if fmt == "gguf" and self.p.imatrix.is_file():
            argv += ["--imatrix", str(self.p.imatrix)]
        self.execute(step, argv, note={"curves": curves.name})

    def ready(self, step: str, path: Path, source: str) -> bool:
        """Whether `source` finished and its output is still there; else `step` is recorded as skipped."""
        if not self.done(source):
            self.skip(step, f"{source} has not finished")
        elif not path.exists():
            self.skip(step, f"{path.name} is not there (free-exl3 removed it)")
        else:
            return True
        return False

    def step_verify(self, step: str, path: Path, source: str) -> None:
        if not self.ready(step, path, source):
            return
        self.execute(step, self.mixq("verify", str(path), "--json"))

    def eval_args(self) -> list[str]:
        return ["--text", str(SHARED / "data" / "heldout.txt"), "--ctx", str(self.a.eval_ctx),
                "--windows", str(self.a.eval_windows), "--overwrite"]

    def step_eval(self, step: str, path: Path, source: str, engine: list[str]) -> None:
        if engine and not has_module("exllamav3"):
            self.skip(step, "exllamav3 does not import here")
            return
        if not self.ready(step, path, source):
            return
        report = self.p.work / f"{step}.json"
        report.unlink(missing_ok=True)
        e = self.execute(step, self.mixq("eval", str(self.p.bf16), str(path), *self.eval_args(), *engine,
                                         "--json", str(report), *([] if engine else self.device())))
        if e["status"] == "done" and report.is_file():
            e["report"] = json.loads(report.read_text())
            self.record_update(step, e)

    def step_free_exl3(self) -> None:
        if not self.p.exl3.exists():
            self.skip("free-exl3", "no EXL3 directory")
            return
        if not self.done("convert-exl3"):
            self.skip("free-exl3", "convert-exl3 has not finished: its job is kept for --resume")
            return
        waiting = [s for s in EXL3_CHECKS if s in self.steps and (
            self.latest(s).get("status") in (None, "incomplete")
            or str(self.latest(s).get("why", "")).startswith(("deadline", "the driver was stopped")))]
        if waiting:
            self.skip("free-exl3", f"kept for {', '.join(waiting)}")
            return
        freed = sum(f.stat().st_size for f in self.p.exl3.rglob("*") if f.is_file())
        shutil.rmtree(self.p.exl3)
        self.record("free-exl3", {"status": "done", "freed_bytes": freed, "seconds": 0.0})

    def step_load(self, step: str, flag: str, path: Path, source: str, module: str) -> None:
        if not has_module(module):
            self.skip(step, f"{module} does not import here")
            return
        if not self.ready(step, path, source):
            return
        report = self.p.work / f"{step}.json"
        report.unlink(missing_ok=True)
        e = self.execute(step, [sys.executable, str(REPO / "bench" / "engines" / "generate_check.py"), flag, str(path),
                                "--tokens", str(self.a.tokens), "--json", str(report)])
        if report.is_file():
            e["generated"] = json.loads(report.read_text())
            self.record_update(step, e)

    def profile_runs(self) -> dict[str, list[dict] | dict]:
        """label -> the profiles of one verb's run, from the attempts recorded in the state (so a fresh machine
        has them too): the EXL3 conversion's calls since its last fresh start (one run continued with --resume),
        the last hessian GGUF convert (cut or not), the last fallback GGUF, the imatrix and evals that finished.
        A run that cannot be priced maps to why (a dict) instead."""
        def atts(step: str) -> list[dict]:
            return [a for a in self.state["steps"].get(step, {}).get("attempts", []) if isinstance(a.get("profile"),
                                                                                                   dict)]
        runs: dict[str, list[dict]] = {}
        exl3 = [a for a in self.state["steps"].get("convert-exl3", {}).get("attempts", []) if "resumed" in a]
        fresh = max((i for i, a in enumerate(exl3) if not a["resumed"]), default=None)
        if fresh is not None:
            run = exl3[fresh:]
            lost = [a["call"] for a in run if not isinstance(a.get("profile"), dict)]
            # a call of the run without its profile would leave its layers out: the run is not priced
            runs["exl3"] = [a["profile"] for a in run] if not lost else {"calls without a profile": lost}
        gguf = atts("convert-gguf")
        timed = [a for a in gguf if a.get("target") == self.a.gguf_target]
        if timed:
            runs["gguf"] = [timed[-1]["profile"]]
        fallback = [a for a in gguf if a.get("fallback") and a["status"] == "done"]
        if fallback:
            runs["gguf-fallback"] = [fallback[-1]["profile"]]
        for step in ("imatrix", "eval-exl3", "eval-gguf", "eval-exllamav3"):
            done = [a for a in atts(step) if a["status"] == "done"]
            if done:
                runs[step] = [done[-1]["profile"]]
        return runs

    def step_project(self) -> None:
        """bench/release/release_hours.py once per run (a run it cannot price does not hide the others): the
        release hours of each, its layer kinds counted from the real config."""
        script = REPO / "bench" / "release" / "release_hours.py"
        if not script.is_file():
            self.skip("project", "projection: not available (bench/release/release_hours.py is missing)")
            return
        runs = self.profile_runs()
        if not runs:
            self.skip("project", "no profile recorded (run the steps with profiles on)")
            return
        t0 = time.time()
        out: dict[str, dict] = {}
        for label, profiles in runs.items():
            if isinstance(profiles, dict):
                out[label] = {"not priced": profiles}
                continue
            files = []
            for i, prof in enumerate(profiles):
                f = self.p.profiles / f"project-{label}-{i}.json"
                f.write_text(json.dumps(prof) + "\n")
                files.append(str(f))
            res_file = self.p.work / f"projection-{label}.json"
            res_file.unlink(missing_ok=True)
            argv = [sys.executable, str(script), "--rehearsal-config", str(self.p.bf16 / "config.json"),
                    "--run", f"{label}={','.join(files)}", "--out", str(res_file)]
            argv += ["--absent", f"{label}:{','.join(ABSENT[label])}"] if ABSENT.get(label) else []
            r = run_step(argv, self.p.logs / f"project-{label}.call{self.call}.log", self.kill_at("project"), self.env)
            out[label] = {"command": self.shown(argv), "rc": r["rc"], "seconds": r["seconds"]}
            if res_file.is_file():
                out[label]["projection"] = json.loads(res_file.read_text())
            else:
                out[label]["output_tail"] = r["output_tail"]
        ok = all("projection" in v for v in out.values())
        self.record("project", {"status": "done" if ok else "failed", "seconds": round(time.time() - t0, 2),
                                "projection": out})
        print(f"[project] {'done' if ok else 'failed'}: " + ", ".join(
            f"{k} {'priced' if 'projection' in v else 'not priced'}" for k, v in out.items()), file=sys.stderr,
            flush=True)

    # --- the call ---------------------------------------------------------------------------------------------

    def run(self, steps: list[str]) -> dict:
        table = {"build": self.step_build, "convert-exl3": self.step_convert_exl3, "imatrix": self.step_imatrix,
                 "convert-gguf": self.step_convert_gguf,
                 "verify-exl3": lambda: self.step_verify("verify-exl3", self.p.exl3, "convert-exl3"),
                 "verify-gguf": lambda: self.step_verify("verify-gguf", self.p.gguf, "convert-gguf"),
                 "eval-exl3": lambda: self.step_eval("eval-exl3", self.p.exl3, "convert-exl3", []),
                 "eval-gguf": lambda: self.step_eval("eval-gguf", self.p.gguf, "convert-gguf", []),
                 "eval-exllamav3": lambda: self.step_eval("eval-exllamav3", self.p.exl3, "convert-exl3",
                                                          ["--engine", "exllamav3"]),
                 "free-exl3": self.step_free_exl3,
                 "load-gguf": lambda: self.step_load("load-gguf", "--gguf", self.p.gguf, "convert-gguf", "llama_cpp"),
                 "load-exl3": lambda: self.step_load("load-exl3", "--exl3", self.p.exl3, "convert-exl3", "exllamav3"),
                 "measure-exl3": lambda: self.step_measure("measure-exl3", "exl3"),
                 "measure-gguf": lambda: self.step_measure("measure-gguf", "gguf"),
                 "project": self.step_project}
        self.steps = steps
        for step in steps:
            if self.stopped:
                self.skip(step, "the driver was stopped")
                continue
            if self.done(step) and self.output_present(step) and step != "project" and not self.a.redo:
                print(f"[{step}] done by an earlier call", file=sys.stderr, flush=True)
                continue
            if self.deadline is not None and self.deadline - time.time() < MIN_STEP_S:
                self.skip(step, f"deadline: less than {MIN_STEP_S:g} s left")
                continue
            table[step]()
            last = self.state["steps"].get(step, {}).get("attempts", [{}])[-1]
            self.stopped = last.get("cut") == "driver stopped"
        return self.result()

    def result(self) -> dict:
        """Every step over all calls on WORK: its latest attempt's fields, all attempts, what was cut/skipped."""
        steps = {}
        for name in STEPS:
            st = self.state["steps"].get(name)
            if st is None:
                continue
            steps[name] = {"status": st["status"], "attempts": st["attempts"],
                           "seconds": round(sum(a.get("seconds", 0.0) for a in st["attempts"]), 2),
                           "profiles": [a["profile"] for a in st["attempts"] if isinstance(a.get("profile"), dict)]}
        cut = [{"step": n, "call": a["call"], "cut": a["cut"], "seconds": a["seconds"]}
               for n, s in steps.items() for a in s["attempts"] if a.get("cut")]
        skipped = [{"step": n, "call": a["call"], "why": a["why"]}
                   for n, s in steps.items() for a in s["attempts"] if a["status"] == "skipped"]
        model = {"experts": self.a.experts, "kinds": rm.parse_kinds(self.a.kinds), "small": self.a.small,
                 "fp8": self.a.fp8, "release_layers": rm.RELEASE_LAYERS, "release_experts": rm.RELEASE_EXPERTS}
        return {"model": model, "calls": self.state["calls"], "steps": steps, "cut": cut, "skipped": skipped,
                "incomplete": [n for n, s in steps.items() if s["status"] in ("incomplete", "failed")],
                "projection": (steps.get("project", {}).get("attempts") or [{}])[-1].get(
                    "projection", "projection: not available")}

    def write_result(self, path: Path) -> dict:
        res = self.result()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=2) + "\n")
        return res


def interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="the model, outputs and state (kept across calls)")
    ap.add_argument("--json", type=Path, required=True, help="the result file")
    ap.add_argument("--steps", default="all", help=f"steps of {', '.join(STEPS)} (or {', '.join(ALIASES)})")
    ap.add_argument("--deadline-s", type=float, default=None, help="stop this call after this many seconds")
    ap.add_argument("--limits", default="", help="STEP=SECONDS,... per-step limits")
    ap.add_argument("--experts", type=int, default=rm.RELEASE_EXPERTS)
    ap.add_argument("--kinds", default=",".join(rm.DEFAULT_KINDS))
    ap.add_argument("--fp8", action="store_true", help="build the FP8 copy too")
    ap.add_argument("--small", action="store_true", help="toy widths (CPU tests)")
    ap.add_argument("--device", default=None, help="--device of every mixq verb [default: theirs]")
    ap.add_argument("--exl3-plain", action="store_true", help="EXL3 at the plain --bpw 3.05 (not the release rates)")
    ap.add_argument("--gguf-target", default=GGUF_TARGET, help="the GGUF convert's target options")
    ap.add_argument("--gguf-fallback", default="",
                    help="target options of the GGUF the checks use once a --gguf-target convert was cut (e.g. the "
                         "same plan without --rounding hessian)")
    ap.add_argument("--no-gguf-pin", action="store_true",
                    help="plan the GGUF by its --bpw/--size alone (not pinned to the 108 GB plan's types)")
    ap.add_argument("--state-from", type=Path, help="a WORK/rehearsal_state.json of earlier calls (another machine)")
    ap.add_argument("--eval-ctx", type=int, default=4096)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8, help="tokens the engines generate")
    ap.add_argument("--no-profile", action="store_true", help="run the verbs without --profile")
    ap.add_argument("--redo", action="store_true", help="run the picked steps even where an earlier call finished")
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    steps = parse_steps(a.steps)
    signal.signal(signal.SIGTERM, interrupt)  # a stopped driver stops its step and still writes the result
    reh = Rehearsal(a)
    res = reh.run(steps)
    reh.write_result(a.json)
    bad = [n for n in steps if res["steps"].get(n, {}).get("status") == "failed"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
