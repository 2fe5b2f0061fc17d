"""KLD on held-out text against KLD on the model's own replies, for the k256 GGUF and EXL3 files.

    python bench/quality/own_replies_kld.py --phase convert [--set gguf|exl3] [--device cuda]  # the files, once
    python bench/quality/own_replies_kld.py --phase eval [--set gguf|exl3]    # both scores into the result file

Files (in $MIXQ_BENCH_WORK/own-replies-k256, made once and reused): `mixq convert --type Q4_K_M` and `--type Q2_K`
GGUFs of glm5next-k256 (no imatrix), and `mixq convert --format exl3 --bpw 3.05` (calibrated on calibration.txt).
Each is scored by `mixq eval --engine torch` against the BF16 checkpoint twice:
  held-out  --windows x --ctx tokens of heldout.txt, the second half of each window scored (llama-perplexity);
  replies   `--text generated:16 --prompts heldout.txt`: the reference continues 16 prompts of --prompt-tokens
            tokens of heldout.txt by --gen-tokens tokens (8 greedy, 8 sampled at temperature 1, seeds 1,3,...),
            and only the continuation tokens are scored. The first set scored generates the replies, keeps their
            token file and scores it again from that file (`--text FILE`: the reuse check, same scores); a set
            scored later (the EXL3 one) is scored on that same token file.
The result JSON (paths relative to the repo) holds both reports, the side-by-side rows and every step's wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from paths import REPO, SHARED, WORK, repo_relative  # noqa: E402

MODEL = SHARED / "models" / "glm5next-k256"
TEXT = SHARED / "data" / "heldout.txt"
CALIBRATION = SHARED / "data" / "calibration.txt"
MIXQ = [sys.executable, "-m", "mixq"]
GGUF_TYPES = ("Q4_K_M", "Q2_K")
EXL3_BPW = "3.05"
RESULT = REPO / "bench" / "results" / "own_replies_kld_k256.json"


def log(msg: str) -> None:
    print(f"[own_replies {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(res: dict, name: str, cmd: list, work: Path) -> None:
    t0 = time.time()
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    (work / f"{name}.log").write_text(r.stdout[-20000:] + "\n" + r.stderr[-20000:])
    res.setdefault("steps", {})[name] = {"seconds": round(time.time() - t0, 1), "returncode": r.returncode}
    log(f"{name}: {res['steps'][name]['seconds']} s rc={r.returncode}")
    if r.returncode:
        raise SystemExit(f"{name} failed:\n{(r.stdout + r.stderr)[-3000:]}")


def files(work: Path) -> dict[str, dict[str, Path]]:
    """The candidates by set: the GGUFs and the EXL3 directory (converted and scored in separate runs)."""
    return {"gguf": {t: work / f"glm5next-k256-{t}.gguf" for t in GGUF_TYPES},
            "exl3": {f"exl3-{EXL3_BPW}": work / f"glm5next-k256-exl3-{EXL3_BPW}bpw"}}


def convert_phase(a, work: Path, res: dict) -> None:
    if a.set in ("gguf", "all"):
        for t, f in files(work)["gguf"].items():
            if not f.exists():
                run(res, f"convert-{t}", MIXQ + ["convert", MODEL, f, "--format", "gguf", "--type", t], work)
    if a.set in ("exl3", "all"):
        d = files(work)["exl3"][f"exl3-{EXL3_BPW}"]
        if not (d / "mixq_manifest.json").is_file():
            run(res, f"convert-exl3-{EXL3_BPW}", MIXQ + ["convert", MODEL, d, "--format", "exl3", "--bpw", EXL3_BPW,
                                                        "--calibration", CALIBRATION, "--rows", a.rows,
                                                        "--device", a.device], work)


def side_by_side(held: dict, own: dict) -> list[dict]:
    rows = []
    by_path = {c["path"]: c for c in own["candidates"]}
    for c in held["candidates"]:
        o = by_path[c["path"]]
        rows.append({"file": Path(c["path"]).name, "format": c["format"], "engine": c["engine"], "bytes": c["bytes"],
                     "bpw": round(c["bpw"], 4),
                     "heldout": {k: c[k] for k in ("kld_mean", "kld_mean_err", "kld_p99", "top1", "positions")},
                     "own_replies": {k: o[k] for k in ("kld_mean", "kld_mean_err", "kld_p99", "top1", "positions")},
                     "kld_ratio": o["kld_mean"] / c["kld_mean"] if c["kld_mean"] > 0 else None})
    return rows


def eval_phase(a, work: Path, res: dict) -> None:
    """Score the sets asked for on held-out text and on the replies: the first set scored generates the replies
    (and scores them again from their token file, the reuse check); a later set scores that token file."""
    common = ["--engine", "torch", "--device", a.eval_device, "--overwrite"]
    tokens = work / "own.tokens.json"
    for name in (("gguf", "exl3") if a.set == "all" else (a.set,)):
        cands = list(files(work)[name].values())
        missing = [str(c) for c in cands if not c.exists()]
        if missing:
            raise SystemExit(f"convert first (--phase convert --set {name}): missing {missing}")
        held, own = work / f"heldout-{name}.json", work / f"own-{name}.json"
        run(res, f"eval-heldout-{name}", MIXQ + ["eval", MODEL, *cands, "--text", TEXT, "--ctx", a.ctx, "--windows",
                                                 a.windows, "--json", held, *common], work)
        if not tokens.is_file():
            run(res, f"eval-own-replies-{name}", MIXQ + [
                "eval", MODEL, *cands, "--text", f"generated:{a.replies}", "--prompts", TEXT, "--gen-tokens",
                a.gen_tokens, "--gen-prompt-tokens", a.prompt_tokens, "--save-generated", tokens, "--json", own,
                *common], work)
            again = work / f"own-{name}-again.json"
            run(res, f"eval-own-replies-{name}-from-file", MIXQ + ["eval", MODEL, *cands, "--text", tokens, "--json",
                                                                  again, *common], work)
            o, g = (json.loads(p.read_text()) for p in (own, again))
            keys = ("kld_mean", "top1", "ppl", "positions")
            res["reuse_identical"] = [[c[k] for k in keys] for c in o["candidates"]] == \
                [[c[k] for k in keys] for c in g["candidates"]]
        else:
            run(res, f"eval-own-replies-{name}", MIXQ + ["eval", MODEL, *cands, "--text", tokens, "--json", own,
                                                         *common], work)
        h, o = (json.loads(p.read_text()) for p in (held, own))
        res.setdefault("reports", {})[name] = {"heldout": h, "own_replies": o}
    res["rows"] = [r for name in ("gguf", "exl3") if name in res.get("reports", {})
                   for r in side_by_side(res["reports"][name]["heldout"], res["reports"][name]["own_replies"])]
    res["settings"] = {"ctx": a.ctx, "windows": a.windows, "replies": a.replies, "gen_tokens": a.gen_tokens,
                       "prompt_tokens": a.prompt_tokens, "device": a.eval_device, "exl3_rows": a.rows}


def import_phase(a, res: dict) -> None:
    """A set scored elsewhere by the same commands (`heldout-SET.json`, `own-SET.json` in --reports, the replies
    scored from this run's token file): its rows joined to the result."""
    h, o = (json.loads((a.reports / f"{k}-{a.set}.json").read_text()) for k in ("heldout", "own"))
    res.setdefault("reports", {})[a.set] = {"heldout": h, "own_replies": o}
    res["rows"] = [r for name in ("gguf", "exl3") if name in res["reports"]
                   for r in side_by_side(res["reports"][name]["heldout"], res["reports"][name]["own_replies"])]
    res.setdefault("imported", {})[a.set] = a.note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=("convert", "eval", "all", "import"), default="all")
    ap.add_argument("--reports", type=Path, help="--phase import: the directory of a set's two reports")
    ap.add_argument("--note", default="", help="--phase import: where and how that set was converted and scored")
    ap.add_argument("--set", choices=("gguf", "exl3", "all"), default="all")
    ap.add_argument("--work", type=Path, default=WORK / "own-replies-k256")
    ap.add_argument("--json", type=Path, default=RESULT)
    ap.add_argument("--device", default="cpu", help="device of the EXL3 conversion")
    ap.add_argument("--eval-device", default="cpu", help="device of `mixq eval` (the reference and candidates)")
    ap.add_argument("--rows", type=int, default=16, help="EXL3 calibration rows of 512 tokens")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--replies", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    res = json.loads(a.json.read_text()) if a.json.is_file() else {}
    res["model"] = MODEL
    try:
        if a.phase in ("convert", "all"):
            convert_phase(a, a.work, res)
        if a.phase in ("eval", "all"):
            eval_phase(a, a.work, res)
        if a.phase == "import":
            import_phase(a, res)
    finally:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(repo_relative(res), indent=1) + "\n")
    for r in res.get("rows", []):
        h, o = r["heldout"], r["own_replies"]
        log(f"{r['file']:40s} held-out KLD {h['kld_mean']:.4f} top-1 {100 * h['top1']:.1f}%  |  own replies KLD "
            f"{o['kld_mean']:.4f} top-1 {100 * o['top1']:.1f}%")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
