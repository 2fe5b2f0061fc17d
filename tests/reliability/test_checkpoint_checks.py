"""Broken checkpoints are refused before any output: exit 2, one line naming the file/tensor/key, nothing at OUT.

Copies of the trained fixtures (glm5next-mini, glm5next-k256-fp8) are corrupted in a temporary directory, one
way per case: tensors missing, misshapen or of an integer dtype, a config that disagrees with the weights,
overlapping or aliased data_offsets, NaN/Inf in any tensor, negative imatrix values, a bad eval reference.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from mixq.cli import main

from cli_helpers import copy_model

L = "model.language_model.layers"
EMBED = "model.language_model.embed_tokens.weight"
NORM = "model.language_model.norm.weight"
INDEX = "model.safetensors.index.json"


# --- corrupting a copy ------------------------------------------------------------------------------------
def _edit_tensors(d: Path, fn) -> None:
    """fn(name -> tensor dict of one file) edits it in place; the file and the index's weight_map follow."""
    index = json.loads((d / INDEX).read_text())
    for f in sorted(d.glob("*.safetensors")):
        sd = load_file(f)
        before = set(sd)
        fn(sd)
        save_file({k: v.contiguous() for k, v in sd.items()}, f, metadata={"format": "pt"})
        for k in before - set(sd):
            index["weight_map"].pop(k, None)
        for k in set(sd) - before:
            index["weight_map"][k] = f.name
    (d / INDEX).write_text(json.dumps(index))


def _set(name: str, fn):
    """An edit that replaces tensor `name` (wherever it is) by fn(tensor)."""
    def edit(sd):
        if name in sd:
            sd[name] = fn(sd[name])
    return edit


def _drop(name: str):
    return lambda sd: sd.pop(name, None)


def _edit_config(d: Path, **text) -> None:
    c = json.loads((d / "config.json").read_text())
    c["text_config"].update(text)
    (d / "config.json").write_text(json.dumps(c))


def _edit_index(d: Path, fn) -> None:
    index = json.loads((d / INDEX).read_text())
    fn(index["weight_map"])
    (d / INDEX).write_text(json.dumps(index))


