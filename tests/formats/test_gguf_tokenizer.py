"""GGUF tokenizer metadata from the fixtures' tokenizer.json (byte-level BPE, GLM special tokens)."""
from __future__ import annotations

import json
import shutil

import pytest

from mixq.errors import InputError
from mixq.formats.gguf_tokenizer import (TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNUSED, _load_tokenizer, probe_hash,
                                         tokenizer_metadata)


def test_fixture_tokenizer_metadata(mini_model):
    m = tokenizer_metadata(mini_model, 8200)
    tj = json.loads((mini_model / "tokenizer.json").read_text())
    assert m.pre == "gpt-2"  # unknown hash, plain GPT-2 byte-level pre-tokenizer
    assert len(m.tokens) == 8200 and len(set(m.tokens)) == 8200
    assert m.tokens[:3] == ["<|endoftext|>", "[gMASK]", "<sop>"]
    assert m.token_types[:8] == [TOKEN_CONTROL] * 8 and m.token_types[8] == TOKEN_NORMAL
    assert m.tokens[8195] == "[PAD8195]" and m.token_types[8195] == TOKEN_UNUSED
    assert m.tokens[100] == {v: k for k, v in tj["model"]["vocab"].items()}[100]
    assert len(m.merges) == len(tj["model"]["merges"]) and m.merges[0] == "Ġ Ġ"
    # GLM conventions (gguf-glm5-next.md §1.4): bos [gMASK], eos/pad/unk <|endoftext|>, eot <|user|>, eom <|observation|>
    assert m.special_ids == {"bos": 1, "eos": 0, "pad": 0, "unk": 0, "eot": 3, "eom": 5}
    assert tokenizer_metadata(mini_model, 8192, tokenizer_pre="glm4").pre == "glm4"


def test_unknown_pretokenizer_needs_override(mini_model, tmp_path):
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(mini_model / f, tmp_path / f)
    tj = json.loads((tmp_path / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\p{N}{1,3}| ?\p{L}+|\s+"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    h_new = probe_hash(_load_tokenizer(tmp_path))
    assert h_new != probe_hash(_load_tokenizer(mini_model))  # the probe sees the different split
    with pytest.raises(InputError, match="tokenizer-pre"):
        tokenizer_metadata(tmp_path, 8192)
    assert tokenizer_metadata(tmp_path, 8192, tokenizer_pre="glm4").pre == "glm4"


def test_vocab_larger_than_embedding_is_an_error(mini_model):
    with pytest.raises(InputError, match="embedding rows"):
        tokenizer_metadata(mini_model, 4096)
