"""ggml's own quantizer through ctypes: the oracle for bit-exactness tests and the speed benchmark.

Loads ``libggml-base`` shipped in llama-cpp-python (``llama_cpp/lib``) without importing
llama_cpp itself, or the file named by ``MIXQ_GGML_BASE_LIB``. ``ggml_quantize_chunk`` runs on
the calling thread only, so timings compare single-threaded encoders.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from mixq.errors import InputError


def find_ggml_base() -> Path | None:
    """Path of libggml-base from $MIXQ_GGML_BASE_LIB or the installed llama_cpp package, or None."""
    env = os.environ.get("MIXQ_GGML_BASE_LIB")
    if env:
        return Path(env) if Path(env).is_file() else None
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
            for p in (Path(root) / "lib" / name, Path(root) / name):
                if p.is_file():
                    return p
    return None


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    path = find_ggml_base()
    if path is None:
        raise InputError("libggml-base not found: install llama-cpp-python or set MIXQ_GGML_BASE_LIB")
    lib = ctypes.CDLL(str(path))
    f = lib.ggml_quantize_chunk
    f.restype = ctypes.c_size_t
    f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    return lib


def available() -> bool:
    """True when libggml-base can be loaded."""
    try:
        _lib()
        return True
    except (InputError, OSError):
        return False


def ggml_quantize(x: np.ndarray, qtype: str, imatrix: np.ndarray | None = None) -> np.ndarray:
    """ggml_quantize_chunk over all rows of float32 x (rows, n); uint8 (rows, bytes_per_row)."""
    lib = _lib()
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    t = int(GGMLQuantizationType[qtype])
    rb = lib.ggml_row_size(t, n)
    out = np.empty((rows, rb), dtype=np.uint8)
    im = None
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
        im = imatrix.ctypes.data
    got = lib.ggml_quantize_chunk(t, x.ctypes.data, out.ctypes.data, 0, rows, n, im)
    if got != rows * rb:
        raise InputError(f"ggml_quantize_chunk wrote {got} bytes, expected {rows * rb}")
    return out
