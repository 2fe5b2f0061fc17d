"""`--engine exllamav3`: logits of an EXL3 candidate from exllamav3's own forward (exllamav3 1.6.5, CUDA only).

The recipe of bench/engines/exllamav3_check.py: `Config.from_directory` -> `Model.from_config` -> `load` onto one CUDA
device; one window per forward with attention mode "flash_attn_nc" (no cache: every window starts from an empty
state, as the torch engine's do); the logits of the scored positions, cut to the reference's vocabulary (exllamav3
pads the head's outputs to a multiple of 128). exllamav3 is an optional, heavy dependency (its CUDA extension
builds on first import): it is imported only when this engine runs, and a machine without it or without CUDA gets
one InputError line before any forward.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from mixq.errors import FormatError, InputError

ENGINE = "exllamav3"
FORMAT = "exl3"  # the candidates this engine scores; others go through the torch engine
ATTN_MODE = "flash_attn_nc"  # exllamav3's no-cache flash-attention forward (bench/engines/exllamav3_check.py)


def _import_exllamav3():
    try:
        import exllamav3
    except Exception as e:  # noqa: BLE001 - ImportError, or its CUDA extension failing to build or load
        raise InputError(f"--engine exllamav3 needs exllamav3 (pip install exllamav3==1.6.5) and a CUDA device; "
                         f"it does not import here ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                         ) from None
    return exllamav3


def check_engine(device: torch.device) -> None:
    """InputError unless exllamav3 can score on `device`: a CUDA device, and exllamav3 importable."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise InputError(f"--engine exllamav3 needs exllamav3 and a CUDA device (the device is {device}"
                         f"{'' if torch.cuda.is_available() else ', and no CUDA device is present'}); "
                         "use --engine torch to score EXL3 candidates here")
    _import_exllamav3()


class Exllamav3Logits:
    """Context manager and callable: window w of `windows` -> float32 logits (ctx - 1 - first, vocab) from
    exllamav3; the model is loaded on entering and unloaded on leaving. `seconds`: forward time."""

    def __init__(self, path: Path, windows, vocab: int, device: torch.device) -> None:
        self.path, self.windows, self.vocab = Path(path), windows, int(vocab)
        self.device = torch.device(device)
        self.seconds = 0.0
        self.model = None

    def __enter__(self) -> "Exllamav3Logits":
        check_engine(self.device)
        ex = _import_exllamav3()
        try:
            config = ex.Config.from_directory(str(self.path))
            model = ex.Model.from_config(config)
            model.load(device=f"cuda:{self.device.index or 0}")
        except Exception as e:  # noqa: BLE001 - exllamav3 refuses a directory with many error types
            raise FormatError(f"{self.path}: exllamav3 cannot load this directory ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
        self.model = model
        return self

    def __exit__(self, *exc) -> None:
        if self.model is not None:
            self.model.unload()
            self.model = None
            torch.cuda.empty_cache()

    def __call__(self, w: int) -> torch.Tensor:
        ctx, first = self.windows.ctx, self.windows.first
        ids = self.windows.tokens[w].to(torch.long).view(1, -1)
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = self.model.forward(ids, {"attn_mode": ATTN_MODE})
        out = logits[0, first: ctx - 1].float().cpu()
        self.seconds += time.perf_counter() - t0
        if out.shape[-1] < self.vocab:
            raise FormatError(f"{self.path}: exllamav3 gives {out.shape[-1]} logits per position, the reference "
                              f"vocabulary is {self.vocab}")
        return out[:, : self.vocab].contiguous()
