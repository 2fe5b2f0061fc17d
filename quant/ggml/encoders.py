"""ggml block encoders: ``quantize(x, qtype, imatrix=None)`` -> bytes in ggml's block layout.

The contract is pinned (docs/INTERNALS.md). Without an importance matrix the bytes equal ggml's reference quantizer
(``quantize_row_*_ref``); with one they equal ggml's importance path (``quantize_*`` with
``quant_weights``), which for Q8_0 ignores it. Q2_K…Q6_K and the importance paths of the legacy
32-weight types are our vectorised numpy ports (:mod:`k_quants.numpy_backend`, :mod:`legacy.numpy_backend`);
the legacy reference paths and Q8_0 come from gguf-py, which is bit-exact for them. The lattice
i-quants IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (:mod:`numpy_iq2`, :mod:`numpy_iq3`) take their
codebooks from gguf-py; IQ2_XXS and IQ2_XS need an imatrix (ggml refuses them without one). IQ4_XS
and IQ4_NL (:mod:`numpy_iq4`) share the non-linear 16-level grid.
The imatrix is a per-column vector of length n (for an expert tensor: that expert's slice).

Two paths, the same bytes: ``device="cpu"`` (the default) runs the numpy encoders on the calling
thread (the GGUF converter's ``--threads`` worker processes use it); ``device="cuda"`` and
:func:`quantize_tensor` run the torch encoders (:mod:`torch_encoders`; fused Triton kernels on CUDA,
:mod:`triton_kernels.search`). Hand tensors to :func:`quantize_tensor` on the GPU to skip the host copies.

Verified byte for byte against libggml-base of llama-cpp-python 0.3.36 (x86-64, GGML_NATIVE=OFF)
for every type here, with and without imatrix, on edge-case rows and on every 2-D tensor of the
k256 and mini fixtures (tests/quant/test_ggml_encoders.py; i-quants: tests/quant/test_ggml_iquants.py). Speed:
about 2-3x ggml's single-thread CPU time for the K-quants (bench/speed/kquant_speed.py).
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from mixq.errors import InputError
from mixq.quant.ggml import torch_encoders
from mixq.quant.ggml.registry import REGISTRY, REQUIRES_IMATRIX, SUPPORTED  # noqa: F401 (the encoders' public names)

# weights per encoding chunk: numpy call overhead vs. working set (64K weights measured fastest: arrays stay in cache)
CHUNK_WEIGHTS = 1 << 16



def _ggml_type(qtype: str) -> GGMLQuantizationType:
    if qtype not in SUPPORTED:
        raise InputError(f"unsupported quantization type {qtype!r}; supported: {', '.join(SUPPORTED)}")
    return GGMLQuantizationType[qtype]


def block_size(qtype: str) -> int:
    """Weights per block (32 for Q8_0/Q4_0/…, 256 for K-quants)."""
    _ggml_type(qtype)
    return REGISTRY[qtype].block_weights


def type_size(qtype: str) -> int:
    """Bytes per block."""
    _ggml_type(qtype)
    return REGISTRY[qtype].block_bytes


def row_bytes(qtype: str, n: int) -> int:
    """Bytes of one encoded row of n weights."""
    _ggml_type(qtype)
    return REGISTRY[qtype].row_bytes(n)


def _check_shape(shape: tuple, qtype: str, imatrix_size: int | None) -> None:
    _ggml_type(qtype)
    if len(shape) != 2:
        raise InputError(f"ggml quantize: expected a 2-D (rows, n) array, got shape {tuple(shape)}")
    n = shape[1]
    bs = block_size(qtype)
    if n == 0 or n % bs:
        raise InputError(f"ggml quantize: row length {n} is not a positive multiple of {bs} ({qtype})")
    if imatrix_size is not None and imatrix_size != n:
        raise InputError(f"ggml quantize: imatrix has {imatrix_size} values, row length is {n}")


def _check(x: np.ndarray, qtype: str, imatrix: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    x = np.asarray(x)
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1)
    _check_shape(x.shape, qtype, None if imatrix is None else imatrix.size)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.all(np.isfinite(x)):
        raise InputError("ggml quantize: the tensor contains NaN or infinite values")
    if imatrix is not None and not np.all(np.isfinite(imatrix)):
        raise InputError("ggml quantize: imatrix contains non-finite values")
    return x, imatrix


def _encode_rows(x: np.ndarray, qtype: str, imatrix: np.ndarray | None) -> np.ndarray:
    R, n = x.shape
    t = REGISTRY[qtype]
    if t.superblock:
        xs = x.reshape(R * (n // 256), 256)
        qw = None
        if imatrix is not None:
            qw = np.broadcast_to(imatrix.reshape(1, n // 256, 256), (R, n // 256, 256)).reshape(-1, 256)
        return t.numpy(xs, qw).reshape(R, -1)
    if t.numpy is not None and (imatrix is not None or not t.numpy_needs_imatrix):
        return t.numpy(x, imatrix)
    if qtype in ("Q4_0", "Q5_0"):
        # ggml's scan keeps max = +0.0 for an all-(-0.0) block, gguf-py takes the -0.0 itself;
        # adding +0.0 turns -0.0 into +0.0 and changes nothing else
        x = x + np.float32(0)
    return np.asarray(gguf_quants.quantize(x, GGMLQuantizationType[qtype]), dtype=np.uint8).reshape(R, -1)


def _device(device: str | torch.device) -> torch.device:
    """The torch device named by ``device``; InputError if it does not exist here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InputError(f"ggml quantize: unknown device {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"ggml quantize: device {device!r} requested but torch sees no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"ggml quantize: device {device!r} is not supported (cpu or cuda)")
    return dev


def default_device() -> str:
    """"cuda" when torch sees a GPU, else "cpu": the device to pass to :func:`quantize` for speed."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def quantize(x: np.ndarray, qtype: str, imatrix: np.ndarray | None = None, *,
             device: str | torch.device = "cpu") -> np.ndarray:
    """Encode float32 rows ``x`` (rows, n) as ``qtype``; returns uint8 (rows, bytes_per_row).

    ``imatrix`` (n,) selects ggml's importance-weighted path (mean of squared activations per
    column, as llama-imatrix stores it). The output is readable by ``gguf.quants.dequantize``.
    ``device`` "cpu" runs the numpy encoders on this thread; any other torch device (e.g. "cuda")
    runs the torch encoders there (:func:`quantize_tensor`). The bytes are the same on every device.
    """
    dev = _device(device)
    if dev.type != "cpu":  # the checks run on the device (a host pass would cost as much)
        xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(dev)
        im = None if imatrix is None else torch.from_numpy(np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1))
        return quantize_tensor(xt, qtype, im).cpu().numpy()
    x, imatrix = _check(x, qtype, imatrix)
    R, n = x.shape
    out = np.empty((R, row_bytes(qtype, n)), dtype=np.uint8)
    # Q3_K's reference search is dominated by per-element descent steps on small arrays
    step = max(1, CHUNK_WEIGHTS * (2 if qtype == "Q3_K" and imatrix is None else 1) // n)
    with np.errstate(all="ignore"):  # ggml's searches divide by zero on degenerate blocks, then mask
        for r0 in range(0, R, step):
            out[r0:r0 + step] = _encode_rows(x[r0:r0 + step], qtype, imatrix)
    return out


def quantize_tensor(x: torch.Tensor, qtype: str, imatrix: torch.Tensor | None = None, *,
                    chunk: int | None = None) -> torch.Tensor:
    """Encode float rows ``x`` (rows, n) on x's device with the torch encoders (:mod:`torch_encoders`).

    Same contract and bytes as :func:`quantize`; returns uint8 (rows, bytes_per_row) on x's device.
    ``imatrix`` is (n,) for every row or (rows, n) with each row's own (stacked experts); it may live
    on any device. ``chunk``: weights per device call (None: the device's default; the bytes do not depend on it).
    """
    if qtype in REQUIRES_IMATRIX and imatrix is None:
        raise InputError(f"{qtype} needs an importance matrix (as in llama.cpp)")
    per_row = imatrix is not None and imatrix.dim() == 2
    if per_row and tuple(imatrix.shape) != tuple(x.shape):
        raise InputError(f"ggml quantize: imatrix has shape {tuple(imatrix.shape)}, rows are {tuple(x.shape)}")
    _check_shape(tuple(x.shape), qtype, None if imatrix is None else int(imatrix.shape[-1]))
    x = x.to(torch.float32).contiguous()
    if not bool(torch.isfinite(x).all()):
        raise InputError("ggml quantize: the tensor contains NaN or infinite values")
    if imatrix is not None:
        imatrix = imatrix.to(device=x.device, dtype=torch.float32).contiguous()
        if not bool(torch.isfinite(imatrix).all()):
            raise InputError("ggml quantize: imatrix contains non-finite values")
    return torch_encoders.encode(x, qtype, imatrix, row_bytes(qtype, x.shape[1]), chunk=chunk)


def quantize_stacked(x: np.ndarray, qtype: str, imatrix: np.ndarray | None = None, *,
                     device: str | torch.device = "cpu", chunk: int | None = None) -> np.ndarray:
    """Encode a stack of matrices (E, rows, n), e.g. routed experts, as llama-quantize does.

    ``imatrix`` is (E, n) or flat (E*n,) as stored in imatrix files: expert e uses its own slice.
    Returns uint8 (E, rows, bytes_per_row). ``chunk``: weights per device call (None: the device's default).
    """
    x = np.asarray(x)
    if x.ndim != 3:
        raise InputError(f"ggml quantize_stacked: expected (E, rows, n), got shape {x.shape}")
    E, _, n = x.shape
    im = None
    if imatrix is not None:
        im = np.asarray(imatrix, dtype=np.float32)
        if im.size != E * n:
            raise InputError(f"ggml quantize_stacked: imatrix has {im.size} values, expected {E}x{n}")
        im = im.reshape(E, n)
    dev = _device(device)
    if dev.type != "cpu":
        return _quantize_stacked_on(dev, x, qtype, im, chunk)
    return np.stack([quantize(x[e], qtype, None if im is None else im[e], device=device) for e in range(E)])


def _quantize_stacked_on(dev: torch.device, x: np.ndarray, qtype: str, im: np.ndarray | None,
                         chunk: int | None = None) -> np.ndarray:
    """quantize_stacked on an accelerator: groups of experts per call, each row carrying its expert's imatrix
    (the groups bound the device copies of the stack and of its per-row imatrix)."""
    E, rows, n = x.shape
    chunk = chunk or torch_encoders.chunk_weights(qtype, dev)
    per = max(1, chunk // max(1, rows * n))
    out = np.empty((E, rows, row_bytes(qtype, n)), dtype=np.uint8)
    for e0 in range(0, E, per):
        e1 = min(E, e0 + per)
        xt = torch.from_numpy(np.ascontiguousarray(x[e0:e1], dtype=np.float32)).to(dev).reshape(-1, n)
        imt = None
        if im is not None:
            imt = torch.from_numpy(np.ascontiguousarray(im[e0:e1])).to(dev)[:, None].expand(e1 - e0, rows, n)
            imt = imt.reshape(-1, n)
        out[e0:e1] = quantize_tensor(xt, qtype, imt, chunk=chunk).cpu().numpy().reshape(e1 - e0, rows, -1)
    return out
