"""DFlash2 drafter: the layout table and release-layout writer (formats/dflash2.py) and its EXL3 conversion
(conversion/exl3/drafter.py): stored tensors, padding and dtypes as reference §6.3 lays them out, read back, bad input.

The default-suite conversions swap the trellis encoder for a shape-exact stand-in (the encoder has its own tests in
tests/quant; a real-trellis drafter conversion is the slow test at the end), so what is checked here is the layout.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli_helpers import run_cli as _cli
from mixq.formats.dflash2 import (LAYOUT, DrafterDims, drafter_config, drafter_shapes, random_weights, write_drafter,
                                  write_tiny_drafter)

SMALL = dict(layers=1, intermediate_size=256, selector_rank=32)  # hidden 128 from SMALL_TARGET
SMALL_TARGET = {"text_config": {"hidden_size": 128, "vocab_size": 512, "num_hidden_layers": 4,
                                "intermediate_size": 256, "rms_norm_eps": 1e-5}}


class _StandIn:
    """A quantized Linear with the real stored shapes (trellis (k/16, n/16, 16·K) int16, suh/svh, mul1)."""

    def __init__(self, w: torch.Tensor, bits: float) -> None:
        self.shape = tuple(w.shape)
        out_f, in_f = self.shape
        self.k, self.n, self.bits = -(-in_f // 128) * 128, -(-out_f // 128) * 128, bits

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"trellis": torch.zeros(self.k // 16, self.n // 16, int(16 * self.bits), dtype=torch.int16),
                "suh": torch.ones(self.k, dtype=torch.float16), "svh": torch.ones(self.n, dtype=torch.float16),
                "mul1": torch.tensor(0x83DCD12D - (1 << 32), dtype=torch.int32)}

    def dequantize(self) -> torch.Tensor:
        return torch.zeros(self.shape)


@pytest.fixture
def stand_in_trellis(monkeypatch):
    import mixq.quant.trellis as trellis

    def quantize(weight, bits, hessian=None, codebook="mul1", seed=0):
        if weight.dim() == 3:
            return [_StandIn(w, bits) for w in weight]
        return _StandIn(weight, bits)

    monkeypatch.setattr(trellis, "quantize", quantize)


def _header(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {n: [f.get_slice(n).get_dtype(), list(f.get_slice(n).get_shape())] for n in f.offset_keys()}


def test_drafter_for_k256_has_the_release_layout(k256_model, tmp_path):
    """A drafter built for glm5next-k256: exllamav3's config keys, every table tensor in BF16 at its shape."""
    d = write_tiny_drafter(tmp_path / "drafter", k256_model, layers=2)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["block_size"] == 8
    assert cfg["hidden_size"] == 256 and cfg["vocab_size"] == 8192 and cfg["hidden_act"] == "silu"
    dc = cfg["dflash_config"]
    assert dc["target_layer_ids"] == [1, 2] and dc["mask_token_id"] == 1  # [gMASK] in the fixtures' tokenizer
    assert dc["selector_top_k"] in (8, 16, 32)  # the top-k widths exllamav3's CUDA selector kernel takes
    hdr = _header(d / "model.safetensors")
    shapes = drafter_shapes(cfg)
    assert len(shapes) == 6 + 15 * 2 and set(hdr) == set(shapes)
    assert all(dt == "BF16" and tuple(s) == shapes[n] for n, (dt, s) in hdr.items())
    assert shapes["fc.weight"] == (256, 512)  # hidden x (hidden · taps)
    assert shapes["layers.1.mlp_conv.kernel_projection.weight"] == (2 * 2 * 256 // 16, 256)
    assert shapes["layers.0.attention_conv.base_kernel"] == (2, 2, 256)
    assert shapes["candidate_selector.successor_codebook"] == (8192, 32)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (2 * 64, 256)  # GQA: 4 query heads, 2 KV heads
    w = random_weights(cfg)
    assert torch.equal(w["layers.0.mlp_conv.base_kernel"][:, 0], torch.ones(2, 256))  # identity tap 0
    assert w["layers.0.mlp_conv.base_kernel"][:, 1].abs().max() == 0
    assert 0.015 < w["fc.weight"].std() < 0.025


def test_dims_read_dflash_keys_at_either_level():
    cfg = drafter_config(SMALL_TARGET["text_config"], **SMALL)
    flat = {**{k: v for k, v in cfg.items() if k != "dflash_config"}, **cfg["dflash_config"]}
    assert DrafterDims.from_config(flat) == DrafterDims.from_config(cfg)
    assert DrafterDims.from_config(cfg).taps == 2 and DrafterDims.from_config(cfg).group == 16


def test_drafter_at_6_bpw_layout(stand_in_trellis, tmp_path):
    from mixq.conversion.api import verify
    from mixq.formats.exl3_reader import Exl3Dir

    src = write_tiny_drafter(tmp_path / "drafter", SMALL_TARGET, **SMALL)
    out = tmp_path / "drafter-exl3"
    r = _cli("convert", src, out, "--format", "exl3", "--bpw", "6", "--device", "cpu", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["bits"] == 6.0 and res["quantized"] == 1 + 4 + 3 + 2
    rep = verify(out, decode=False)
    assert rep["ok"], rep["problems"]
    hdr = _header(out / "model.safetensors")
    assert hdr["fc.trellis"] == ["I16", [256 // 16, 128 // 16, 96]]  # (in/16, out/16, 16·6), not padded
    assert hdr["layers.0.attention_conv.kernel_projection.trellis"] == ["I16", [8, 8, 96]]  # out 32 -> 128
    assert hdr["layers.0.self_attn.k_proj.trellis"] == ["I16", [8, 8, 96]]
    assert hdr["candidate_selector.hidden_projection.weight"] == ["F16", [128, 128]]  # (32, 128) padded
    assert hdr["candidate_selector.predecessor_codebook"] == ["BF16", [512, 32]]
    assert hdr["layers.0.mlp_conv.base_kernel"] == ["BF16", [2, 2, 128]]
    assert hdr["hidden_norm.weight"] == ["BF16", [128]]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["target_layer_ids"] == [1, 2]
    assert cfg["quantization_config"]["bits"] == 6.0
    storage = json.loads((out / "quantization_config.json").read_text())["tensor_storage"]
    assert storage["fc"]["quant_format"] == "exl3" and storage["fc"]["bits_per_weight"] == 6
    stored = Exl3Dir(out)
    from safetensors.torch import load_file

    srcw = load_file(str(src / "model.safetensors"))
    hp = stored.tensor("candidate_selector.hidden_projection.weight")
    assert torch.equal(hp[:32, :128], srcw["candidate_selector.hidden_projection.weight"].half())
    assert hp[32:].abs().max() == 0
    assert torch.equal(stored.tensor("candidate_selector.successor_codebook"),
                       srcw["candidate_selector.successor_codebook"])


def test_fp32_source_and_codebook_alias(stand_in_trellis, tmp_path):
    """fp32 raw tensors are stored fp16; codebooks spelled `<name>.weight` are stored under the bare key."""
    cfg = drafter_config(SMALL_TARGET["text_config"], **SMALL)
    w = random_weights(cfg, seed=3)
    src = write_drafter(tmp_path / "d", cfg, w)
    from safetensors.torch import load_file, save_file

    t = load_file(str(src / "model.safetensors"))
    t["candidate_selector.predecessor_codebook.weight"] = t.pop("candidate_selector.predecessor_codebook")
    t["norm.weight"] = t["norm.weight"].float()
    save_file(t, str(src / "model.safetensors"))
    out = tmp_path / "o"
    assert _cli("convert", src, out, "--format", "exl3", "--device", "cpu").exit_code == 0
    hdr = _header(out / "model.safetensors")
    assert hdr["candidate_selector.predecessor_codebook"][0] == "BF16"
    assert "candidate_selector.predecessor_codebook.weight" not in hdr
    assert hdr["norm.weight"] == ["F16", [128]]


def _bad(tmp_path: Path, name: str, edit) -> tuple[Path, Path]:
    src = write_tiny_drafter(tmp_path / name, SMALL_TARGET, **SMALL)
    edit(src)
    return src, tmp_path / f"{name}-out"


def _edit_tensors(fn):
    def edit(src: Path) -> None:
        from safetensors.torch import load_file, save_file

        t = load_file(str(src / "model.safetensors"))
        fn(t)
        save_file(t, str(src / "model.safetensors"))
    return edit


def _edit_config(fn):
    def edit(src: Path) -> None:
        cfg = json.loads((src / "config.json").read_text())
        fn(cfg)
        (src / "config.json").write_text(json.dumps(cfg))
    return edit


BAD = [
    ("unknown", _edit_tensors(lambda t: t.update({"layers.0.mlp.extra.weight": torch.zeros(2, 2)})),
     "'layers.0.mlp.extra.weight': unknown DFlash2 drafter tensor name"),
    ("shape", _edit_tensors(lambda t: t.update({"layers.0.self_attn.q_proj.weight": torch.zeros(64, 128)})),
     "'layers.0.self_attn.q_proj.weight' has shape (64, 128), the config implies (128, 128)"),
    ("missing", _edit_tensors(lambda t: t.pop("layers.0.mlp_conv.base_kernel")),
     "'layers.0.mlp_conv.base_kernel' is missing"),
    ("layer", _edit_tensors(lambda t: t.update({"layers.3.input_layernorm.weight": torch.ones(128)})),
     "is in layer 3, the config has 1 layers"),
    ("garbage", lambda src: (src / "model.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"{not json}"),
     "model.safetensors: not a readable safetensors file"),
    ("config", _edit_config(lambda c: c["dflash_config"].pop("selector_rank")), "missing 'selector_rank'"),
    ("group", _edit_config(lambda c: c["dflash_config"].update(conv_group_size=48)),
     "hidden_size 128 is not a multiple of conv_group_size 48"),
]


@pytest.mark.parametrize("name,edit,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_drafter_is_one_line_and_writes_nothing(tmp_path, name, edit, needle):
    src, out = _bad(tmp_path, name, edit)
    r = _cli("convert", src, out, "--format", "exl3", "--device", "cpu")
    assert r.exit_code == 2, r.output
    assert needle in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.output and not out.exists()


def test_bad_rate_is_refused_before_writing(tmp_path):
    src = write_tiny_drafter(tmp_path / "d", SMALL_TARGET, **SMALL)
    r = _cli("convert", src, tmp_path / "o", "--format", "exl3", "--bpw", "12", "--device", "cpu")
    assert r.exit_code == 2 and "trellis bits must be 1..8" in r.stderr
    assert not (tmp_path / "o").exists()


def test_writer_refuses_wrong_weights(tmp_path):
    from mixq.errors import InputError

    cfg = drafter_config(SMALL_TARGET["text_config"], **SMALL)
    w = random_weights(cfg)
    w["norm.weight"] = torch.ones(3)
    with pytest.raises(InputError, match="'norm.weight' has shape"):
        write_drafter(tmp_path / "d", cfg, w)
    assert not (tmp_path / "d").exists() and not list(tmp_path.iterdir())
    with pytest.raises(InputError, match="target_layer_ids"):
        drafter_config(SMALL_TARGET["text_config"], target_layer_ids=[1, 4])


def test_layout_table_names_are_unique_and_cover_exl3_kinds():
    assert len({t.name for t in LAYOUT}) == len(LAYOUT)
    assert {t.exl3 for t in LAYOUT} == {"trellis", "trellis_unpadded", "fp16_linear", "raw"}


@pytest.mark.slow
def test_drafter_at_6_bpw_real_trellis_round_trip(tmp_path):
    """The real encoder at 6 bpw: every Linear decodes back within the trellis's error at K=6, raw tensors exact."""
    from safetensors.torch import load_file

    from mixq.conversion.api import convert, verify
    from mixq.formats.dflash2 import lookup
    from mixq.runtime.dequant import read_exl3

    src = write_tiny_drafter(tmp_path / "d", SMALL_TARGET, **SMALL)
    out = tmp_path / "o"
    res = convert(src, out, "exl3", bpw=6, device="cpu", progress=False)
    assert res.bits == 6.0 and verify(out)["ok"]
    srcw = {n: t.float() for n, t in load_file(str(src / "model.safetensors")).items()}
    back = read_exl3(out)
    assert set(back) == set(srcw)
    for n, w in srcw.items():
        kind = lookup(n)[0].exl3
        if kind.startswith("trellis"):
            rel = ((back[n] - w).norm() / w.norm()).item()
            assert rel < 0.03, (n, rel)  # K=6: MSE ~ 1.2 · 2^-12 of the weight energy
        else:
            assert torch.equal(back[n].float(), w.half().float() if kind == "fp16_linear" else w), n
