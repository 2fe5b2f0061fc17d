"""The GGUF converter and the i-quant types: llama-quantize's importance-matrix rule, checked before any writing.

(The bytes themselves: tests/quant/test_ggml_iquants.py; a whole k256 file against llama-quantize, type for type,
with KLD in llama.cpp: bench/quality/iq_ladder.py.)
"""
from __future__ import annotations

import numpy as np
import pytest

from mixq.conversion.gguf.pipeline import convert_gguf
from mixq.formats.gguf_layout import QUANTIZE_REQUIRES_IMATRIX
from mixq.errors import InputError
from mixq.formats.imatrix_file import IMatrix

EXPS = r"ffn_(gate|up|down)_exps"


def test_iq2_experts_without_imatrix_fail_naming_the_tensor(k256_model, tmp_path):
    out = tmp_path / "x.gguf"
    with pytest.raises(InputError, match=r"^blk\.1\.ffn_\w+_exps\.weight: IQ2_XS needs an importance matrix "
                                         r"\(no --imatrix given"):
        convert_gguf(k256_model, out, qtype="Q4_K_M", tensor_type=[(EXPS, "IQ2_XS")], progress=False)
    assert list(tmp_path.iterdir()) == []


def test_tensor_missing_from_the_imatrix_is_named(k256_model, tmp_path):
    # entries for the main layers' experts only: the NextN block (blk.4) has none, as from llama-imatrix
    im = IMatrix(chunk_count=1)
    for layer in (1, 2, 3):
        for p in ("gate", "up", "down"):
            im.add(f"blk.{layer}.ffn_{p}_exps.weight", np.ones((16, 256), np.float32), 1.0)
    with pytest.raises(InputError, match=r"^blk\.4\.ffn_\w+_exps\.weight: IQ2_S needs an importance matrix "
                                         r"\(the imatrix has no entry"):
        convert_gguf(k256_model, tmp_path / "x.gguf", qtype="Q4_K_M", tensor_type=[(EXPS, "IQ2_S")],
                     imatrix=im, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_rule_matches_llama_quantize():
    # llama-quant.cpp tensor_requires_imatrix (0.3.36): these types, token_embd/output excepted
    assert set(QUANTIZE_REQUIRES_IMATRIX) == {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS"}
