"""`--engine llamacpp` input errors (fast; the engine itself is tested in the slow test_llamacpp.py)."""
from __future__ import annotations

import sys

import pytest

from mixq.errors import InputError
from mixq.eval.llamacpp import LlamaCppScorer


def test_missing_client_is_an_input_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import raises ImportError
    with pytest.raises(InputError, match="llama-cpp-python"):
        LlamaCppScorer(tmp_path / "m.gguf", ctx=64, first=32)


def test_bad_cache_type(tmp_path):
    with pytest.raises(InputError, match="--cache-type"):
        LlamaCppScorer(tmp_path / "m.gguf", ctx=64, first=32, cache_type="q4_0")
