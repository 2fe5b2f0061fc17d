"""llama-perplexity windows, NextN filtering and the model tokenizer."""
from __future__ import annotations

import pytest
import torch

from mixq.errors import InputError
from mixq.runtime.reference import drop_mtp, load_tokenizer, make_windows, tokenize_text


def test_windows_half_and_all():
    ids = list(range(1000))
    w = make_windows(ids, 128, None, "half")
    assert w.count == 7 and w.ctx == 128 and w.first == 64 and w.scored_per_window == 63
    assert torch.equal(w.tokens[1, :3], torch.tensor([128, 129, 130]))
    assert torch.equal(w.targets(1), torch.arange(128 + 65, 256))  # positions 64..126 predict 65..127
    a = make_windows(ids, 128, 2, "all")
    assert a.count == 2 and a.first == 0 and a.scored_per_window == 127 and len(a.targets(0)) == 127
    with pytest.raises(InputError, match="fewer than one window"):
        make_windows(ids[:100], 128, None, "half")
    with pytest.raises(InputError, match="--score"):
        make_windows(ids, 128, None, "first")
    with pytest.raises(InputError, match="--windows"):
        make_windows(ids, 128, 0, "half")


def test_drop_mtp_keeps_trunk_and_vision():
    w = {n: torch.zeros(1) for n in (
        "model.language_model.layers.3.mlp.gate.weight",
        "model.language_model.layers.4.eh_proj.weight",
        "model.language_model.layers.12.eh_proj.weight",
        "model.visual.blocks.7.attn.qkv.weight",
        "lm_head.weight",
    )}
    assert sorted(drop_mtp(w, 4)) == ["lm_head.weight", "model.language_model.layers.3.mlp.gate.weight",
                                      "model.visual.blocks.7.attn.qkv.weight"]


def test_prefix_tokenization_matches_full_text(mini_model, heldout_text, tmp_path):
    tok = load_tokenizer(mini_model)
    prefix = tokenize_text(tok, heldout_text, need_tokens=300)
    text = heldout_text.read_text(encoding="utf-8")[:30_000]
    full = tok(text, add_special_tokens=False)["input_ids"]
    assert len(prefix) >= 556 and prefix[:300] == full[:300]
    with pytest.raises(InputError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
