"""A GGUF without mixq's seal is still checked against its architecture: `mixq verify` names every tensor the
glm5-next loader needs for the file's own block count and layer kinds that is missing or has another shape, and
every tensor it would not read (formats/gguf_loader_tensors). The seal-less files are rewritten from a mixq conversion of
glm5next-mini with gguf-py's GGUFWriter, the way other tools write them; where llama-cpp-python is installed, the
real loader is the oracle for the stripped and the intact file."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from cli_helpers import rewrite_gguf as rewrite, run_cli
from mixq.formats.glm5next import gguf_sources
from mixq.formats.gguf_integrity import PREFIX
from mixq.formats.gguf_loader_tensors import ROWS

STRIPPED_BLOCK = "blk.2."  # a KDA block with a MoE FFN in glm5next-mini (block_count 5: 4 trunk + NextN)


def verify(path: Path, *args: str) -> tuple[int, list[str]]:
    r = run_cli("verify", path, "--json", *args)
    assert "Traceback" not in r.output, r.output[-2000:]
    return r.exit_code, json.loads(r.stdout)["problems"]


@pytest.fixture(scope="module")
def unsealed(mini_q8_gguf, tmp_path_factory) -> Path:
    return rewrite(mini_q8_gguf, tmp_path_factory.mktemp("layout") / "unsealed.gguf")


def _names(path: Path) -> dict[str, tuple[int, ...]]:
    return {t.name: tuple(int(x) for x in t.shape) for t in gguf.GGUFReader(path).tensors}


def test_intact_files_verify_sealed_or_not(mini_q8_gguf, unsealed):
    assert PREFIX + "tensor_sha256" not in gguf.GGUFReader(unsealed).fields
    assert _names(unsealed) == _names(mini_q8_gguf)
    for f in (mini_q8_gguf, unsealed):
        code, problems = verify(f, "--no-decode")
        assert (code, problems) == (0, []), problems


def test_a_block_removed_names_each_missing_tensor(unsealed, tmp_path):
    stripped = rewrite(unsealed, tmp_path / "no-blk2.gguf", drop=lambda n: n.startswith(STRIPPED_BLOCK))
    dropped = {n for n in _names(unsealed) if n.startswith(STRIPPED_BLOCK)}
    assert len(dropped) > 20
    code, problems = verify(stripped, "--no-decode")
    assert code == 1
    missing = {p.split(":")[0] for p in problems if ": missing;" in p}
    assert missing == dropped, sorted(missing ^ dropped)
    assert len(problems) == len(dropped)
    assert all("block 2 (KDA, MoE)" in p and "glm5-next.block_count 5" in p for p in problems), problems[0]
    r = run_cli("verify", stripped, "--no-decode")  # the text report lists them too
    assert r.exit_code == 1 and f"problem: {STRIPPED_BLOCK}attn_q.weight: missing" in r.stdout


def test_one_tensor_of_another_shape_is_named_with_both_shapes(unsealed, tmp_path):
    """The router of block 1 transposed: same bytes, so only the loader's shape check can tell."""
    name = "blk.1.ffn_gate_inp.weight"
    arr = np.array(next(t for t in gguf.GGUFReader(unsealed).tensors if t.name == name).data)
    assert arr.dtype == np.float32 and arr.shape == (16, 128)
    bad = rewrite(unsealed, tmp_path / "transposed.gguf", tensors={name: np.ascontiguousarray(arr.T)})
    code, problems = verify(bad)
    assert code == 1
    assert problems == [f"{name}: ne [16, 128], the glm5-next loader expects [128, 16] from this file's metadata"]


def test_a_tensor_the_loader_does_not_read_is_named(unsealed, tmp_path):
    extra = "blk.1.attn_kv_b.weight"  # the merged kv_b the loader never asks for (it reads k_b and v_b)
    bad = rewrite(unsealed, tmp_path / "extra.gguf", tensors={extra: np.zeros((4, 32), np.float32)})
    code, problems = verify(bad, "--no-decode")
    assert code == 1 and len(problems) == 1 and problems[0].startswith(f"{extra}: not read by the glm5-next loader")


def test_layer_kinds_come_from_the_files_metadata(unsealed, tmp_path):
    """Without leading_dense_block_count block 0 is a MoE block to the loader: llama.cpp then fails on
    'blk.0.ffn_gate_inp.weight not found' (gguf-glm5-next.md §1.2); verify names that tensor and block 0's dense
    FFN as unread."""
    bad = rewrite(unsealed, tmp_path / "no-dense.gguf", kv={"glm5-next.leading_dense_block_count": None})
    code, problems = verify(bad, "--no-decode")
    assert code == 1
    assert any(p.startswith("blk.0.ffn_gate_inp.weight: missing;") for p in problems), problems
    assert any(p.startswith("blk.0.ffn_down.weight: not read by") for p in problems), problems


@pytest.mark.parametrize("key,value,needle", [
    ("glm5-next.attention.head_count_kv", [0, 0, 1],
     "glm5-next.attention.head_count_kv: 3 entries, the loader expects 5"),
    ("glm5-next.attention.indexer.types", [True] * 5,
     "glm5-next.attention.indexer.types: the loader expects 4 entries"),
    ("glm5-next.embedding_length", None, "glm5-next.embedding_length: missing"),
])
def test_metadata_the_loader_cannot_use_is_named(unsealed, tmp_path, key, value, needle):
    bad = rewrite(unsealed, tmp_path / "bad-kv.gguf", kv={key: value})
    code, problems = verify(bad, "--no-decode")
    assert code == 1 and any(needle in p for p in problems), problems


def test_the_table_speaks_the_architecture_tables_names():
    """Every tensor of the loader table is a GGUF name of formats/glm5next (one source of names)."""
    for row in ROWS:
        name = row.name.format(i=3)
        assert gguf_sources(name, (16,)) is not None, name


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")
def test_llama_cpp_refuses_the_stripped_file_and_loads_the_intact_one(unsealed, tmp_path):
    import llama_cpp as L

    def loads(path: Path) -> bool:
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        if hasattr(mp, "use_extra_bufts"):
            mp.use_extra_bufts = False
        model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not model:
            return False
        L.llama_model_free(model)
        return True

    stripped = rewrite(unsealed, tmp_path / "no-blk2.gguf", drop=lambda n: n.startswith(STRIPPED_BLOCK))
    assert loads(unsealed)
    assert not loads(stripped)
