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

from mixq.formats.inspect import inspect_model
from mixq.formats.tiny import write_tiny_checkpoint


def _step_inspect(ctx: dict) -> dict:
    d = inspect_model(ctx["model"])
    (ctx["out"] / "inspect.json").write_text(json.dumps(d, indent=2) + "\n")
    return {"tensors": len(d["tensors"]), "params": d["params"], "nextn_layers": d["nextn_layers"],
            "roles": {r: v["tensors"] for r, v in d["roles"].items()}, "file": str(ctx["out"] / "inspect.json")}


STEPS: list[tuple[str, Callable[[dict], dict]]] = [
    ("inspect", _step_inspect),
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
