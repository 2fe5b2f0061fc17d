"""The torch encoders of every ggml type mixq writes, by type, and the chunked loop that runs them on a device.

:func:`encode` is the engine behind :func:`kquants.quantize_tensor` (which validates its input):
float32 rows (R, n) on any device -> uint8 (R, row_bytes) there, bytes equal to ggml's (and to the
numpy encoders) on every device. On CUDA the hot searches run as fused Triton kernels
(:mod:`kquants_fused`, :mod:`kquants_fused_grid`, :mod:`kquants_fused_descent`), the rest as eager
torch ops. Work is cut into row chunks sized per device: on CUDA as large as memory allows (each
launch should cover millions of weights), on CPU small enough to stay in cache.
"""
from __future__ import annotations

from typing import Callable

import torch

from . import kquants_fused
from . import kquants_torch_blocks as tb
from . import kquants_torch_iq as ti
from . import kquants_torch_iq4 as ti4
from . import kquants_torch_legacy as tl

# super-block encoders: (xs (S, 256), qw (S, 256) | None) -> (S, block_bytes)
SUPERBLOCK_ENCODERS: dict[str, Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]] = {
    "Q2_K": tb.encode_q2_k, "Q3_K": tb.encode_q3_k, "Q4_K": tb.encode_q4_k, "Q5_K": tb.encode_q5_k,
    "Q6_K": tb.encode_q6_k, "IQ4_XS": ti4.encode_iq4_xs,
    "IQ2_XXS": ti.encode_iq2_xxs, "IQ2_XS": ti.encode_iq2_xs, "IQ2_S": ti.encode_iq2_s,
    "IQ3_XXS": ti.encode_iq3_xxs, "IQ3_S": ti.encode_iq3_s,
}
# 32-weight types, row by row: (x (R, n), qw (R, n) | None) -> (R, row_bytes)
ROW_ENCODERS: dict[str, Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]] = {
    "Q8_0": tl.encode_q8_0, "Q4_0": tl.encode_q4_0, "Q4_1": tl.encode_q4_1, "Q5_0": tl.encode_q5_0,
    "Q5_1": tl.encode_q5_1, "IQ4_NL": ti4.encode_iq4_nl,
}
TYPES = tuple(SUPERBLOCK_ENCODERS) + tuple(ROW_ENCODERS)

# weights per chunk. On CUDA the fused kernels (kquants_fused*) keep per-block state in registers, so
# chunks are as large as the eager remainder's temporaries allow (~16 float32 copies of a chunk);
# the eager lattice search holds every candidate of every group at once and takes small chunks.
CHUNK_WEIGHTS_CPU = 1 << 18
CHUNK_WEIGHTS_CUDA_FUSED = 1 << 26
CHUNK_WEIGHTS_CUDA_EAGER = {"IQ2_XXS": 1 << 21, "IQ2_XS": 1 << 21, "IQ2_S": 1 << 22, "IQ3_XXS": 1 << 22,
                            "IQ3_S": 1 << 22}
CHUNK_WEIGHTS_CUDA_EAGER_DEFAULT = 1 << 24


def chunk_weights(qtype: str, device: torch.device) -> int:
    """Weights encoded per chunk for ``qtype`` on ``device``."""
    if device.type == "cpu":
        return CHUNK_WEIGHTS_CPU
    if kquants_fused.fused_ok(f"cuda:{device.index or 0}" if device.type == "cuda" else str(device)):
        return CHUNK_WEIGHTS_CUDA_FUSED
    return CHUNK_WEIGHTS_CUDA_EAGER.get(qtype, CHUNK_WEIGHTS_CUDA_EAGER_DEFAULT)


def encode_rows(x: torch.Tensor, qtype: str, imatrix: torch.Tensor | None) -> torch.Tensor:
    """Encode one chunk of float32 rows (R, n) on its device; imatrix (R, n) (one row per row of x) or None."""
    R, n = x.shape
    if qtype in ROW_ENCODERS:
        return ROW_ENCODERS[qtype](x, imatrix)
    qw = None if imatrix is None else imatrix.reshape(-1, 256)
    return SUPERBLOCK_ENCODERS[qtype](x.reshape(-1, 256), qw).reshape(R, -1)


def encode(x: torch.Tensor, qtype: str, imatrix: torch.Tensor | None, row_bytes: int,
           chunk: int | None = None) -> torch.Tensor:
    """All rows of x (R, n) in chunks of about ``chunk`` weights; uint8 (R, row_bytes) on x's device.

    imatrix: (n,) for every row, (R, n) per row (e.g. stacked experts, each with its own), or None.
    """
    R, n = x.shape
    step = max(1, (chunk or chunk_weights(qtype, x.device)) // n)
    out = torch.empty((R, row_bytes), dtype=torch.uint8, device=x.device)
    with torch.no_grad():
        for r0 in range(0, R, step):
            rows = x[r0:r0 + step]
            im = None
            if imatrix is not None:
                im = imatrix.expand(R, n)[r0:r0 + step] if imatrix.dim() == 1 else imatrix[r0:r0 + step]
            out[r0:r0 + step] = encode_rows(rows, qtype, im)
    return out
