"""convert_gguf through the CLI: llama-quantize-style overrides, shape fallback, shards, verify, bad input."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mixq.cli import main
from mixq.conversion.gguf.pipeline import parse_size
from mixq.planning.gguf_rules import fallback_type
from mixq.errors import InputError
from mixq.formats.gguf_reader import read_gguf


def test_fallback_and_sizes():
    # llama-quantize's fallback for rows that are not a multiple of 256 (gguf-glm5-next.md §3.4)
    assert fallback_type("Q4_K", 128) == "Q5_0" and fallback_type("Q6_K", 384) == "Q8_0"
    assert fallback_type("Q2_K", 64) == "Q4_0" and fallback_type("Q4_K", 512) == "Q4_K"
    assert fallback_type("Q8_0", 48) == "F16"
    assert parse_size("2M") == 2_000_000 and parse_size("1GiB") == 2**30 and parse_size(5) == 5
    with pytest.raises(InputError):
        parse_size("lots")


def test_cli_convert_overrides_shards_verify(mini_model, tmp_path):
    out = tmp_path / "m.gguf"
    args = ["convert", str(mini_model), str(out), "--format", "gguf", "--type", "Q8_0", "--no-mtp",
            "--tensor-type", r"ffn_(up|gate)_exps=Q4_0", "--tensor-type", r"ssm_f_a|ffn_down_shexp=Q4_0",
            "--token-embedding-type", "Q4_0", "--output-tensor-type", "Q6_K", "--shard-size", "2M", "--json"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    files = summary["files"]
    assert len(files) >= 2 and files[0].endswith(f"-00001-of-0000{len(files)}.gguf")
    g = read_gguf(files[0])
    t = {n: e.qtype for n, e in g.tensors.items()}
    assert t["blk.1.ffn_up_exps.weight"] == "Q4_0" and t["blk.1.ffn_down_exps.weight"] == "Q8_0"
    assert t["token_embd.weight"] == "Q4_0"
    assert t["output.weight"] == "Q8_0"  # Q6_K needs rows of 256: falls back as llama-quantize does
    assert t["blk.1.ffn_down_shexp.weight"] == "Q4_0"
    assert t["blk.0.ssm_f_a.weight"] == "BF16"  # glm5-next exclusion: never quantized, even when a regex matches
    assert t["blk.0.attn_norm.weight"] == "F32"
    res = CliRunner().invoke(main, ["verify", files[0]])
    assert res.exit_code == 0 and "OK" in res.output


def test_cli_bad_input_is_one_line(mini_model, tmp_path):
    res = CliRunner().invoke(main, ["convert", str(mini_model), str(tmp_path / "x.gguf"), "--format", "gguf",
                                    "--type", "Q8_0", "--tensor-type", "no-equals-sign"])
    assert res.exit_code == 2 and "REGEX=TYPE" in res.output
    assert not list(tmp_path.iterdir())  # nothing half-written
    res = CliRunner().invoke(main, ["verify", str(tmp_path / "missing.gguf")])
    assert res.exit_code == 2


def test_non_finite_weight_is_one_line_naming_the_tensor(tiny_model, tmp_path):
    """A NaN in a quantized weight must stop the conversion with the tensor's name, not fall back silently."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "nan-model"
    shutil.copytree(tiny_model, src)
    shard = next(p for p in sorted(src.glob("*.safetensors")) if "mtp" not in p.name)
    sd = load_file(shard)
    name = next(n for n in sd if n.endswith("mlp.experts.0.up_proj.weight") or n.endswith("q_proj.weight"))
    sd[name] = sd[name].clone()
    sd[name].view(-1)[3] = float("nan")
    save_file(sd, shard, metadata={"format": "pt"})
    out = tmp_path / "o.gguf"
    r = CliRunner().invoke(main, ["convert", str(src), str(out), "--format", "gguf", "--type", "Q8_0"])
    assert r.exit_code == 2, r.output
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("mixq: error")]  # the rest is the progress bar
    assert len(err) == 1 and name in err[0] and "NaN" in err[0] and "Traceback" not in r.stderr
    assert not out.exists()


def test_typed_api_file_types_are_the_plans_with_overrides(tiny_model, tmp_path):
    """`mixq.convert(model, out, GGUFOptions(...))`: --override steers a GGUF mix exactly as `mixq plan` shows it
    (it used to be dropped), and the result is the one ConvertResult type."""
    import mixq
    from mixq.planning.planner import plan_model

    opts = mixq.GGUFOptions(qtype="Q4_K_M", overrides=("routed_expert=Q8_0",), threads=1, progress=False)
    res = mixq.convert(tiny_model, tmp_path / "m.gguf", opts)
    assert isinstance(res, mixq.ConvertResult) and res.format == "gguf" and res.files == [str(tmp_path / "m.gguf")]
    got = {n: e.qtype for n, e in read_gguf(res.files[0]).tensors.items()}
    want = {t.name: t.type for t in plan_model(tiny_model, "gguf", qtype="Q4_K_M", overrides=["routed_expert=Q8_0"]).tensors}
    assert got == want and got["blk.1.ffn_up_exps.weight"] == "Q8_0"
    assert res.types == {t: list(got.values()).count(t) for t in set(got.values())}
    assert res.to_dict()["types"] == res.types and "bits" not in res.to_dict()
