"""The streaming evaluator on a device: numbers against the CPU, speed of one window per layer call versus
batched windows, peak GPU memory, and peak GPU memory against depth.

    python bench/release/eval_streaming.py --out eval_streaming.json [--device cuda] [--models mini,k256]

Per fixture model (reference vs its Q4_K_M GGUF, and for k256 also the FP8 release; heldout.txt, ctx 512,
8 windows): one CPU run (the reference numbers), then device runs with batch_windows 1 and 8 — KLD / top-1 / PPL,
their relative difference to the CPU run, tokens/s, peak_rss_mib and peak_gpu_mib, where the hidden states lived.
Then tiny random models of 3 and 12 layers (~25 MB of float32 weights per layer) on the device: peak GPU memory
must not grow with depth. Results are written as JSON (paths relative to the repo root).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from paths import SHARED, repo_relative  # noqa: E402

KEYS = ("kld_mean", "kld_p99", "kld_max", "top1", "ppl_ref", "ppl", "tokens_per_s")
DSA_BLOCK = ("linear_attention", "linear_attention", "linear_attention", "deepseek_sparse_attention")


def _candidates(model: str, work: Path) -> list[Path]:
    from mixq.conversion.gguf.pipeline import convert_gguf

    ref = SHARED / "models" / f"glm5next-{model}"
    g = work / f"{model}-Q4_K_M.gguf"
    if not g.exists():
        convert_gguf(ref, g, qtype="Q4_K_M", progress=False)
    return [g] + ([SHARED / "models" / "glm5next-k256-fp8"] if model == "k256" else [])


def _run(ref: Path, cands: list[Path], device: str, batch: int, ctx: int, windows: int) -> dict:
    from mixq.eval import evaluate

    t0 = time.perf_counter()
    rep = evaluate(ref, cands, SHARED / "data" / "heldout.txt", ctx=ctx, windows=windows, device=device,
                   batch_windows=batch, progress=False)
    return {"seconds": round(time.perf_counter() - t0, 2), "device": rep["device"], "batch_windows": batch,
            "peak_rss_mib": rep["peak_rss_mib"], "peak_gpu_mib": rep["peak_gpu_mib"],
            "ref_tokens_per_s": rep["ref_tokens_per_s"],
            "candidates": [{"name": Path(c["path"]).name, **{k: c[k] for k in KEYS}} for c in rep["candidates"]]}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a)


def fixtures(models: list[str], device: str, work: Path, ctx: int, windows: int) -> dict:
    out = {}
    for model in models:
        ref = SHARED / "models" / f"glm5next-{model}"
        cands = _candidates(model, work)
        runs = [_run(ref, cands, "cpu", 1, ctx, windows)]
        for batch in (1, 8):
            r = _run(ref, cands, device, batch, ctx, windows)
            r["rel_diff_to_cpu"] = {c["name"]: {k: _rel(c[k], b[k]) for k in KEYS if k != "tokens_per_s"}
                                    for c, b in zip(r["candidates"], runs[0]["candidates"])}
            runs.append(r)
            print(model, device, "batch", batch, r["seconds"], "s", "peak gpu", r["peak_gpu_mib"], "MiB", flush=True)
        out[model] = runs
    return out


def depth(device: str, work: Path) -> dict:
    """Peak GPU memory of a tiny model against itself with 3 and 12 layers."""
    from mixq.eval import evaluate
    from mixq.formats.tiny import write_tiny_checkpoint

    res = {}
    for n in (3, 12):
        m = work / f"tiny-{n}"
        if not m.exists():
            types = (DSA_BLOCK * 3)[:n] if n > 3 else ("linear_attention",) * 2 + ("deepseek_sparse_attention",)
            write_tiny_checkpoint(m, hidden=256, n_experts=32, layer_types=types, vision=False)
        rep = evaluate(m, [m], SHARED / "data" / "heldout.txt", ctx=32, windows=2, device=device, progress=False)
        res[n] = {"peak_gpu_mib": rep["peak_gpu_mib"], "peak_rss_mib": rep["peak_rss_mib"]}
    res["gpu_ratio_12_to_3"] = (res[12]["peak_gpu_mib"] or 0) / max(res[3]["peak_gpu_mib"] or 1e-9, 1e-9)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="Write the results JSON here.")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="mini,k256")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    a = ap.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        res = {"device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "ctx": a.ctx, "windows": a.windows,
               "fixtures": fixtures([m for m in a.models.split(",") if m], a.device, work, a.ctx, a.windows),
               "depth": depth(a.device, work)}
    a.out.write_text(json.dumps(repo_relative(res), indent=2) + "\n")
    print(json.dumps(res["depth"]))


if __name__ == "__main__":
    main()
