"""Cost of the GGUF block-output tuning (`--rounding hessian`, conversion/gguf/tuning.py): seconds per descent step
and memory, per stage of a real model, with what a stage tunes.

    python bench/speed/gguf_tuning_cost.py --model k256 --steps 10 --json bench/results/gguf-tuning-cost-k256.json
    python bench/speed/gguf_tuning_cost.py --model k256 --device cuda --rows 16

Each stage of the model (every decoder layer, then the head) is encoded at --type (mixq's exact ggml encoder, as
the Hessian rounding's start would be) and tuned for --steps steps over --rows x --seq-len calibration tokens in
the converter's batches (4 rows). Printed per stage: tuned weights, the stage's seconds (set-up, the source and
quantized forwards over all rows, the descent), seconds per descent step (its held-out checks included), the
held-out loss before and after; at the end the peak resident memory (and the GPU's peak). A conversion's tuning
time is about `--tune-iters` x (seconds per step) per stage, plus the rest of the stage.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from paths import SHARED, repo_relative  # noqa: E402

MODELS = {"k256": "glm5next-k256", "mini": "glm5next-mini"}


def run(a: argparse.Namespace) -> dict:
    from mixq.conversion.gguf import tuning as gt
    from mixq.runtime.calibration import calibration_rows, load_tokenizer
    from mixq.planning.gguf_assign import assign_types
    from mixq.conversion.gguf.workers import encode
    from mixq.eval.peak_memory import peak_gpu_mib, peak_rss_mib
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.gguf_names import build_tensor, gguf_tensors
    from mixq.quant.device import pick_device

    ck = open_checkpoint(SHARED / "models" / MODELS[a.model])
    dev = pick_device(a.device)
    specs = gguf_tensors(ck)
    types = assign_types(ck, specs, qtype=a.type)
    ids = calibration_rows(load_tokenizer(ck.path), [SHARED / "data" / "calibration.txt"], rows=a.rows,
                           seq_len=a.seq_len, vocab_size=int(ck.text_config["vocab_size"]))
    tuner = gt.LayerTuner(ck, ids, specs, types, iters=a.steps, device=dev)

    def wanted(s, layer) -> bool:
        if s.mtp:
            return False
        if layer is None:
            return s.role == "lm_head"
        return s.layer == layer or (layer == 0 and s.role == "embed")

    def encoded(layer):
        return {s.name: encode(build_tensor(s, ck.get).numpy(), t) for s, t in zip(specs, types)
                if wanted(s, layer) and t in gt.bt.TUNABLE and s.transform in ("none", "stack")}

    stages = []
    for layer in [*range(tuner.stream.num_layers), None]:
        enc = encoded(layer)
        t0 = time.time()
        tuner.layer(layer, enc) if layer is not None else tuner.head(enc)
        secs = time.time() - t0
        r = tuner.reports[-1] if tuner.reports and tuner.reports[-1].layer == layer else None
        row = {"stage": "head" if layer is None else f"layer {layer}",
               "tuned_weights": int(sum(np.prod(s.shape) for s in specs if s.name in enc))}
        row["seconds"] = round(secs, 2)
        row["seconds_per_step"] = round(r.seconds / max(a.steps, 1), 3) if r is not None else None
        if r is not None:
            row.update(check_before=r.check_before, check_after=r.check_after, changed=r.changed,
                       held_weights=r.held_weights)
        stages.append(row)
        print(f"{row['stage']:>8}: {row['tuned_weights']:>10,} weights tuned, stage {secs:.1f} s, "
              f"{row['seconds_per_step']} s/step"
              + (f", held-out loss {r.check_before:.4g} -> {r.check_after:.4g}" if r else ""), flush=True)
    res = {"model": MODELS[a.model], "type": a.type, "device": str(dev), "rows": a.rows, "seq_len": a.seq_len,
           "steps": a.steps, "batch_rows": tuner.stream.batch_rows, "stages": stages,
           "peak_rss_mib": round(peak_rss_mib()), "peak_gpu_mib": peak_gpu_mib(dev),
           "torch_threads": torch.get_num_threads()}
    print(f"peak RSS {res['peak_rss_mib']} MiB" + (f", GPU {res['peak_gpu_mib']:.0f} MiB" if res["peak_gpu_mib"]
                                                   else ""))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="k256")
    ap.add_argument("--type", default="Q4_K_M", help="llama-quantize mix whose types are tuned [Q4_K_M]")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default=None)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    res = run(a)
    if a.json:
        Path(a.json).write_text(json.dumps(repo_relative(res), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
