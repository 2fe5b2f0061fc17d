"""Wall time of a GGUF conversion at --threads 1 and N: glm5next-k256, Q4_K_M with IQ2_S routed experts + imatrix.

    python bench/speed/gguf_threads.py                       # threads 1 and 2, 2 alternating rounds, best of each
    python bench/speed/gguf_threads.py --threads 1,2,4 --rounds 3 --imatrix my.imatrix.gguf

The row is bench/quality/iq_ladder.py's "Q4_K_M, experts IQ2_S" file (`mixq convert --type Q4_K_M --tensor-type
'blk\\.[0-3]\\.ffn_(gate|up|down)_exps=IQ2_S' --imatrix IMX`), where the i-quant encoders are ~85% of the time.
Each run is a fresh `python -m mixq convert` (Python start, imports and worker spawn included). Printed per thread
count: best wall seconds, CPU seconds of the process tree, the speedup over 1 thread, and whether the file's
sha256 equals the 1-thread file. On shared cores the speedup is a lower bound, so the bench also measures the
ceiling before and after: N copies of one single-threaded encoder loop started together vs one alone (N on N idle
cores). Results go to bench/results/gguf-threads.json.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from paths import REPO, SHARED, WORK, repo_relative  # noqa: E402

from mixq.formats.atomic import write_json  # noqa: E402

MODEL = SHARED / "models" / "glm5next-k256"
CALIBRATION = SHARED / "data" / "calibration.txt"
EXPS = r"blk\.[0-3]\.ffn_(gate|up|down)_exps"


def log(msg: str) -> None:
    print(f"[gguf_threads {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def ensure_imatrix(path: Path, rows: int) -> Path:
    """bench/quality/iq_ladder.py's imatrix (mixq's, from data/calibration.txt); made once (~7 min on 2 cores)."""
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("partial-" + path.name)
    code = ("import sys; from mixq.conversion.gguf.imatrix import collect_imatrix; "
            "from mixq.formats.imatrix_file import write_imatrix; "
            "write_imatrix(sys.argv[4], collect_imatrix(sys.argv[1], [sys.argv[2]], rows=int(sys.argv[3]), seq_len=512))")
    log(f"making the imatrix {path}")
    subprocess.run([sys.executable, "-c", code, str(MODEL), str(CALIBRATION), str(rows), str(tmp)], check=True)
    os.replace(tmp, path)
    return path


PROBE = ("import sys, time, numpy as np; from mixq.quant.ggml import encoders; "
         "x = np.random.default_rng(0).standard_normal((256, 2048)).astype(np.float32); encoders.quantize(x, 'Q4_K'); "
         "t = time.perf_counter(); [encoders.quantize(x, 'Q4_K') for _ in range(int(sys.argv[1]))]; "
         "print(time.perf_counter() - t)")


def capacity(n: int, reps: int = 12) -> float:
    """Cores this job really gets now: n copies of one single-threaded encoder loop started together vs one alone
    (n on n idle cores; less when other jobs share them). The ceiling for the --threads n speedup."""
    def timed(k: int) -> float:
        ps = [subprocess.Popen([sys.executable, "-c", PROBE, str(reps)], stdout=subprocess.PIPE, text=True)
              for _ in range(k)]
        return max(float(p.communicate()[0]) for p in ps)
    one = timed(1)
    return round(n * one / timed(n), 2)


def convert(out: Path, imx: Path, threads: int, qtype: str) -> tuple[float, float, str]:
    """One conversion in a fresh process: (wall s, CPU s of it and its workers, sha256 of the file)."""
    cmd = [sys.executable, "-m", "mixq", "convert", str(MODEL), str(out), "--format", "gguf", "--type", "Q4_K_M",
           "--tensor-type", f"{EXPS}={qtype}", "--imatrix", str(imx), "--threads", str(threads), "--json"]
    c0, t0 = children_cpu(), time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall, cpu = time.perf_counter() - t0, children_cpu() - c0
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    out.unlink()
    return wall, cpu, digest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2", help="thread counts to time (the first is the baseline)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best wall time of each count counts")
    ap.add_argument("--type", dest="qtype", default="IQ2_S", help="routed-expert type")
    ap.add_argument("--work", default=str(WORK))
    ap.add_argument("--imatrix", default=None, help="imatrix file [default: WORK/k256/imatrix-r32.gguf, made if absent]")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "gguf-threads.json"))
    a = ap.parse_args(argv)
    counts = [int(t) for t in a.threads.split(",") if t]
    work = Path(a.work) / "k256-threads"
    work.mkdir(parents=True, exist_ok=True)
    imx = Path(a.imatrix) if a.imatrix else ensure_imatrix(Path(a.work) / "k256" / "imatrix-r32.gguf", 32)
    runs: dict[int, list[dict]] = {n: [] for n in counts}
    load0 = os.getloadavg()
    top = max(counts)
    caps = [capacity(top)]
    log(f"capacity before: {top} single-threaded encoders together ran {caps[0]:.2f}x one alone")
    for r in range(a.rounds):
        for n in counts:
            wall, cpu, digest = convert(work / f"k256-exps-{a.qtype}-t{n}.gguf", imx, n, a.qtype)
            runs[n].append({"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "sha256": digest,
                            "load1": round(os.getloadavg()[0], 2)})
            log(f"round {r + 1}: --threads {n}: {wall:.1f} s wall, {cpu:.1f} s CPU, load {os.getloadavg()[0]:.2f}")
    caps.append(capacity(top))
    log(f"capacity after: {caps[1]:.2f}x")
    base = min(x["wall_s"] for x in runs[counts[0]])
    ref = runs[counts[0]][0]["sha256"]
    rows = []
    for n in counts:
        best = min(runs[n], key=lambda x: x["wall_s"])
        rows.append({"threads": n, "wall_s": best["wall_s"], "cpu_s": best["cpu_s"],
                     "speedup": round(base / best["wall_s"], 2),
                     "identical": all(x["sha256"] == ref for x in runs[n]), "runs": runs[n]})
    res = {"model": "glm5next-k256", "row": f"Q4_K_M, experts {a.qtype}, imatrix {repo_relative(imx)}",
           "cores": os.cpu_count(),
           "capacity": {"threads": top, "before": caps[0], "after": caps[1]},
           "load_before": [round(v, 2) for v in load0], "load_after": [round(v, 2) for v in os.getloadavg()],
           "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(a.out, res)
    print(f"k256, Q4_K_M with {a.qtype} experts + imatrix, {os.cpu_count()} cores, "
          f"load average {load0[0]:.2f} -> {os.getloadavg()[0]:.2f}; {top} encoders together ran "
          f"{caps[0]:.2f}x / {caps[1]:.2f}x one alone (before / after: the speedup ceiling here)")
    print("| --threads | wall s (best) | CPU s | speedup | bytes identical to --threads 1 |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['threads']} | {row['wall_s']:.1f} | {row['cpu_s']:.1f} | {row['speedup']:.2f}x | "
              f"{'yes' if row['identical'] else 'NO'} |")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
