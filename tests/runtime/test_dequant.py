"""runtime/dequant.py: per-layer dequantized weights of HF, GGUF and EXL3 models equal the whole-file readers."""
from __future__ import annotations

import pytest
import torch

from mixq.runtime.dequant import dequantize_unit, open_dequant, read_exl3
from mixq.errors import InputError
from mixq.formats.glm5next import classify


def _assembled(src, n_layers: int) -> dict[str, torch.Tensor]:
    """Every trunk-layer tensor through layer(i) plus every other text tensor through get(name)."""
    out: dict[str, torch.Tensor] = {}
    for i in range(n_layers):
        got = src.layer(i)
        assert got and all(classify(n, n_layers).layer == i for n in got)
        out.update(got)
    for n in src.shapes():
        info = classify(n, n_layers)
        if info.layer is None and info.role != "vision":
            out[n] = src.get(n)
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for n in a:
        assert a[n].dtype == torch.float32 and torch.equal(a[n], b[n]), n


def _text_only(w: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    return {n: t for n, t in w.items() if not classify(n, n_layers).mtp and classify(n, n_layers).role != "vision"}


def test_hf_source_is_the_checkpoint(k256_fp8_model):
    from mixq.formats.checkpoint import open_checkpoint

    ck = open_checkpoint(k256_fp8_model)
    src = open_dequant(k256_fp8_model, "hf")
    n = ck.num_hidden_layers
    assert src.shapes() == {x: tuple(ck.shape(x)) for x in ck.names()}
    _same(_assembled(src, n), {x: ck.get(x) for x in ck.names() if not ck.info(x).mtp and ck.info(x).role != "vision"})
    with pytest.raises(InputError, match="no tensor"):
        src.get("model.language_model.layers.0.mlp.gate.weight.bogus")


def test_gguf_source_equals_read_gguf_weights(tiny_gguf):
    from mixq.formats.gguf_reader import read_gguf_weights

    g = tiny_gguf
    whole = read_gguf_weights(g)
    src = open_dequant(g, "gguf", num_hidden_layers=4)
    assert src.shapes() == {n: tuple(t.shape) for n, t in whole.items()}  # shapes without decoding
    _same(_assembled(src, 4), _text_only(whole, 4))
    with pytest.raises(InputError, match="num_hidden_layers"):
        open_dequant(g, "gguf")


def test_exl3_source_equals_read_exl3(tiny_exl3_cheap):
    from mixq.formats.exl3_reader import Exl3Dir

    whole = read_exl3(tiny_exl3_cheap)
    src = open_dequant(tiny_exl3_cheap, "exl3")
    assert src.shapes() == {n: tuple(t.shape) for n, t in whole.items()}
    _same(_assembled(src, 4), _text_only(whole, 4))
    d = Exl3Dir(tiny_exl3_cheap)
    u = next(u for u in d.units if u.kind == "trellis")
    w = dequantize_unit(d, u)
    assert tuple(w.shape) == u.shape and bool(torch.isfinite(w).all()) and float(w.abs().max()) > 0


def test_exl3_decode_check_matches_verify(tiny_exl3_cheap, tmp_path):
    """The decode check `mixq verify` runs from convert (formats do not import quant): every trellis unit decoded,
    and a unit whose scales are not finite is named."""
    import shutil

    from mixq.conversion.api import verify
    from mixq.runtime.dequant import exl3_decode_check
    from mixq.formats.exl3_reader import Exl3Dir, verify_exl3

    n, problems = exl3_decode_check(tiny_exl3_cheap)
    trellis_units = sum(u.kind == "trellis" for u in Exl3Dir(tiny_exl3_cheap).units)
    assert verify_exl3(tiny_exl3_cheap)["ok"] and problems == []
    assert n == verify(tiny_exl3_cheap)["quantized"] == trellis_units > 0
    bad = tmp_path / "bad"
    shutil.copytree(tiny_exl3_cheap, bad)
    d = Exl3Dir(bad)
    u = next(u for u in d.units if u.kind == "trellis")
    from safetensors.torch import load_file, save_file

    shard = bad / d.where[f"{u.key}.suh"]
    t = load_file(str(shard))
    t[f"{u.key}.suh"] = torch.full_like(t[f"{u.key}.suh"], float("inf"))
    save_file(t, str(shard), metadata={"format": "pt"})
    n2, problems2 = exl3_decode_check(bad)
    assert n2 == n and problems2 == [f"{u.key}: decodes to non-finite values"]
