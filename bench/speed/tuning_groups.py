"""Block-output tuning of a MoE layer whose routed experts are over the tuning budget (conversion/gguf/tuning.py): the
experts tuned a group at a time, seconds per step and peak memory per stage, on a random checkpoint with many
experts (the routed experts are most of the layer, as in GLM-5.3-Flash), and a digest of the tuned blocks (to check
that a change to the tuning loop leaves its codes as they were). A stage's peak is the device allocator's on CUDA,
the sampled resident set on the CPU (the process's, so it includes what earlier stages left allocated).

    python bench/speed/tuning_groups.py [--experts 64] [--hidden 512] [--group 8] [--iters 8] [--rows 8] [--seq-len 128]
        [--device cpu] [--json OUT.json]

Layer 1 holds the experts (Q4_K gate/up/down stacks, encoded by ggml's encoder); layer 0 is dense and untuned. The
budget (`max_weights`) holds the layer's other tensors and `--group` experts, so the experts are tuned in
experts / group stages after the first.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from mixq.conversion.gguf import tuning as gt
from mixq.formats.checkpoint import open_checkpoint
from mixq.formats.gguf_names import build_tensor, gguf_tensors
from mixq.formats.tiny import write_tiny_checkpoint
from mixq.quant.ggml import encoders

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from paths import repo_relative  # noqa: E402

TYPES = {"blk.1.attn_q.weight": "Q4_K", "blk.1.ffn_gate_exps.weight": "Q4_K", "blk.1.ffn_up_exps.weight": "Q4_K",
         "blk.1.ffn_down_exps.weight": "Q4_K", "blk.1.ffn_up_shexp.weight": "Q4_K"}


class StagePeaks:
    """Peak memory of each tuning stage (each `sign_descent` call): the device's allocator peak on CUDA, the
    resident set sampled every 5 ms on the CPU."""

    def __init__(self, dev: torch.device) -> None:
        self.dev, self.peaks, self._now = dev, [], 0.0
        self._stop = threading.Event()
        if dev.type != "cuda":
            threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.wait(0.005):
            with open("/proc/self/statm") as f:
                self._now = max(self._now, int(f.read().split()[1]) * page / 2**20)

    def wrap(self, descent):
        def timed(*a, **k):
            if self.dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.dev)
            self._now = 0.0
            try:
                return descent(*a, **k)
            finally:
                self.peaks.append(torch.cuda.max_memory_allocated(self.dev) / 2**20 if self.dev.type == "cuda"
                                  else self._now)
        return timed


def _peak_mib(dev: torch.device) -> float:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--group", type=int, default=8, help="experts per tuning stage (the budget)")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    tmp = tempfile.TemporaryDirectory()
    ck = open_checkpoint(write_tiny_checkpoint(Path(tmp.name) / "m", hidden=a.hidden, n_experts=a.experts, top_k=8,
                                               layer_types=("linear_attention",) * 2, dense_layers=1, nextn=False,
                                               vision=False))
    specs = [s for s in gguf_tensors(ck) if s.name in TYPES]
    types = [TYPES[s.name] for s in specs]
    t0 = time.perf_counter()
    encoded = {s.name: (encoders.quantize_stacked if s.transform == "stack" else encoders.quantize)(
        build_tensor(s, ck.get).numpy(), t) for s, t in zip(specs, types)}
    encode_s = time.perf_counter() - t0
    stacks = [s for s in specs if s.transform == "stack"]
    per_expert = sum(int(np.prod(s.shape[1:])) for s in stacks)
    others = sum(int(np.prod(s.shape)) for s in specs if s.transform != "stack")
    vocab = int(ck.text_config["vocab_size"])
    ids = torch.randint(0, vocab, (a.rows, a.seq_len), generator=torch.Generator().manual_seed(0))
    tuner = gt.LayerTuner(ck, ids, specs, types, iters=a.iters, lr=0.5, device=dev,
                          max_weights=max(others, a.group * per_expert))
    tuner.layer(0, {})
    peaks = StagePeaks(dev)
    gt.bt.sign_descent = peaks.wrap(gt.bt.sign_descent)
    before = _peak_mib(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    out = tuner.layer(1, encoded)
    layer_s = time.perf_counter() - t0
    peak = _peak_mib(dev)
    digest = hashlib.sha256()
    for n in sorted(out):
        digest.update(n.encode())
        digest.update(np.ascontiguousarray(out[n]).view(np.uint8).tobytes())
    stages = [{"tuned": "other tensors" if i == 0 else f"experts group {i}", "seconds": round(r.seconds, 3),
               "peak_mib": round(peaks.peaks[i], 1),
               "seconds_per_step": round(r.seconds / max(1, a.iters), 4), "kept": r.kept,
               "check_before": r.check_before, "check_after": r.check_after}
              for i, r in enumerate(x for x in tuner.reports if x.layer == 1)]
    expert_mib = sum(int(np.prod(s.shape)) for s in stacks) * 4 / 2**20
    res = {"experts": a.experts, "hidden": a.hidden, "group": a.group, "iters": a.iters, "rows": a.rows,
           "seq_len": a.seq_len, "device": str(dev), "encode_s": round(encode_s, 2), "layer_s": round(layer_s, 2),
           "stages": stages, "expert_weights_mib_fp32": round(expert_mib, 1),
           "peak_mib_before_layer": round(before, 1), "peak_mib": round(peak, 1),
           "tuned_blocks_sha256": digest.hexdigest()}
    for s in stages:
        print(f"{s['tuned']:>16s}: {s['seconds']:7.2f} s, {s['seconds_per_step']:.3f} s a step, peak "
              f"{s['peak_mib']:.0f} MiB, held-out {s['check_before']:.5g} -> {s['check_after']:.5g}")
    print(f"layer {layer_s:.1f} s; routed experts {expert_mib:.0f} MiB in float32; peak memory {before:.0f} MiB "
          f"before the layer, {peak:.0f} MiB in it; tuned blocks sha256 {digest.hexdigest()[:16]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(repo_relative(res), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
