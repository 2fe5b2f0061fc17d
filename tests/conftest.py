"""Shared test fixtures: paths into ../shared (present locally and in CI)."""
from __future__ import annotations

import os

# Before torch loads its OpenMP runtime: its threads sleep between parallel regions instead of spinning. On a
# loaded machine (CI beside other jobs) spinning threads take the time slices the working one needs, and small-op
# tests ran many times slower (bench/results/omp_wait_policy_under_load.json); the numbers are the same.
if not os.environ.get("MIXQ_TEST_OMP_DEFAULT"):  # set by that bench to time the runtime's default beside it
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from cli_helpers import copy_model, run_cli
from triton_helpers import require, under_ci

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("MIXQ_SHARED", REPO.parent / "shared"))


def shared_path(*parts: str) -> Path:
    p = SHARED.joinpath(*parts)
    if not p.exists():
        if under_ci():  # CI has ../shared: a missing fixture there is a broken checkout, not a reason to skip
            pytest.fail(f"shared fixture missing under CI: {p} (set MIXQ_SHARED or put ../shared beside the repo)")
        pytest.skip(f"shared fixture missing: {p}")
    return p


@pytest.fixture
def needs_triton() -> None:
    """Triton importable: else a skip, or under CI a failure (tests/triton_helpers.py)."""
    require("triton")


@pytest.fixture(scope="session")
def mini_model() -> Path:
    return shared_path("models", "glm5next-mini")


@pytest.fixture(scope="session")
def k256_model() -> Path:
    return shared_path("models", "glm5next-k256")


@pytest.fixture(scope="session")
def k256_fp8_model() -> Path:
    return shared_path("models", "glm5next-k256-fp8")


@pytest.fixture(scope="session")
def mini_q8_converted(mini_model, tmp_path_factory) -> tuple[Path, dict]:
    """(path, the convert's --json report): `mixq convert glm5next-mini OUT.gguf --type Q8_0` (no --format: GGUF
    from the name), a sealed mixq file converted once for the session (tests copy it before editing)."""
    import json

    out = tmp_path_factory.mktemp("mini-q8") / "mini-Q8_0.gguf"
    r = run_cli("convert", mini_model, out, "--type", "Q8_0", "--threads", "1", "--json")
    assert r.exit_code == 0, r.output[-2000:]
    return out, json.loads(r.stdout)


@pytest.fixture(scope="session")
def mini_q8_gguf(mini_q8_converted) -> Path:
    """glm5next-mini as a sealed mixq Q8_0 GGUF (mini_q8_converted)."""
    return mini_q8_converted[0]


@pytest.fixture(scope="session")
def flash_config() -> Path:
    return shared_path("models", "glm-5.3-flash-shape", "config.json")


@pytest.fixture(scope="session")
def heldout_text() -> Path:
    return shared_path("data", "heldout.txt")


