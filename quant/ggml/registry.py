"""The ggml types mixq writes, each declared once: its block layout and the encoders registered for it.

A type's block layout (weights and bytes per block) and whether ggml insists on an importance matrix are
formats/gguf_layout's facts, the one table of ggml types; a type adds how its encoders take their input (256-weight
super-blocks or whole 32-weight-block rows) and two backends with the same bytes: the numpy port (the CPU backend,
on the converter's worker processes) and the torch encoder (every device; Triton kernels inside it on CUDA); IQ1_S and
IQ1_M have no numpy port, their CPU backend is the torch encoder run on the host (:func:`on_host`). A legacy
type's numpy backend covers only the importance path: without an imatrix its bytes are gguf-py's own reference
quantizer, which is bit-exact with ggml's for those types.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType

from mixq.formats import gguf_layout
from mixq.quant.ggml.i_quants import numpy_iq2, numpy_iq3, numpy_iq4, torch_iq, torch_iq1, torch_iq4
from mixq.quant.ggml.k_quants import numpy_backend as nk
from mixq.quant.ggml.k_quants import torch_backend as tk
from mixq.quant.ggml.legacy import numpy_backend as nl
from mixq.quant.ggml.legacy import torch_backend as tl

Encoder = Callable  # (x, importance | None) -> uint8 blocks, numpy arrays or torch tensors by backend


@dataclass(frozen=True)
class GGMLType:
    """One ggml type: its layout and its encoders."""
    name: str
    superblock: bool                 # encoders take (blocks, 256) arrays; else whole rows of 32-weight blocks
    torch: Encoder                   # every device
    numpy: Encoder | None = None     # the CPU backend; None: gguf-py's reference quantizer
    numpy_needs_imatrix: bool = False  # the numpy backend is the importance path only (gguf-py without one)

    @property
    def needs_imatrix(self) -> bool:
        """Whether ggml refuses the type without an importance matrix (gguf_layout.GGML_REQUIRES_IMATRIX)."""
        return self.name in gguf_layout.GGML_REQUIRES_IMATRIX

    @property
    def block_weights(self) -> int:
        """Weights per block (gguf_layout)."""
        return gguf_layout.block_weights(self.name)

    @property
    def block_bytes(self) -> int:
        """Bytes per block (gguf_layout)."""
        return gguf_layout.block_bytes(self.name)

    def row_bytes(self, n: int) -> int:
        """Bytes of one encoded row of ``n`` weights (gguf_layout.row_bytes)."""
        return gguf_layout.row_bytes(self.name, n)


REGISTRY: dict[str, GGMLType] = {}


def on_host(encode: Encoder) -> Encoder:
    """A torch encoder as a CPU backend: numpy super-blocks in, numpy blocks out (for types without a numpy port)."""
    def run(xs: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        with torch.no_grad():
            out = encode(torch.from_numpy(np.ascontiguousarray(xs, dtype=np.float32)),
                         None if qw is None else torch.from_numpy(np.array(qw, dtype=np.float32)))
        return out.numpy()
    return run


def register(t: GGMLType) -> GGMLType:
    """Add ``t`` to the registry (one declaration per type)."""
    if t.name in REGISTRY:
        raise ValueError(f"ggml type {t.name} registered twice")
    GGMLQuantizationType[t.name]  # a name gguf-py does not know is a typo here
    REGISTRY[t.name] = t
    return t


for _t in (
    GGMLType("Q2_K", True, tk.encode_q2_k, nk.encode_q2_k),
    GGMLType("Q3_K", True, tk.encode_q3_k, nk.encode_q3_k),
    GGMLType("Q4_K", True, tk.encode_q4_k, nk.encode_q4_k),
    GGMLType("Q5_K", True, tk.encode_q5_k, nk.encode_q5_k),
    GGMLType("Q6_K", True, tk.encode_q6_k, nk.encode_q6_k),
    GGMLType("IQ4_XS", True, torch_iq4.encode_iq4_xs, numpy_iq4.encode_iq4_xs),
    GGMLType("IQ2_XXS", True, torch_iq.encode_iq2_xxs, numpy_iq2.encode_iq2_xxs),
    GGMLType("IQ2_XS", True, torch_iq.encode_iq2_xs, numpy_iq2.encode_iq2_xs),
    GGMLType("IQ2_S", True, torch_iq.encode_iq2_s, numpy_iq2.encode_iq2_s),
    GGMLType("IQ3_XXS", True, torch_iq.encode_iq3_xxs, numpy_iq3.encode_iq3_xxs),
    GGMLType("IQ3_S", True, torch_iq.encode_iq3_s, numpy_iq3.encode_iq3_s),
    GGMLType("IQ1_S", True, torch_iq1.encode_iq1_s, on_host(torch_iq1.encode_iq1_s)),
    GGMLType("IQ1_M", True, torch_iq1.encode_iq1_m, on_host(torch_iq1.encode_iq1_m)),
    GGMLType("Q8_0", False, tl.encode_q8_0),
    GGMLType("Q4_0", False, tl.encode_q4_0, nl.encode_q4_0, numpy_needs_imatrix=True),
    GGMLType("Q4_1", False, tl.encode_q4_1, nl.encode_q4_1, numpy_needs_imatrix=True),
    GGMLType("Q5_0", False, tl.encode_q5_0, nl.encode_q5_0, numpy_needs_imatrix=True),
    GGMLType("Q5_1", False, tl.encode_q5_1, nl.encode_q5_1, numpy_needs_imatrix=True),
    GGMLType("IQ4_NL", False, torch_iq4.encode_iq4_nl, numpy_iq4.encode_iq4_nl),
):
    register(_t)

SUPPORTED = tuple(REGISTRY)
REQUIRES_IMATRIX = tuple(n for n, t in REGISTRY.items() if t.needs_imatrix)
