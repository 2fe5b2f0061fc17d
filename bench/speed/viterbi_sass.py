"""Instruction budget of one Viterbi step of the fused forward kernels, read from their sm_90 SASS (compiled offline
with the tools Triton ships; no device needed): all instructions, the memory-pipe ones (shared and local loads and
stores, shuffles, barriers), the local-memory ones (spills) and the barriers, per integer K, pass and forward.

    python bench/speed/viterbi_sass.py [--bits 2,3,4] [--costs mixed] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json

from mixq.quant.trellis.viterbi_triton import forward_step_ops

MEMORY_PIPE = ("LDL", "STL", "LDS", "LDSM", "STS", "SHFL", "BAR")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", default="2,3,4")
    ap.add_argument("--costs", default="mixed")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = []
    print(f"| K | pass | forward | instructions | memory pipe | local (spills) | barriers |")
    print("|---|---|---|---:|---:|---:|---:|")
    for k in (int(b) for b in a.bits.split(",")):
        for free in (True, False):
            for forward in ("triton", "gluon"):
                ops = forward_step_ops(k, free, a.costs, forward)
                row = {"bits": k, "pass": 1 if free else 2, "forward": forward, "costs": a.costs,
                       "instructions": sum(ops.values()), "memory_pipe": sum(ops[o] for o in MEMORY_PIPE),
                       "local": ops["LDL"] + ops["STL"], "barriers": ops["BAR"]}
                rows.append(row)
                print(f"| {k} | {row['pass']} | {forward} | {row['instructions']} | {row['memory_pipe']} | "
                      f"{row['local']} | {row['barriers']} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