@pytest.fixture(scope="session")
def calibration_text() -> Path:
    return shared_path("data", "calibration.txt")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A random BF16 glm5_next checkpoint (formats/tiny.py defaults: widths 128, KDA×3 + DSA, 2 experts,
    NextN block, vision tower, fixture tokenizer when ../shared is present)."""
    from mixq.formats.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "bf16")


@pytest.fixture(scope="session")
def tiny_fp8_model(tmp_path_factory) -> Path:
    """The same random model as tiny_model (same seed), stored GLM-FP8 style in 2 shards + index."""
    from mixq.formats.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "fp8", fp8=True, shards=2)


# --- broken checkpoints: every bad-input case of the loader -------------------------------------------------
BAD_INPUTS = ("truncated", "lying_header", "missing_shard", "index_absent_tensor", "not_glm5next",
              "unknown_tensor", "missing_path", "file_not_dir")


def _rewrite_header(f: Path, fn) -> None:
    import json
    import struct

    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    fn(header)
    new = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def _edit_json(f: Path, fn) -> None:
    import json

    d = json.loads(f.read_text())
    fn(d)
    f.write_text(json.dumps(d))


@pytest.fixture(params=BAD_INPUTS)
def bad_checkpoint(request, tmp_path):
    """(kind, path, fragment): a broken copy of a tiny checkpoint and the file/tensor its error must name."""
    kind = request.param
    L = "model.language_model.layers"
    if kind in ("missing_shard", "index_absent_tensor"):
        d = copy_model(request.getfixturevalue("tiny_fp8_model"), tmp_path / kind)
    elif kind not in ("missing_path", "file_not_dir"):
        d = copy_model(request.getfixturevalue("tiny_model"), tmp_path / kind)
    if kind == "truncated":  # data offsets point past the end of the file
        f = d / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        return kind, d, "model.safetensors"
    if kind == "lying_header":  # shape x dtype disagrees with data_offsets
        _rewrite_header(d / "model.safetensors", lambda h: h["lm_head.weight"].__setitem__("shape", [8192, 129]))
        return kind, d, "lm_head.weight"
    if kind == "missing_shard":
        (d / "model-00002-of-00002.safetensors").unlink()
        return kind, d, "model-00002-of-00002.safetensors"
    if kind == "index_absent_tensor":
        _edit_json(d / "model.safetensors.index.json", lambda i: i["weight_map"].__setitem__(
            f"{L}.0.mlp.ghost.weight", "model-00001-of-00002.safetensors"))
        return kind, d, "ghost"
    if kind == "not_glm5next":
        def to_llama(c):
            c.update(model_type="llama", architectures=["LlamaForCausalLM"])
            c["text_config"]["model_type"] = "llama"
        _edit_json(d / "config.json", to_llama)
        return kind, d, "config.json"
    if kind == "unknown_tensor":  # a tensor no rule of the architecture table knows
        _rewrite_header(d / "model.safetensors", lambda h: h.__setitem__(
            f"{L}.1.self_attn.new_proj.weight", h.pop(f"{L}.1.self_attn.b_proj.weight")))
        return kind, d, "new_proj"
    if kind == "missing_path":
        return kind, tmp_path / "no-such-model", "no-such-model"
    f = tmp_path / "model.bin"  # file_not_dir
    f.write_bytes(b"x")
    return kind, f, "model.bin"


# --- an EXL3 directory in seconds ------------------------------------------------------------------------------
def cheap_trellis(weight, bits, hessian=None, codebook="mul1", seed=0):
    """Stand-in for `quant.trellis.quantize`: random but well-formed trellis codes, so that an EXL3 conversion
    takes seconds; reading such a directory back exercises the real trellis decoder."""
    import torch

    from mixq.quant import trellis

    if weight.dim() == 3:
        return [cheap_trellis(w, bits, None, codebook, seed + i) for i, w in enumerate(weight)]
    out_f, in_f = weight.shape
    k, n = -(-in_f // 128) * 128, -(-out_f // 128) * 128
    width = int(16 * bits) if bits == int(bits) else 16 * int(bits) + 8
    g = torch.Generator().manual_seed(seed + out_f * 7 + in_f)
    codes = torch.randint(-32768, 32768, (k // 16, n // 16, width), generator=g).to(torch.int16)

    def signs(m: int) -> torch.Tensor:
        return (torch.randint(0, 2, (m,), generator=g) * 2 - 1).to(torch.float16) * 0.05

    return trellis.QuantizedLinear(trellis=codes, suh=signs(k), svh=signs(n), codebook="mul1", shape=(out_f, in_f))


@pytest.fixture(scope="session")
def tiny_exl3_cheap(tiny_model, tmp_path_factory) -> Path:
    """tiny_model converted to EXL3 at 4 bpw with `cheap_trellis` codes (the decoder is the real one)."""
    from mixq.conversion.api import convert
    from mixq.quant import trellis

    out = tmp_path_factory.mktemp("exl3-cheap") / "tiny-4.0"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trellis, "quantize", cheap_trellis)
        convert(tiny_model, out, "exl3", bpw=4.0, rows=2, seq_len=16, device="cpu", progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_gguf(tiny_model, tmp_path_factory) -> Path:
    """tiny_model as a GGUF, --type Q4_K_M (widths of 128: llama.cpp's fallback types)."""
    from mixq.conversion.gguf.pipeline import convert_gguf

    out = tmp_path_factory.mktemp("gguf") / "tiny-Q4_K_M.gguf"
    convert_gguf(tiny_model, out, qtype="Q4_K_M", progress=False)
    return out
