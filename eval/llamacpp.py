"""`--engine llamacpp`: logits of a GGUF candidate from llama.cpp itself (llama-cpp-python's low-level API).

Recipe from gguf-glm5-next.md §6.3-6.4: one batch per window with an explicit n_ctx, n_batch = n_ubatch =
window, one sequence, outputs flagged only for the scored positions, memory cleared between windows.
The model is loaded with `use_extra_bufts = False` because the CPU AMX extra buffer crashes on Q4_0/Q8_0/K-quant
weights of this architecture (§6.4). The KV cache type is chosen with `cache_type`: f32 (reference-grade,
≈8e-6 max abs logit error), f16 (llama.cpp's default) or q8_0 (needs flash attention, turned on for it only).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mixq.errors import FormatError, InputError

# ggml_type ids of the KV cache types offered
CACHE_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}


def _import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise InputError(f"--engine llamacpp needs llama-cpp-python (pip install llama-cpp-python==0.3.36): {e}") from e
    return llama_cpp


class LlamaCppScorer:
    """Callable: window tokens (ctx,) -> float32 logits (ctx - 1 - first, vocab) from llama.cpp."""

    def __init__(self, path: Path, *, ctx: int, first: int, cache_type: str = "f32", n_threads: int | None = None):
        if cache_type not in CACHE_TYPES:
            raise InputError(f"--cache-type must be one of {sorted(CACHE_TYPES)}, not {cache_type!r}")
        L = _import_llama_cpp()
        self.L, self.ctx, self.first = L, ctx, first
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        if hasattr(mp, "use_extra_bufts"):
            mp.use_extra_bufts = False  # AMX repacking crashes on this architecture (gguf-glm5-next.md §6.4)
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise FormatError(f"{path}: llama.cpp could not load the model (run llama.cpp verbosely for the reason)")
        cp = L.llama_context_default_params()
        cp.n_ctx = ctx
        cp.n_batch = ctx
        cp.n_ubatch = ctx
        cp.n_seq_max = 1
        cp.type_k = cp.type_v = CACHE_TYPES[cache_type]
        # quantized V caches need flash attention in llama.cpp; keep it off otherwise (it adds ≈3e-4 error)
        cp.flash_attn_type = 1 if cache_type == "q8_0" else 0
        # the same thread count as torch (OMP_NUM_THREADS / torch.set_num_threads), one knob for both engines
        cp.n_threads = cp.n_threads_batch = int(n_threads or torch.get_num_threads())
        self.lctx = L.llama_init_from_model(self.model, cp)
        if not self.lctx:
            L.llama_model_free(self.model)
            raise FormatError(f"{path}: llama.cpp could not create a context (ctx {ctx}, cache {cache_type})")
        self.n_vocab = int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model)))
        self.batch = L.llama_batch_init(ctx, 0, 1)
        self.path = path

    def __call__(self, window: torch.Tensor) -> torch.Tensor:
        L, b = self.L, self.batch
        toks = window.tolist()
        if len(toks) != self.ctx:
            raise ValueError(f"window of {len(toks)} tokens, expected {self.ctx}")
        L.llama_memory_clear(L.llama_get_memory(self.lctx), True)
        for i, t in enumerate(toks):
            b.token[i] = int(t)
            b.pos[i] = i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1 if self.first <= i <= self.ctx - 2 else 0
        b.n_tokens = self.ctx
        rc = L.llama_decode(self.lctx, b)
        if rc != 0:
            raise FormatError(f"{self.path}: llama_decode failed with code {rc}")
        rows = self.ctx - 1 - self.first
        ptr = L.llama_get_logits(self.lctx)
        out = np.ctypeslib.as_array(ptr, shape=(rows * self.n_vocab,)).reshape(rows, self.n_vocab).copy()
        return torch.from_numpy(out)

    def close(self) -> None:
        if getattr(self, "lctx", None):
            self.L.llama_batch_free(self.batch)
            self.L.llama_free(self.lctx)
            self.L.llama_model_free(self.model)
            self.lctx = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass
