"""Layer-output error of Hessian rounding against ggml's encoder, in and out of sample, on real k256 tensors.

    python bench/quality/gguf_rounding_error.py --rows 128 --types Q2_K,Q4_K,IQ2_S --json bench/results/gguf-rounding-error.json

For each tensor (--tensors) and type, tr(ΔW·H·ΔWᵀ) of the Hessian rounding (quant/ggml/rounding/) (damping and refinement passes as the
converter uses them, and without refinement) divided by that of ggml's own encoder (mixq.quant.ggml.encoders, imatrix =
the all-token diagonal, as `mixq imatrix` stores it). "in": H from the calibration text the rounding used (--rows x
512 tokens of calibration.txt); "out": H from held-out text (--heldout-rows x 512 tokens of heldout.txt), i.e.
what the rounding gains on inputs it never saw. Routed experts: the routing-weighted Hessians of
measurement/hessians.py, summed over experts.
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

TENSORS = ("blk.0.attn_q.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "blk.1.attn_output.weight",
           "blk.1.ffn_gate_exps.weight", "blk.2.ffn_down_exps.weight", "blk.3.attn_q_b.weight", "output.weight")


def hessians(ckpt, specs, text: Path, rows: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{GGUF name: (rounding/loss Hessian, all-token Hessian)} of the wanted tensors from one calibration walk."""
    from mixq.runtime.calibration import calibration_rows, load_tokenizer
    from mixq.measurement.hessians import layer_hessians

    ids = calibration_rows(load_tokenizer(ckpt.path), [text], rows=rows, seq_len=512,
                           vocab_size=int(ckpt.text_config["vocab_size"]))
    out = {}
    for stage in layer_hessians(ckpt, ids):
        for s in specs:
            if s.layer != stage.layer:
                continue
            if s.transform == "stack":
                h = stage.experts(s, 0, len(s.hf_names))
                out[s.name] = (h, torch.stack([stage.stats[n].hessian() for n in s.hf_names]))
            else:
                h = stage.get(s)
                out[s.name] = (h, h)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--heldout-rows", type=int, default=16)
    ap.add_argument("--types", default="Q2_K,Q4_K,IQ2_S")
    ap.add_argument("--tensors", default=",".join(TENSORS))
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    from mixq.conversion.gguf.rounding import DAMP, REFINE_PASSES
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.gguf_names import build_tensor, gguf_tensors
    from mixq.quant.ggml import encoders
    from mixq.quant.ggml.rounding import hessian as kh

    ckpt = open_checkpoint(SHARED / "models" / "glm5next-k256")
    names = a.tensors.split(",")
    specs = [s for s in gguf_tensors(ckpt, include_mtp=False) if s.name in names]
    t0 = time.time()
    cal = hessians(ckpt, specs, SHARED / "data" / "calibration.txt", a.rows)
    held = hessians(ckpt, specs, SHARED / "data" / "heldout.txt", a.heldout_rows)
    rows = []
    print("| tensor | type | in (walk) | in (codes refined) | in (refined) | out (walk) | out (codes refined) | "
          "out (refined) |\n|---|---|---:|---:|---:|---:|---:|---:|")
    for s in specs:
        w = build_tensor(s, ckpt.get).float()
        h, h_all = cal[s.name]
        ho = held[s.name][0]
        imx = torch.diagonal(h_all, dim1=-2, dim2=-1).numpy().copy()
        for t in a.types.split(","):
            exact = (np.stack([encoders.quantize(w[e].numpy(), t, imx[e]) for e in range(w.shape[0])])
                     if w.ndim == 3 else encoders.quantize(w.numpy(), t, imx))

            def err(b, hh):
                return float(kh.layer_error(w, torch.from_numpy(kh.dequantize_blocks(b, t)), hh).sum())

            walk = kh.quantize_hessian(w, h, t, imx, damp=DAMP, refine=0)
            ref = kh.quantize_hessian(w, h, t, imx, damp=DAMP, refine=REFINE_PASSES)
            kh.REFIT_SCALES = False  # the refinement of the codes alone, super-scales as the walk left them
            codes = kh.quantize_hessian(w, h, t, imx, damp=DAMP, refine=REFINE_PASSES)
            kh.REFIT_SCALES = True
            r = {"tensor": s.name, "type": t, "in_walk": err(walk, h) / err(exact, h),
                 "in_codes_refined": err(codes, h) / err(exact, h), "in_refined": err(ref, h) / err(exact, h),
                 "out_walk": err(walk, ho) / err(exact, ho), "out_codes_refined": err(codes, ho) / err(exact, ho),
                 "out_refined": err(ref, ho) / err(exact, ho)}
            rows.append(r)
            print(f"| {s.name} | {t} | {r['in_walk']:.3f} | {r['in_codes_refined']:.3f} | {r['in_refined']:.3f} | "
                  f"{r['out_walk']:.3f} | {r['out_codes_refined']:.3f} | {r['out_refined']:.3f} |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(repo_relative({
            "model": "glm5next-k256", "rows": a.rows, "heldout_rows": a.heldout_rows, "damp": DAMP,
            "refine_passes": REFINE_PASSES, "seconds": round(time.time() - t0), "results": rows}), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
