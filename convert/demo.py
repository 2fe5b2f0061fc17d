"""`mixq demo`: write a tiny random glm5_next checkpoint and run every pipeline step on it.

Each step is a function ``(ctx) -> dict`` in ``STEPS``; it reads what earlier steps put in ``ctx`` and
returns a small JSON-able summary. New pipeline stages add one entry here.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from mixq.formats.model_summary import inspect_model
from mixq.formats.tiny import write_tiny_checkpoint


def _step_inspect(ctx: dict) -> dict:
    d = inspect_model(ctx["model"])
    (ctx["out"] / "inspect.json").write_text(json.dumps(d, indent=2) + "\n")
    return {"tensors": len(d["tensors"]), "params": d["params"], "nextn_layers": d["nextn_layers"],
            "roles": {r: v["tensors"] for r, v in d["roles"].items()}, "file": str(ctx["out"] / "inspect.json")}


def _step_plan(ctx: dict) -> dict:
    from mixq.convert.planning import plan_model
    from mixq.formats.checkpoint import open_checkpoint

    ckpt = open_checkpoint(ctx["model"])
    exl3 = plan_model(ckpt, "exl3", bpw=3.05)
    gguf = plan_model(ckpt, "gguf", qtype="Q8_0")
    (ctx["out"] / "plan-exl3.json").write_text(json.dumps(exl3.to_dict(), indent=2) + "\n")
    return {"exl3_bpw": round(exl3.bpw, 3), "exl3_bytes": exl3.total_bytes, "gguf_q8_0_bytes": gguf.total_bytes}


def _step_convert_gguf(ctx: dict) -> dict:
    from mixq.convert import GGUFOptions, convert

    out = ctx["out"] / "tiny-Q8_0.gguf"
    # overwrite: a demo directory is reused from run to run
    res = convert(ctx["model"], out, GGUFOptions(qtype="Q8_0", overwrite=True, progress=False))
    ctx["gguf"] = out
    return {"file": res.out, "bytes": out.stat().st_size, "bpw": round(res.bpw, 3)}


def _step_verify(ctx: dict) -> dict:
    from mixq.convert.api import verify

    rep = verify(ctx["gguf"])
    return {"problems": len(rep.get("problems", []))}


def _step_eval(ctx: dict) -> dict:
    from mixq.convert.calibration import BUILTIN_TEXT
    from mixq.eval.api import evaluate

    if not (ctx["model"] / "tokenizer.json").is_file():
        return {"skipped": "the tiny checkpoint has no tokenizer (../shared/models/glm5next-mini absent)"}
    text = ctx["out"] / "demo-text.txt"
    text.write_text(BUILTIN_TEXT * 4)
    rep = evaluate(ctx["model"], [ctx["gguf"]], text, ctx=128, windows=2, progress=False,
                   json_out=ctx["out"] / "eval.json")
    c = rep["candidates"][0]
    return {"kld_mean": c["kld_mean"], "top1": c["top1"], "positions": c["positions"]}


# EXL3 conversion is left out of the demo: the trellis Viterbi needs a GPU to be quick (minutes per layer on CPU).
STEPS: list[tuple[str, Callable[[dict], dict]]] = [
    ("inspect", _step_inspect),
    ("plan", _step_plan),
    ("convert", _step_convert_gguf),
    ("verify", _step_verify),
    ("eval", _step_eval),
]


def run_demo(out_dir: str | os.PathLike = "mixq-demo", *, seed: int = 0) -> dict:
    """Write ``out_dir/tiny-glm5next`` (reused when already there) and run every step of ``STEPS`` on it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = out / "tiny-glm5next"
    t0 = time.perf_counter()
    if not (model / "config.json").is_file():
        write_tiny_checkpoint(model, seed=seed)
    ctx: dict = {"out": out, "model": model}
    report = {"model": str(model), "write_s": round(time.perf_counter() - t0, 2), "steps": {}}
    for name, step in STEPS:
        t = time.perf_counter()
        res = step(ctx)
        res["seconds"] = round(time.perf_counter() - t, 2)
        report["steps"][name] = res
    return report


def format_demo(report: dict) -> str:
    lines = [f"tiny glm5_next checkpoint: {report['model']} ({report['write_s']} s)"]
    for name, res in report["steps"].items():
        brief = ", ".join(f"{k}={v}" for k, v in res.items() if not isinstance(v, (dict, list)) and k != "seconds")
        lines.append(f"  {name:<10} ok  {res['seconds']:>6.2f} s  {brief}")
    return "\n".join(lines)
