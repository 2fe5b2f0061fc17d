"""How long an EXL3 conversion takes on the CPU, estimated from the plan before anything runs.

The trellis Viterbi dominates: 65,536 states per weight, a few million weights per second on a GPU and a few hundred
per CPU core. `check_cpu_time` refuses a CPU conversion whose estimate exceeds CPU_LIMIT_S unless the user asked
for the CPU explicitly (`--device cpu`); the rate comes from bench/speed/exl3_cpu_rate.py.
"""
from __future__ import annotations

import math

import torch

from mixq.errors import InputError
from mixq.formats.exl3_layout import pad_up

# trellis weights encoded per CPU-second (one core): the median over K = 2, 3, 4, 6 of bench/speed/exl3_cpu_rate.py
# (bench/results/exl3_cpu_rate.json), measured on a busy machine: an idle one may be faster, so the estimate errs
# long. The encode cost hardly depends on K: every step visits all 65,536 states.
CPU_WEIGHTS_PER_CORE_S = 340.0
CPU_LIMIT_S = 300.0  # above this a CPU conversion needs --device cpu


def trellis_weights(plan) -> int:
    """Weights the trellis encodes for the plan: its `type == "trellis"` tensors, padded to EXL3's 128 multiples
    as the encoder sees them."""
    return sum(math.prod(t.shape[:-2]) * pad_up(t.shape[-2]) * pad_up(t.shape[-1])
               for t in plan.tensors if t.type == "trellis")


def cpu_seconds(plan, cores: int | None = None) -> float:
    """Estimated seconds of trellis encoding on `cores` CPU cores (default: torch's intra-op threads)."""
    cores = cores or torch.get_num_threads()
    return trellis_weights(plan) / (CPU_WEIGHTS_PER_CORE_S * max(1, cores))


def describe_seconds(s: float) -> str:
    """12 s / 4.5 min / 3.2 h."""
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def check_cpu_time(plan, device: torch.device | str, *, explicit: bool) -> float | None:
    """The CPU estimate of an EXL3 conversion on `device` (None on an accelerator). Raises InputError when it
    exceeds CPU_LIMIT_S and the CPU was not asked for explicitly."""
    if torch.device(device).type != "cpu":
        return None
    cores = torch.get_num_threads()
    est = cpu_seconds(plan, cores)
    if est > CPU_LIMIT_S and not explicit:
        raise InputError(
            f"EXL3 on the CPU would take about {describe_seconds(est)} ({trellis_weights(plan) / 1e6:.2f}M trellis "
            f"weights at ~{CPU_WEIGHTS_PER_CORE_S:.0f} weights/s per core, {cores} core{'s' if cores != 1 else ''}); "
            "run it on a machine with a GPU, or pass --device cpu to convert on the CPU anyway")
    return est
