"""planning/memory.py: cache arithmetic against hand-derived engine layouts (docs/memory-model.md)."""
from __future__ import annotations

import json

import pytest

from mixq.errors import PlanError
from mixq.planning import memory as mem


@pytest.fixture(scope="module")
def flash_geo(flash_config):
    return mem.CacheGeometry.from_config(json.loads(flash_config.read_text()))


def test_geometry_of_glm53(flash_geo):
    g = flash_geo
    assert (g.dsa_layers, g.indexer_layers, g.kda_layers) == (11, 11, 34)
    assert (g.kv_lora_rank, g.index_head_dim, g.index_kpool, g.kda_heads, g.kda_head_dim) == (512, 128, 16, 64, 128)


def test_llama_cpp_q8_0_cache_bytes(flash_geo):
    c = mem.llama_cpp_cache(flash_geo, 262144, cache_type="q8_0")
    # per token per DSA layer: MLA 512 values + indexer 3*128 values, q8_0 = 34 bytes per 32 values
    assert c.mla == 11 * 262144 * 512 // 32 * 34
    assert c.indexer == 11 * 262144 * 384 // 32 * 34
    # KDA: S = d*d*H floats, R = 3*(4-1)*H*d floats, F32, one sequence
    assert c.recurrent == 34 * 128 * 128 * 64 * 4 and c.conv == 34 * 3 * 3 * 64 * 128 * 4
    assert c.total == 2_897_805_312
    assert c.per_token == pytest.approx(11 * (544 + 408))
    f16 = mem.llama_cpp_cache(flash_geo, 1000, cache_type="f16")
    assert f16.cells == 1024 and f16.mla == 11 * 1024 * 1024  # padded to 256 cells, 2 bytes x 512


def test_llama_cpp_rejects_what_llama_cpp_rejects(flash_geo):
    with pytest.raises(PlanError, match="equal K and V"):
        mem.llama_cpp_cache(flash_geo, 4096, cache_type="q8_0", cache_type_v="f16")
    with pytest.raises(PlanError, match="flash attention"):
        mem.llama_cpp_cache(flash_geo, 4096, cache_type="q4_0", flash_attn=False)
    with pytest.raises(PlanError, match="unknown"):
        mem.llama_cpp_cache(flash_geo, 4096, cache_type="q3_k")
    a = mem.llama_cpp_cache(flash_geo, 4096, cache_type="f16", flash_attn=False)
    b = mem.llama_cpp_cache(flash_geo, 4096, cache_type="f16", flash_attn=True)
    assert a.total == b.total  # no V tensor in the MLA/indexer caches: flash attention changes no bytes


def test_exllamav3_cache_bytes(flash_geo):
    fp16 = mem.exllamav3_cache(flash_geo, 262144, cache="fp16")
    assert fp16.mla == 11 * 262144 * 1024
    assert fp16.indexer == 11 * 262144 * 256 * 2 and fp16.kpool == 11 * (262144 // 16) * 128 * 2
    q8 = mem.exllamav3_cache(flash_geo, 262144, cache="q8")
    assert q8.mla == 11 * 262144 * (16 * 8 * 4 + 16 * 2)  # packed int32 planes + fp16 scale per 32
    assert q8.indexer == fp16.indexer  # the indexer planes stay fp16
    # KDA per slot: 2 state rows fp16 + bf16 conv ring (kernel 4) + staged inputs for one token
    assert q8.recurrent == 34 * 2 * 64 * 128 * 128 * 2
    assert q8.conv == 34 * (3 * 8192 * 4 * 2 + 3 * 8192 * 2 + 64 * 2 + 8192 * 4)
    q4 = mem.exllamav3_cache(flash_geo, 4096, cache="q4", batch=4)
    assert q4.recurrent == 4 * mem.exllamav3_cache(flash_geo, 4096, cache="q4").recurrent
    with pytest.raises(PlanError):
        mem.exllamav3_cache(flash_geo, 4096, cache="q8_0")
