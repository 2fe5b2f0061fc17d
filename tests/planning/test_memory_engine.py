"""planning/memory.py against llama.cpp itself: the cache sizes llama.cpp logs when it creates a context (k256, BF16
GGUF written by mixq) must match ``llama_cpp_cache`` within 2% at two context lengths. Slow; needs llama-cpp-python.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from mixq.planning.memory import CacheGeometry, llama_cpp_cache

pytestmark = pytest.mark.slow

_PROBE = textwrap.dedent("""
    import sys, llama_cpp as L
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(sys.argv[1].encode(), mp)
    assert model, "model did not load"
    cp = L.llama_context_default_params()
    cp.n_ctx = int(sys.argv[2]); cp.n_seq_max = int(sys.argv[3]); cp.n_batch = 64; cp.n_ubatch = 64
    cp.type_k = cp.type_v = int(sys.argv[4])
    ctx = L.llama_init_from_model(model, cp)
    assert ctx, "context was not created"
    L.llama_free(ctx); L.llama_model_free(model)
""")
_MIB = 1024 * 1024


def _logged_sizes(gguf: str, n_ctx: int, n_seq: int, ggml_type: int) -> dict[str, float]:
    r = subprocess.run([sys.executable, "-c", _PROBE, gguf, str(n_ctx), str(n_seq), str(ggml_type)],
                       capture_output=True, text=True, timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-2000:]
    kv = [float(m) for m in re.findall(r"llama_kv_cache: size =\s*([\d.]+) MiB", log)]
    rs = re.findall(r"llama_memory_recurrent: size =\s*([\d.]+) MiB.*?R \(f32\):\s*([\d.]+) MiB, S \(f32\):\s*"
                    r"([\d.]+) MiB", log)
    assert kv and rs, log[-3000:]
    return {"kv": sum(kv) * _MIB, "rs": float(rs[0][0]) * _MIB, "r": float(rs[0][1]) * _MIB,
            "s": float(rs[0][2]) * _MIB}


@pytest.fixture(scope="module")
def k256_gguf(k256_model, tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from mixq.conversion.gguf.pipeline import convert_gguf

    out = tmp_path_factory.mktemp("k256") / "k256-bf16.gguf"
    convert_gguf(k256_model, out, qtype="BF16", progress=False)
    return str(out)


@pytest.mark.parametrize("n_ctx", [4096, 16384])
@pytest.mark.parametrize("cache,ggml_type", [("f16", 1), ("q8_0", 8)])
def test_llama_cpp_reports_the_predicted_cache(k256_gguf, k256_model, n_ctx, cache, ggml_type):
    geo = CacheGeometry.from_config(json.loads((k256_model / "config.json").read_text()))
    n_seq = 4  # makes the recurrent state large enough that the log's 0.01 MiB rounding stays below 1%
    got = _logged_sizes(k256_gguf, n_ctx, n_seq, ggml_type)
    want = llama_cpp_cache(geo, n_ctx, cache_type=cache, n_seq=n_seq)
    assert got["kv"] == pytest.approx(want.mla + want.indexer, rel=0.02)
    assert got["rs"] == pytest.approx(want.recurrent + want.conv, rel=0.02)
    assert got["s"] == pytest.approx(want.recurrent, rel=0.02)
    assert got["r"] == pytest.approx(want.conv, abs=0.0051 * _MIB)  # logged with 2 decimals in MiB
