"""exllamav3's converter against mixq's role and measured plans at equal bytes, scored in both forwards.

On the trained k256 fixture, for each bitrate B (default 2.5, 3.05, 4.0):
  1. exllamav3 1.6.5's converter at `-b B` (wall time; its bytes = the safetensors of the directory it writes);
  2. mixq's role plan, `mixq convert --format exl3 --size <those bytes>`;
  3. mixq's measured plan at the same bytes, from one set of trellis error curves (`mixq plan --measure`, measured
     once: the curves do not depend on the target);
then every directory is scored by `mixq eval` against the BF16 model on the same held-out windows, with mixq's
own streamed forward (`--engine torch`) and with exllamav3's (`--engine exllamav3`).

Two phases, so the work can span two runs (the work directory persists between them):

    python bench/quality/exl3_side_by_side.py --work /tmp/sbs --json $OUT/sbs.json --phase convert
    python bench/quality/exl3_side_by_side.py --work /tmp/sbs --json $OUT/sbs.json --phase eval --markdown $OUT/sbs.md

The JSON is rewritten after every step, so a call cut by its time limit keeps what finished.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from paths import SHARED  # noqa: E402

MODEL = SHARED / "models" / "glm5next-k256"
TEXT = SHARED / "data" / "heldout.txt"
MIXQ = [sys.executable, "-m", "mixq"]
CONVERTERS = ("exllamav3", "mixq_role", "mixq_measured")
ENGINES = ("torch", "exllamav3")


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"steps": {}, "sizes": {}}


def save(path: Path, res: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))


def step(res: dict, json_path: Path, work: Path, name: str, cmd: list[str]) -> dict:
    """Run one command, record its wall time, return code and the tail of a failure; save the JSON."""
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    (work / f"{name}.log").write_text(r.stdout[-20000:] + "\n" + r.stderr[-20000:])
    rec = {"seconds": round(time.time() - t, 1), "returncode": r.returncode}
    if r.returncode:
        rec["tail"] = (r.stdout + r.stderr)[-1500:]
    res["steps"][name] = rec
    save(json_path, res)
    print(f"{name}: {rec['seconds']} s rc={r.returncode}", flush=True)
    return rec


def finished(d: Path) -> bool:
    """A converter's directory is whole once its last file is there (exllamav3 writes quantization_config.json
    last, mixq its manifest); anything else is a cut run, removed and redone."""
    done = (d / "quantization_config.json").is_file() or (d / "mixq_manifest.json").is_file()
    if d.exists() and not done:
        shutil.rmtree(d)
    return done


def st_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.glob("*.safetensors"))


def convert_phase(work: Path, json_path: Path, bpws: list[float], device: str) -> dict:
    res = load(json_path)
    for b in bpws:
        tag = f"{b:g}"
        ev3 = work / f"exllamav3-{tag}"
        if not finished(ev3):
            step(res, json_path, work, f"exllamav3-{tag}",
                 [sys.executable, "-m", "exllamav3.conversion.convert_model", "-i", str(MODEL), "-o", str(ev3),
                  "-w", str(work / f"exllamav3-work-{tag}"), "-b", str(b)])
        if finished(ev3):
            res["sizes"][tag] = st_bytes(ev3)
            save(json_path, res)
    curves = work / "curves.json"
    if res["sizes"] and not curves.is_file():
        first = next(iter(res["sizes"].values()))
        step(res, json_path, work, "measure", MIXQ + ["plan", str(MODEL), "--format", "exl3", "--size", str(first),
                                                      "--measure", "--measure-out", str(curves), "--device", device,
                                                      "--json"])
    for tag, size in res["sizes"].items():
        for kind, extra in (("role", []), ("measured", ["--measure", str(curves)])):
            out = work / f"mixq-{kind}-{tag}"
            if finished(out) or (kind == "measured" and not curves.is_file()):
                continue
            step(res, json_path, work, f"mixq_{kind}-{tag}",
                 MIXQ + ["convert", str(MODEL), str(out), "--format", "exl3", "--size", str(size), "--device", device]
                 + extra)
    return res


def candidates(work: Path, res: dict) -> list[Path]:
    out = []
    for tag in res["sizes"]:
        for name in (f"exllamav3-{tag}", f"mixq-role-{tag}", f"mixq-measured-{tag}"):
            if finished(work / name):
                out.append(work / name)
    return out


def eval_phase(work: Path, json_path: Path, device: str, windows: int, ctx: int) -> dict:
    res = load(json_path)
    cands = candidates(work, res)
    for engine in ENGINES:
        rep = work / f"eval-{engine}.json"
        if rep.is_file() or not cands:
            continue
        rec = step(res, json_path, work, f"eval-{engine}",
                   MIXQ + ["eval", str(MODEL), *map(str, cands), "--text", str(TEXT), "--ctx", str(ctx), "--windows",
                           str(windows), "--device", device, "--engine", engine, "--json", str(rep), "--overwrite"])
        if rec["returncode"] == 0:
            res.setdefault("scores", {})[engine] = [
                {k: c.get(k) for k in ("name", "path", "engine", "bytes", "file_bpw", "kld_mean", "kld_mean_err",
                                       "top1", "top1_err", "ppl") if k in c}
                for c in json.loads(rep.read_text())["candidates"]]
            save(json_path, res)
    res["table"] = table(res)
    save(json_path, res)
    return res


def table(res: dict) -> list[dict]:
    """One row per (size, converter): bytes, wall time, and KLD ± s.e. / top-1 per engine; the KLD ratios."""
    rows = []
    scores = {e: {Path(c["path"]).name: c for c in res.get("scores", {}).get(e, [])} for e in ENGINES}
    for tag in res["sizes"]:
        base = {}
        for conv, d in zip(CONVERTERS, (f"exllamav3-{tag}", f"mixq-role-{tag}", f"mixq-measured-{tag}")):
            row = {"bpw_target": tag, "converter": conv, "dir": d,
                   "convert_s": res["steps"].get(d.replace("mixq-", "mixq_"), res["steps"].get(d, {})).get("seconds")}
            for e in ENGINES:
                c = scores[e].get(d)
                if c:
                    row.update({f"{e}_kld": c.get("kld_mean"), f"{e}_kld_se": c.get("kld_mean_err"),
                                f"{e}_top1": c.get("top1"), "bytes": c.get("bytes"),
                                "file_bpw": c.get("file_bpw")})
                    if conv == "exllamav3":
                        base[e] = c.get("kld_mean")
                    elif base.get(e):
                        row[f"{e}_kld_ratio_vs_exllamav3"] = round(c["kld_mean"] / base[e], 3)
            rows.append(row)
    return rows


def markdown(res: dict) -> str:
    head = ("| bpw | converter | bytes | convert s | KLD (torch) | top-1 (torch) | KLD (exllamav3) | top-1 (exllamav3) "
            "| ratio vs exllamav3 (torch / exllamav3) |\n|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in res.get("table", []):
        def kld(e):
            return f"{r[e + '_kld']:.5f} ± {r[e + '_kld_se']:.5f}" if r.get(e + "_kld") is not None else "–"

        def top(e):
            return f"{r[e + '_top1']:.4f}" if r.get(e + "_top1") is not None else "–"
        ratio = " / ".join(f"{r[e + '_kld_ratio_vs_exllamav3']:.3f}" if r.get(e + "_kld_ratio_vs_exllamav3")
                           else "–" for e in ENGINES)
        lines.append(f"| {r['bpw_target']} | {r['converter']} | {r.get('bytes') or '–'} | {r.get('convert_s') or '–'} "
                     f"| {kld('torch')} | {top('torch')} | {kld('exllamav3')} | {top('exllamav3')} | {ratio} |")
    return head + "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--phase", choices=("convert", "eval"), required=True)
    ap.add_argument("--bpw", default="2.5,3.05,4.0")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--markdown", type=Path, default=None)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    if a.phase == "convert":
        res = convert_phase(a.work, a.json, [float(b) for b in a.bpw.split(",")], a.device)
    else:
        res = eval_phase(a.work, a.json, a.device, a.windows, a.ctx)
        if a.markdown:
            a.markdown.write_text(markdown(res))
    print(json.dumps({k: v for k, v in res.items() if k != "scores"}, indent=1))


if __name__ == "__main__":
    main()
