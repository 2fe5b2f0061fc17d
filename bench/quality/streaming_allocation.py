"""Role, oracle and streamed plans at equal bytes, each as-is and with the fixtures-only levers pinned.

    python bench/quality/streaming_allocation.py --model k256 --cells gguf:Q2_K,gguf:Q3_K_M,gguf:Q4_K_M
    python bench/quality/streaming_allocation.py --model mini --cells exl3:2.5,exl3:3.05,exl3:4.0

For each cell (format and size) every plan is written at one byte target: EXL3 at the bytes of mixq's role plan
at `--bpw B`, GGUF at the bytes of the Q2_K / Q3_K_M / Q4_K_M mix. The rows:
  role           `mixq convert --size S` (the role plan; pinning it changes nothing)
  oracle         `--measure ORACLE`: curves of `--measure kld` (each unit perturbed, the whole model run)
  stream         `--measure STREAM`: curves of `--measure stream` (one layer in memory)
  *-pinned       the same with `--pin token_embd,output,vision,layer0` (those tensors at the role plan's choice)
ORACLE and STREAM are the curves bench/quality/stream_vs_oracle.py saved under tests/data/stream_oracle/ (GGUF:
measured with `--rounding exact`, no imatrix, as these files are converted). Every file of a cell is scored by
`mixq eval` (torch engine, CPU) against the BF16 model on `--windows` windows of heldout.txt, KLD ± s.e.; the
result file (bench/results/streaming_allocation_MODEL.json) is rewritten after every file, so a cut run keeps
what finished.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]
from paths import REPO, SHARED, WORK, repo_relative  # noqa: E402

MODELS = {"mini": "glm5next-mini", "k256": "glm5next-k256"}
CURVES = REPO / "tests" / "data" / "stream_oracle"
PIN = "token_embd,output,vision,layer0"
ROWS = ("role", "oracle", "stream", "oracle-pinned", "stream-pinned")
DEFAULT_CELLS = {"k256": "gguf:Q2_K,gguf:Q3_K_M,gguf:Q4_K_M,exl3:2.5,exl3:3.05,exl3:4.0",
                 "mini": "exl3:2.5,exl3:3.05,exl3:4.0,gguf:Q2_K,gguf:Q3_K_M,gguf:Q4_K_M"}


def target_bytes(model: Path, fmt: str, at: str) -> int:
    """The cell's byte target: mixq's EXL3 role plan at `at` bpw, or the GGUF named mix `at`."""
    import mixq

    if fmt == "exl3":
        return mixq.plan(model, "exl3", bpw=float(at)).total_bytes
    return mixq.plan(model, "gguf", qtype=at).total_bytes


def row_options(row: str, model_key: str, fmt: str) -> dict:
    kind = row.split("-")[0]
    kw = {} if kind == "role" else {"measure": str(CURVES / f"{model_key}_{fmt}_{'kld' if kind == 'oracle' else 'stream'}.json")}
    if row.endswith("-pinned"):
        kw["pin"] = PIN
    return kw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=tuple(MODELS), default="k256")
    ap.add_argument("--cells", default=None, help="FORMAT:AT,... (exl3:BPW, gguf:NAMED_MIX)")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--work", default=str(WORK / "streaming_allocation"))
    a = ap.parse_args()
    import mixq

    model = SHARED / "models" / MODELS[a.model]
    text = SHARED / "data" / "heldout.txt"
    result = REPO / "bench" / "results" / f"streaming_allocation_{a.model}.json"
    res = json.loads(result.read_text()) if result.is_file() else {"model": MODELS[a.model], "windows": a.windows,
                                                                    "engine": "torch", "device": a.device,
                                                                    "pin": PIN, "cells": {}}

    def save() -> None:
        result.write_text(json.dumps(repo_relative(res), indent=1) + "\n")

    work = Path(a.work) / a.model
    work.mkdir(parents=True, exist_ok=True)
    ref = work / f"ref-{a.windows}.pt"  # the BF16 model's log-probs, computed once for every file
    if not ref.is_file():
        mixq.evaluate(model, [], text=text, windows=a.windows, engine="torch", device=a.device, save_ref=ref,
                      overwrite=True, progress=False)
    for cell in (a.cells or DEFAULT_CELLS[a.model]).split(","):
        fmt, at = cell.split(":")
        c = res["cells"].setdefault(cell, {"format": fmt, "at": at, "rows": {}})
        c["bytes"] = target_bytes(model, fmt, at)
        for row in a.rows.split(","):
            r = c["rows"].setdefault(row, {})
            if r.get("kld_mean") is not None:
                continue
            out = work / f"{fmt}-{at}-{row}" if fmt == "exl3" else work / f"{fmt}-{at}-{row}.gguf"
            kw = row_options(row, a.model, fmt)
            t0 = time.time()
            try:
                if out.exists():
                    shutil.rmtree(out) if out.is_dir() else out.unlink()
                extra = {"device": a.device} if fmt == "exl3" else {"threads": 1}
                mixq.convert(model, out, fmt, size=c["bytes"], progress=False, **extra, **kw)
                r["convert_s"] = round(time.time() - t0, 1)
                rep = mixq.evaluate(model, [out], ref_logits=ref, windows=a.windows, engine="torch",
                                    device=a.device, progress=False)
                e = rep["candidates"][0]
                r.update({k: e.get(k) for k in ("bytes", "file_bpw", "kld_mean", "kld_mean_err", "top1")})
                r["eval_s"] = round(time.time() - t0 - r["convert_s"], 1)
            except Exception as ex:  # recorded, and the next row runs
                r["error"] = f"{type(ex).__name__}: {ex}"[:500]
            print(a.model, cell, row, r, flush=True)
            _ratios(c)
            save()


def _ratios(c: dict) -> None:
    """KLD ratios of a cell: stream / oracle (as-is and pinned), and each measured row / role."""
    k = {row: r.get("kld_mean") for row, r in c["rows"].items()}
    ratios = {}
    for num, den in (("stream", "oracle"), ("stream-pinned", "oracle-pinned"), ("oracle", "role"),
                     ("stream", "role"), ("oracle-pinned", "role"), ("stream-pinned", "role")):
        if k.get(num) and k.get(den):
            ratios[f"{num}/{den}"] = round(k[num] / k[den], 3)
    c["ratios"] = ratios


if __name__ == "__main__":
    main()