def _edit_header(f: Path, fn) -> None:
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    fn(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    f.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def _without_nextn(d: Path) -> None:
    """A valid checkpoint without the NextN block (its file, its index entries and its config key gone)."""
    (d / "model-mtp.safetensors").unlink()
    _edit_index(d, lambda wm: [wm.pop(k) for k in [k for k, f in wm.items() if f == "model-mtp.safetensors"]])
    _edit_config(d, num_nextn_predict_layers=0)


def _more_layers(d: Path) -> None:
    _without_nextn(d)
    _edit_config(d, num_hidden_layers=6, first_k_dense_replace=1, indexer_types=["full"] * 6,
                 layer_types=["linear_attention"] * 3 + ["deepseek_sparse_attention"] + ["linear_attention"] * 2,
                 mlp_layer_types=["dense"] + ["sparse"] * 5)


def _alias(h):  # the second norm's data_offsets point at the first one's bytes
    a, b = h[f"{L}.0.input_layernorm.weight"], h[f"{L}.0.post_attention_layernorm.weight"]
    b["data_offsets"] = list(a["data_offsets"])


def _overlap(h):  # a tensor starts 2 bytes inside its predecessor
    names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
    b = h[names[5]]
    b["data_offsets"] = [b["data_offsets"][0] - 2, b["data_offsets"][1] - 2]


# (case, model, corrupt(dir), fragment the error line must contain)
STRUCTURE = [
    ("missing_norm", "mini", lambda d: _edit_tensors(d, _drop(NORM)), NORM),
    ("missing_attn_linear", "mini", lambda d: _edit_tensors(d, _drop(f"{L}.3.self_attn.q_b_proj.weight")),
     f"{L}.3.self_attn.q_b_proj.weight"),
    ("missing_hc", "mini", lambda d: _edit_tensors(d, _drop(f"{L}.2.hc_ffn_fn")), f"{L}.2.hc_ffn_fn"),
    ("absent_from_weight_map_only", "mini",
     lambda d: _edit_index(d, lambda wm: wm.pop(f"{L}.0.self_attn.o_proj.weight")), "weight_map"),
    ("half_rows", "mini", lambda d: _edit_tensors(d, _set(f"{L}.1.mlp.shared_experts.up_proj.weight",
                                                         lambda t: t[: t.shape[0] // 2])),
     f"{L}.1.mlp.shared_experts.up_proj.weight"),
    ("transposed", "mini", lambda d: _edit_tensors(d, _set(f"{L}.0.mlp.gate_proj.weight", lambda t: t.t())),
     f"{L}.0.mlp.gate_proj.weight"),
    ("flattened_1d", "mini", lambda d: _edit_tensors(d, _set(f"{L}.3.self_attn.kv_a_proj_with_mqa.weight",
                                                            lambda t: t.reshape(-1))),
     f"{L}.3.self_attn.kv_a_proj_with_mqa.weight"),
    ("lm_head_rows", "mini", lambda d: _edit_tensors(d, _set("lm_head.weight", lambda t: t[:8000])),
     "lm_head.weight"),
    ("int32_weight", "mini", lambda d: _edit_tensors(d, _set(f"{L}.1.mlp.gate.weight", lambda t: t.to(torch.int32))),
     "int32"),
    ("extra_expert", "mini", lambda d: _edit_tensors(d, lambda sd: sd.__setitem__(
        f"{L}.1.mlp.experts.16.up_proj.weight", sd[f"{L}.1.mlp.experts.15.up_proj.weight"].clone())
        if f"{L}.1.mlp.experts.15.up_proj.weight" in sd else None), f"{L}.1.mlp.experts.16.up_proj.weight"),
    ("config_hidden_size", "mini", lambda d: _edit_config(d, hidden_size=256), "hidden_size"),
    ("config_n_routed_experts", "mini", lambda d: _edit_config(d, n_routed_experts=8), "n_routed_experts"),
    ("config_vocab_size", "mini", lambda d: _edit_config(d, vocab_size=9000), "vocab_size"),
    ("config_more_layers_than_weights", "mini", _more_layers, "num_hidden_layers is 6"),
    ("nextn_block_missing", "mini", lambda d: ((d / "model-mtp.safetensors").unlink(), _edit_index(
        d, lambda wm: [wm.pop(k) for k in [k for k, f in wm.items() if f == "model-mtp.safetensors"]])),
     "num_nextn_predict_layers"),
    ("aliased_data_offsets", "mini", lambda d: _edit_header(d / "model.safetensors", _alias), "model.safetensors"),
    ("overlapping_data_offsets", "mini", lambda d: _edit_header(d / "model.safetensors", _overlap),
     "model.safetensors"),
    ("fp8_scale_shape", "fp8", lambda d: _edit_tensors(d, _set(f"{L}.1.mlp.experts.0.up_proj.weight_scale_inv",
                                                              lambda t: t[:, :1])),
     f"{L}.1.mlp.experts.0.up_proj.weight_scale_inv"),
]


@pytest.fixture
def models(mini_model, k256_fp8_model):
    return {"mini": mini_model, "fp8": k256_fp8_model}


def _run(*args) -> tuple[int, list[str], str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("mixq: error")]
    return r.exit_code, errors, r.stderr


def _assert_refused(code, errors, stderr, fragment, out: Path):
    assert code == 2, stderr[-2000:]
    assert len(errors) == 1 and fragment in errors[0], errors
    assert "Traceback" not in stderr
    assert not out.exists(), f"{out} was written"


# --- structure: every command refuses before writing --------------------------------------------------------
COMMANDS = {
    "gguf": lambda m, out: ("convert", m, out, "--format", "gguf", "--type", "Q8_0", "--threads", "1"),
    "exl3": lambda m, out: ("convert", m, out, "--format", "exl3", "--bpw", "3", "--device", "cpu"),
}


@pytest.mark.parametrize("fmt", sorted(COMMANDS))
@pytest.mark.parametrize("case,model,corrupt,fragment", STRUCTURE, ids=[c[0] for c in STRUCTURE])
def test_broken_checkpoint_is_refused_before_any_output(case, model, corrupt, fragment, fmt, models, tmp_path):
    d = copy_model(models[model], tmp_path / case)
    corrupt(d)
    out = tmp_path / ("o.gguf" if fmt == "gguf" else "o-exl3")
    code, errors, stderr = _run(*COMMANDS[fmt](d, out))
    _assert_refused(code, errors, stderr, fragment, out)
    assert str(d) in errors[0] or fragment in errors[0]


def test_imatrix_and_eval_refuse_a_config_that_disagrees(mini_model, calibration_text, heldout_text, tmp_path):
    d = copy_model(mini_model, tmp_path / "cfg")
    _edit_config(d, n_routed_experts=8)
    out = tmp_path / "o.imatrix.gguf"
    _assert_refused(*_run("imatrix", d, out, "--calibration", calibration_text, "--rows", "2", "--seq-len", "32",
                          "--device", "cpu"), "n_routed_experts", out)
    rep = tmp_path / "report.json"
    code, errors, stderr = _run("eval", d, mini_model, "--text", heldout_text, "--ctx", "64", "--windows", "1",
                                "--json", rep)
    _assert_refused(code, errors, stderr, "n_routed_experts", rep)
    assert f"{d}/config.json" in errors[0]  # the reference's file, not the candidate's


# --- NaN / Inf in any tensor --------------------------------------------------------------------------------
def _poison(name: str, value: float, at: int = 3):
    def fn(t):
        t = t.clone()
        t.view(-1)[min(at, t.numel() - 1)] = value
        return t
    return _set(name, fn)


NON_FINITE = [
    ("nan_embedding", "mini", EMBED, float("nan")),
    ("inf_final_norm", "mini", NORM, float("inf")),
    ("neg_inf_layer_norm", "mini", f"{L}.2.input_layernorm.weight", float("-inf")),
    ("nan_hc", "mini", f"{L}.1.hc_attn_base", float("nan")),
    ("nan_expert_5", "mini", f"{L}.2.mlp.experts.5.down_proj.weight", float("nan")),
    ("nan_fp8_scale", "fp8", f"{L}.0.self_attn.k_proj.weight_scale_inv", float("nan")),
    ("nan_fp8_weight", "fp8", f"{L}.0.self_attn.k_proj.weight", float("nan")),
]


@pytest.mark.parametrize("fmt", sorted(COMMANDS))
@pytest.mark.parametrize("case,model,name,value", NON_FINITE, ids=[c[0] for c in NON_FINITE])
def test_non_finite_tensor_is_refused_naming_it(case, model, name, value, fmt, models, tmp_path):
    d = copy_model(models[model], tmp_path / case)
    _edit_tensors(d, _poison(name, value))
    out = tmp_path / ("o.gguf" if fmt == "gguf" else "o-exl3")
    code, errors, stderr = _run(*COMMANDS[fmt](d, out))
    _assert_refused(code, errors, stderr, f"'{name}'", out)
    assert ("NaN" if value != value else "Inf") in errors[0]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".o")]  # no partial left either


def test_nan_in_a_vision_weight_is_refused_before_the_model_gguf(mini_model, tmp_path):
    """The projector is written after the model: with --mmproj its weights are checked before either."""
    name = "model.visual.blocks.0.attn.qkv.weight"
    d = copy_model(mini_model, tmp_path / "vis")
    _edit_tensors(d, _poison(name, float("nan")))
    out, mm = tmp_path / "o.gguf", tmp_path / "o-mmproj.gguf"
    code, errors, stderr = _run("convert", d, out, "--format", "gguf", "--type", "Q8_0", "--threads", "1",
                                "--mmproj", mm)
    _assert_refused(code, errors, stderr, f"'{name}'", out)
    assert not mm.exists()


# --- imatrix values -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("what,value", [("sum", -1.0), ("sum", float("nan")), ("count", -4.0),
                                        ("count", float("inf"))])
