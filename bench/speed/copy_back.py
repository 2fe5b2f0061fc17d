"""The copy of a layer's dequantized weights back to the host, as the EXL3 conversion makes it after each stacked
trellis call: into fresh pageable memory (`tensor.cpu()`, the earlier path) and into pinned memory
(`runtime.overlap.to_host`), side by side, at a GLM-5.3-Flash MoE layer's count.

    python bench/speed/copy_back.py [--calls 54] [--stack 16] [--out 2048] [--in 4096] [--json OUT.json]

Each call copies `--stack` float32 matrices (a stacked call of routed experts: 16 x 32 MiB) and the copies of the
calls before stay alive until the end of the layer, as the conversion keeps them for the advance pass; then the
layer is dropped and the next one copied. The first layer pays for pinning the blocks; the second reuses them (the
figure a 45-layer run sees). Peak host memory is two layers' copies: 54 x 16 x 32 MiB = 27 GiB a layer.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from mixq.runtime.overlap import to_host


def layer_seconds(copy, calls: int, src: list[torch.Tensor]) -> float:
    """Seconds to copy `calls` batches of `src` back to the host, keeping every copy alive (one layer)."""
    kept = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        kept.append([copy(t) for t in src])
    secs = time.perf_counter() - t0
    del kept
    return secs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=54)
    ap.add_argument("--stack", type=int, default=16)
    ap.add_argument("--out", type=int, default=2048)
    ap.add_argument("--in", dest="inp", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("copy_back: needs a CUDA device (the copies it times go from device to host)")
    src = [torch.randn(a.out, a.inp, device="cuda") for _ in range(a.stack)]
    gib = a.calls * a.stack * a.out * a.inp * 4 / 2**30
    rows = []
    for name, copy in (("pageable .cpu()", lambda t: t.cpu()), ("pinned to_host", to_host)):
        for layer in range(a.layers):
            s = layer_seconds(copy, a.calls, src)
            rows.append({"path": name, "layer": layer, "seconds": round(s, 3), "gib": round(gib, 2),
                         "gib_per_s": round(gib / s, 2)})
            print(f"{name:16s} layer {layer}: {s:7.3f} s  {gib / s:6.2f} GiB/s  ({gib:.1f} GiB)", flush=True)
    check = to_host(src[0])
    assert torch.equal(check, src[0].cpu())
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"calls": a.calls, "stack": a.stack, "shape": [a.out, a.inp], "rows": rows,
                       "device": torch.cuda.get_device_name()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
