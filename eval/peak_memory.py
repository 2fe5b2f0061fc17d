"""Peak host (resident set) and GPU memory of this process, for the `peak_rss_mib` / `peak_gpu_mib` report keys.

While a `--profile` is recorded the recorder owns the peak counters (it resets them at every stage boundary):
the peaks are then the recording's (runtime/profile.peaks), which began before the evaluation's own reset."""
from __future__ import annotations

import resource
from pathlib import Path

import torch

from mixq.runtime import profile

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peaks(device: torch.device) -> None:
    """Start counting peaks now: Linux resets the resident-set high-water mark on "5" in clear_refs (elsewhere the
    process's lifetime peak is reported); CUDA's allocator peak is reset for `device`."""
    if profile.active() is not None:  # the recorder resets them at each stage and keeps the run's peaks
        return
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        pass
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_rss_mib() -> float:
    """Peak resident set size in MiB since `reset_peaks` (VmHWM), or the process's lifetime peak (getrusage)."""
    if (p := profile.peaks()) is not None:
        return p[0] / 2**20
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def peak_gpu_mib(device: torch.device) -> float | None:
    """Peak memory held by torch's CUDA allocator on `device` in MiB since `reset_peaks`; None off CUDA."""
    if device.type != "cuda":
        return None
    if (p := profile.peaks()) is not None:
        return p[1] / 2**20
    return torch.cuda.max_memory_allocated(device) / 2**20
