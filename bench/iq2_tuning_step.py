"""One block-output tuning step of an IQ2 routed-expert stack, with and without the fused codebook search.

A step decodes the stack's relaxed codes (most groups, once the codes move, are no codebook tuple and take the
nearest entry), runs a stand-in expert product on it and back-propagates to the codes. The search runs either
fused (the codebook through registers, where the Triton kernels run) or as the chunked addmm score table
(MIXQ_KQUANT_FUSED=0 switches the kernels off); both run in this one process, warm, pair by pair.

    python bench/iq2_tuning_step.py --experts 33 --json OUT.json     # a 108 GB plan's expert group, one stack
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from mixq.convert.gguf_workers import encode
from mixq.quant.device import pick_device
from mixq.quant.ggml import block_tuning as bt

FUSED_OFF = "MIXQ_KQUANT_FUSED"  # "0": the eager searches (quant/ggml/triton_search.py reads it at every call)


def step_seconds(codes, x: torch.Tensor, dev: torch.device) -> float:
    """Seconds of one step: decode, a product with `x`, its backward, the sign update."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t = time.perf_counter()
    w = codes.dequantized()
    loss = (x @ w.reshape(-1, w.shape[-1])[: x.shape[0]].T).square().mean()
    codes.u.grad = None
    loss.backward()
    with torch.no_grad():
        codes.u.sub_(0.02 * torch.sign(codes.u.grad))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=33)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--types", default="IQ2_S,IQ2_XS")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per path (after one untimed)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = pick_device(a.device)
    g = torch.Generator().manual_seed(0)
    one = torch.randn(a.rows, a.cols, generator=g) * 0.02
    x = torch.randn(512, a.cols, generator=g).to(dev)
    rows = []
    for qtype in a.types.split(","):
        b = encode(one.numpy(), qtype, np.ones(a.cols, np.float32), device=None if dev.type == "cpu" else str(dev))
        blocks = np.ascontiguousarray(np.broadcast_to(b, (a.experts, *b.shape)))
        w = one.expand(a.experts, -1, -1)
        codes = bt.tunable_codes(blocks, qtype, w, dev)
        step_seconds(codes, x, dev)  # codes off the codebook from here, as after a tuning stage's first steps
        times: dict[str, list[float]] = {"fused": [], "score table": []}
        for _ in range(a.steps):
            for path in times:
                if path == "fused":
                    os.environ.pop(FUSED_OFF, None)
                else:
                    os.environ[FUSED_OFF] = "0"
                times[path].append(step_seconds(codes, x, dev))
        os.environ.pop(FUSED_OFF, None)
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"type": qtype, "experts": a.experts, "weights": int(codes.u.numel()),
               "s_per_step": {k: round(v, 4) for k, v in med.items()},
               "ratio_fused_over_table": round(med["fused"] / med["score table"], 3)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del codes
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
