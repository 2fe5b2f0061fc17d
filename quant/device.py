"""Device placement, in one place: numerics run on CUDA when present, else on the CPU."""
from __future__ import annotations

import torch

from mixq.errors import InputError


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """`device` if given, else cuda when available, else cpu."""
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def same_device(a: str | torch.device, b: str | torch.device) -> bool:
    """Whether `a` and `b` name one device, however spelled: a tensor's CUDA device carries its index ("cuda:0")
    where a requested one may not ("cuda": the current device), and the CPU has one device whatever its index."""
    def canonical(d: str | torch.device) -> tuple[str, int]:
        d = torch.device(d)
        if d.type == "cpu":
            return "cpu", 0
        if d.index is None and d.type == "cuda":
            return "cuda", torch.cuda.current_device()
        return d.type, d.index or 0
    return canonical(a) == canonical(b)


def device_kind(dev: torch.device) -> str:
    """"cpu" or "accelerator": the key of the per-device-type tables of the numerics (batch sizes, sweep order)."""
    return "cpu" if dev.type == "cpu" else "accelerator"


SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


def parse_device(device: str | torch.device, what: str = "--device") -> torch.device:
    """`device` as a torch.device, or InputError naming `what` when it is not cpu, cuda or cuda:N."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in SUPPORTED_DEVICE_TYPES:
        raise InputError(f"{what} {str(device)!r}: not a device mixq runs on; use cpu, cuda or cuda:N")
    return dev


def resolve_device(device: str | torch.device | None = None, what: str = "--device") -> torch.device:
    """`pick_device`, checked: InputError naming `what` for a malformed device or one this machine lacks."""
    if not device:
        return pick_device(None)
    dev = parse_device(device, what)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"{what} {device}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(f"{what} {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev
