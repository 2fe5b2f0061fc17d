"""The lazy loader: fixtures, FP8 dequantisation, configs, shapes-only checkpoints, bad input."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from mixq.errors import FormatError, InputError
from mixq.formats.checkpoint import checkpoint_from_config, dequant_fp8_blocks, open_checkpoint

L = "model.language_model.layers"


def test_mini_lazy_reads_match_safetensors(mini_model):
    ck = open_checkpoint(mini_model)
    assert len(ck.names()) == 354 and ck.params == 4_689_566
    assert ck.num_hidden_layers == 4 and ck.nextn_layers == [4]
    assert ck.layer_types == ["linear_attention"] * 3 + ["deepseek_sparse_attention"]
    assert ck.text_config["hidden_size"] == 128 and ck.config["vision_config"]["depth"] == 1
    name = f"{L}.4.eh_proj.weight"
    assert ck.shape(name) == (128, 256) and ck.source_dtype(name) == "bfloat16"
    assert ck.info(name).mtp and ck.info(name).role == "attn"
    with safe_open(str(mini_model / "model-mtp.safetensors"), "pt") as s:
        ref = s.get_tensor(name)
    got = ck.get(name, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref)
    assert torch.equal(ck.get(name), ref.float())
    with pytest.raises(InputError, match="no tensor"):
        ck.get("lm_head.bias")


def _assert_e4m3_close(bf16, fp8, names):
    """|W_fp8 - W| <= half an e4m3 ulp: 2^-4 relative for normals, 2^-10 * block scale for subnormals."""
    n = 0
    for name in names:
        if not fp8.is_fp8(name):
            assert torch.equal(fp8.get(name), bf16.get(name)), name
            continue
        n += 1
        x, y = bf16.get(name), fp8.get(name)
        s = x.abs().amax() / 448.0  # upper bound on any block's scale
        assert ((y - x).abs() <= x.abs() * 2**-4 + s * 2**-10 + 1e-12).all(), name
        assert (y - x).abs().max() > 0  # it really is FP8, not a copy
    return n


def _one_per_kind(names):
    """One tensor per name pattern (expert 0 of each layer only): every FP8 kind, a fraction of the bytes."""
    big = ("embed_tokens", "lm_head")  # 2M-element BF16 pass-through tensors; one small BF16 check suffices
    return [n for n in names if (".experts." not in n or ".experts.0." in n) and not any(b in n for b in big)]


def test_k256_fp8_dequantises_to_bf16_within_e4m3(k256_model, k256_fp8_model):
    a, b = open_checkpoint(k256_model), open_checkpoint(k256_fp8_model)
    assert sorted(a.names()) == sorted(b.names())
    assert len(b.names()) == 354 and b.params == a.params  # the 224 *_scale_inv are not tensors
    assert not any(n.endswith("_scale_inv") for n in b.names())
    assert sum(b.is_fp8(n) for n in b.names()) == 224
    assert b.source_dtype(f"{L}.2.mlp.experts.5.down_proj.weight") == "float8_e4m3fn"
    assert b.source_dtype(f"{L}.3.self_attn.kv_b_proj.weight") == "bfloat16"
    assert _assert_e4m3_close(a, b, _one_per_kind(b.names())) == 224 - 4 * 15 * 3


@pytest.mark.slow
def test_k256_fp8_every_tensor(k256_model, k256_fp8_model):
    a, b = open_checkpoint(k256_model), open_checkpoint(k256_fp8_model)
    assert _assert_e4m3_close(a, b, b.names()) == 224


def test_tiny_fp8_fixture_matches_tiny_bf16(tiny_model, tiny_fp8_model):
    a, b = open_checkpoint(tiny_model), open_checkpoint(tiny_fp8_model)
    assert (tiny_fp8_model / "model.safetensors.index.json").is_file()
    assert sorted(a.names()) == sorted(b.names()) and a.params == b.params
    assert b.config["quantization_config"]["weight_block_size"] == [128, 128]
    assert _assert_e4m3_close(a, b, b.names()) > 40


def test_get_as_stored_widens_to_the_same_values(tiny_model, tiny_fp8_model):
    """dtype=None: 16-bit weights come as stored and widen to get()'s float32 exactly; FP8 ones come dequantized."""
    a, b = open_checkpoint(tiny_model), open_checkpoint(tiny_fp8_model)
    name = next(n for n in b.names() if b.is_fp8(n))
    raw = a.get(name, dtype=None)
    assert raw.dtype == torch.bfloat16 and torch.equal(raw.float(), a.get(name))
    fp8 = b.get(name, dtype=None)
    assert fp8.dtype == torch.float32 and torch.equal(fp8, b.get(name))


def test_dequant_blocks_partial_tiles():
    w = torch.ones(130, 260).to(torch.float8_e4m3fn)
    s = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    d = dequant_fp8_blocks(w, s)
    assert d[0, 0] == 1 and d[0, 255] == 2 and d[0, 259] == 3 and d[129, 0] == 4 and d[129, 259] == 6
    with pytest.raises(FormatError, match="scale_inv shape"):
        dequant_fp8_blocks(w, s[:1])


def test_tiny_model_layout(tiny_model):
    ck = open_checkpoint(tiny_model)
    assert ck.text_config["n_routed_experts"] == 2 and ck.nextn_layers == [4]
    assert (tiny_model / "tokenizer.json").is_file() or True  # tokenizer copied when ../shared exists
    # every matmul the EXL3 trellis quantizes has widths that are multiples of 128
    for n in ck.names():
        if ck.info(n).exl3 == "trellis":
            assert all(d % 128 == 0 for d in ck.shape(n)), (n, ck.shape(n))
    # the NextN body is a copy of layer 3 (like glm5next-mini)
    assert torch.equal(ck.get(f"{L}.4.self_attn.kv_b_proj.weight"), ck.get(f"{L}.3.self_attn.kv_b_proj.weight"))


def test_flash_config_shapes_only(flash_config):
    ck = checkpoint_from_config(flash_config)
    assert ck.shapes_only and ck.num_hidden_layers == 45 and ck.nextn_layers == [45]
    assert len(ck.names()) == 38770
    assert ck.params == 321_219_495_262
    assert ck.shape(f"{L}.45.eh_proj.weight") == (4096, 8192)
    assert ck.shape(f"{L}.10.mlp.experts.287.down_proj.weight") == (4096, 2048)
    assert ck.shape(f"{L}.3.self_attn.kv_b_proj.weight") == (64 * 512, 512)
    assert ck.source_dtype("lm_head.weight") == "bfloat16"
    assert ck.info(f"{L}.45.mlp.experts.0.up_proj.weight").mtp
    assert not any(f"{L}.45.hc_" in n for n in ck.names())
    with pytest.raises(InputError, match="shapes-only"):
        ck.get("lm_head.weight")


def test_mini_config_shapes_equal_the_real_files(mini_model):
    real, meta = open_checkpoint(mini_model), checkpoint_from_config(mini_model / "config.json")
    assert {n: real.shape(n) for n in real.names()} == {n: meta.shape(n) for n in meta.names()}


# --- configs ----------------------------------------------------------------------------------------------
def _edit_config(d, fn):
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def test_flat_config_and_layer_type_spellings(tiny_model, tmp_path):
    d = tmp_path / "flat"
    d.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copyfile(tiny_model / f, d / f)

    def flatten(cfg):
        t = cfg.pop("text_config")
        t["layer_types"] = ["linear_attention"] * 3 + ["indexed_attention"]
        cfg.clear()
        cfg.update(t, model_type="glm5_next_text")
    _edit_config(d, flatten)
    ck = open_checkpoint(d)
    assert ck.layer_types[-1] == "deepseek_sparse_attention" and ck.text_config is ck.config
    _edit_config(d, lambda c: c.__setitem__("layer_types", ["linear_attention"] * 3 + ["full_attention"]))
    assert open_checkpoint(d).layer_types[-1] == "deepseek_sparse_attention"


# --- bad input: one InputError/FormatError naming the file or tensor ------------------------------------
def test_bad_input_raises_naming_file_or_tensor(bad_checkpoint):
    kind, path, fragment = bad_checkpoint
    with pytest.raises((InputError, FormatError)) as e:
        open_checkpoint(path)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(InputError, match="nobody-xyz/none-such-model.*Hugging Face hub"):
        open_checkpoint("nobody-xyz/none-such-model")


def test_flat_text_only_config_shapes(mini_model, tmp_path):
    cfg = json.loads((mini_model / "config.json").read_text())["text_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    meta, real = checkpoint_from_config(tmp_path / "config.json"), open_checkpoint(mini_model)
    assert {n: meta.shape(n) for n in meta.names()} == {n: real.shape(n) for n in real.names() if "visual." not in n}


def test_fp16_fp32_single_file(tiny_model, tmp_path):
    from safetensors.torch import save_file

    src = open_checkpoint(tiny_model)
    names = src.names()
    tensors = {n: src.get(n, torch.float16 if i % 2 else torch.float32) for i, n in enumerate(names)}
    d = tmp_path / "mixed"
    d.mkdir()
    shutil.copyfile(tiny_model / "config.json", d / "config.json")
    save_file(tensors, str(d / "model.safetensors"))
    ck = open_checkpoint(d)
    assert sorted(ck.names()) == sorted(names)
    assert {ck.source_dtype(n) for n in names} == {"float16", "float32"}
    for n in names[:20]:
        assert torch.equal(ck.get(n), tensors[n].float()), n
    assert ck.nbytes(names[0]) == 4 * src.numel(names[0]) and ck.nbytes(names[1]) == 2 * src.numel(names[1])
