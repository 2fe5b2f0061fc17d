"""The torch encoders of every ggml type mixq writes, by type, and the chunked loop that runs them on a device.

:func:`encode` is the engine behind :func:`encoders.quantize_tensor` (which validates its input):
float32 rows (R, n) on any device -> uint8 (R, row_bytes) there, bytes equal to ggml's (and to the
numpy encoders) on every device. On CUDA the hot searches run as fused Triton kernels
(:mod:`triton_kernels.search`, :mod:`triton_kernels.grid`, :mod:`triton_kernels.descent`), the rest as eager
torch ops. Work is cut into row chunks sized per device: on CUDA as large as memory allows (each
launch should cover millions of weights), on CPU small enough to stay in cache.
"""
from __future__ import annotations

import torch

from mixq.quant.ggml.registry import REGISTRY
from mixq.quant.ggml.triton_kernels import search as triton_search

TYPES = tuple(REGISTRY)

# weights per chunk. On CUDA the fused kernels (triton_kernels) keep per-block state in registers, so
# chunks are as large as the eager remainder's temporaries allow (~16 float32 copies of a chunk);
# the eager lattice search holds every candidate of every group at once and takes small chunks.
CHUNK_WEIGHTS_CPU = 1 << 18
CHUNK_WEIGHTS_CUDA_FUSED = 1 << 26
CHUNK_WEIGHTS_CUDA_EAGER = {"IQ2_XXS": 1 << 21, "IQ2_XS": 1 << 21, "IQ2_S": 1 << 22, "IQ3_XXS": 1 << 22,
                            "IQ3_S": 1 << 22}
CHUNK_WEIGHTS_CUDA_EAGER_DEFAULT = 1 << 24
# the IQ1 types (no fused kernel) score every split of every sub-block at once: ~12 float32 arrays of 35 (IQ1_S)
# or 38 (IQ1_M) values per weight
CHUNK_WEIGHTS_IQ1 = {"IQ1_S": 1 << 21, "IQ1_M": 1 << 21}


def chunk_weights(qtype: str, device: torch.device) -> int:
    """Weights encoded per chunk for ``qtype`` on ``device``."""
    if device.type == "cpu":
        return CHUNK_WEIGHTS_CPU
    if qtype in CHUNK_WEIGHTS_IQ1:
        return CHUNK_WEIGHTS_IQ1[qtype]
    if triton_search.fused_ok(f"cuda:{device.index or 0}" if device.type == "cuda" else str(device)):
        return CHUNK_WEIGHTS_CUDA_FUSED
    return CHUNK_WEIGHTS_CUDA_EAGER.get(qtype, CHUNK_WEIGHTS_CUDA_EAGER_DEFAULT)


def encode_rows(x: torch.Tensor, qtype: str, imatrix: torch.Tensor | None) -> torch.Tensor:
    """Encode one chunk of float32 rows (R, n) on its device; imatrix (R, n) (one row per row of x) or None."""
    R, n = x.shape
    t = REGISTRY[qtype]
    if not t.superblock:
        return t.torch(x, imatrix)
    qw = None if imatrix is None else imatrix.reshape(-1, 256)
    return t.torch(x.reshape(-1, 256), qw).reshape(R, -1)


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