def test_corrupt_imatrix_values_are_refused(what, value, mini_model, tmp_path):
    from mixq.formats.gguf_names import gguf_tensors
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.imatrix_file import IMatrix, write_imatrix

    im = IMatrix(datasets=["synthetic"], chunk_count=1, chunk_size=8)
    specs = [s for s in gguf_tensors(open_checkpoint(mini_model)) if len(s.shape) >= 2 and s.policy == "quant"]
    for s in specs:
        n_mat = s.shape[0] if len(s.shape) == 3 else 1
        im.add(s.name, np.ones((n_mat, s.shape[-1])), np.full(n_mat, 8.0))
    victim = specs[len(specs) // 2].name
    if what == "sum":
        im.sums[victim][0, 7] = value
    else:
        im.counts[victim][0] = value
    f = write_imatrix(tmp_path / "bad.imatrix.gguf", im)
    out = tmp_path / "o.gguf"
    code, errors, stderr = _run("convert", mini_model, out, "--format", "gguf", "--type", "Q4_K_M", "--imatrix", f,
                                "--threads", "1")
    _assert_refused(code, errors, stderr, victim, out)
    assert str(f) in errors[0]


# --- the library calls ----------------------------------------------------------------------------------------
def test_sound_fixtures_have_no_problems(mini_model, k256_model, k256_fp8_model, tiny_model):
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.checkpoint_check import checkpoint_problems, expected_shapes

    for m in (mini_model, k256_model, k256_fp8_model, tiny_model):
        ck = open_checkpoint(m)
        assert checkpoint_problems(ck) == [], m
        assert set(expected_shapes(ck)) == set(ck.names())


def test_text_only_checkpoint_is_sound_and_a_partial_vision_tower_is_not(mini_model, tmp_path):
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.checkpoint_check import checkpoint_problems

    d = copy_model(mini_model, tmp_path / "text")
    _edit_tensors(d, lambda sd: [sd.pop(k) for k in [k for k in sd if "visual." in k]])
    assert checkpoint_problems(open_checkpoint(d)) == []
    d2 = copy_model(mini_model, tmp_path / "partial")
    _edit_tensors(d2, _drop("model.visual.merger.proj.weight"))
    probs = checkpoint_problems(open_checkpoint(d2))
    assert len(probs) == 1 and "model.visual.merger.proj.weight" in probs[0][1] and "missing" in probs[0][1]


def test_scan_finite_reads_every_byte_once(k256_fp8_model):
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.checkpoint_check import scan_finite

    ck = open_checkpoint(k256_fp8_model)
    assert scan_finite(ck, progress=False) == sum(ck.nbytes(n) for n in ck.names())
