"""Bit-exactness of mixq.quant.ggml.encoders against ggml (llama-cpp-python 0.3.36's libggml-base).

The default suite checks digests recorded from ggml_quantize_chunk (tests/data/ggml_digests.json),
so it needs no llama.cpp; ``test_live_*`` compare byte for byte with the C library when it is
installed. Re-record with ``python tests/quant/test_ggml_encoders.py --record`` (needs the library).
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from mixq.errors import InputError
from mixq.quant.ggml import encoders
from mixq.quant.ggml import libggml

DIGESTS = Path(__file__).resolve().parent.parent / "data" / "ggml_digests.json"
# the generated edge-case rows and imatrices themselves, so the check does not depend on numpy's RNG streams
INPUTS = DIGESTS.with_name("ggml_tricky_inputs.npz")
TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL"]
N = 512
# k256 fixture tensors: two routed experts, a dense MLP down (n=768), two attention matrices
REAL = {
    "expert_gate": "model.language_model.layers.1.mlp.experts.0.gate_proj.weight",
    "expert_down": "model.language_model.layers.2.mlp.experts.5.down_proj.weight",
    "dense_down": "model.language_model.layers.0.mlp.down_proj.weight",
    "attn_q": "model.language_model.layers.0.self_attn.q_proj.weight",
    "attn_kv_a": "model.language_model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
}


def tricky_rows() -> tuple[np.ndarray, dict[str, slice]]:
    """Rows of width 512 covering ggml's edge cases; returns (rows, case -> row slice)."""
    rng = np.random.default_rng(20261129)
    g = rng.standard_normal((6, N)).astype(np.float32)
    cases: dict[str, np.ndarray] = {"gauss": g}
    cases["zeros"] = np.zeros((1, N), np.float32)
    cases["negzero"] = np.stack([np.full(N, -0.0), np.where(np.arange(N) % 2 == 0, -0.0, g[0])])
    cases["const"] = np.stack([np.full(N, v) for v in (0.5, -3.0, 1e-3)])
    out = g[:2].copy()
    out[:, ::97] = 1e4
    out[1, 5] = -3e5
    cases["outliers"] = out
    cases["tiny"] = np.stack([g[0] * 1e-15, g[1] * 1e-30, g[2] * 1e-12, g[3] * 1e-40])
    # squares overflow float32: ggml's sums become inf/NaN and its scans skip NaN
    cases["overflow"] = np.stack([g[0] * 1e18, np.where(np.arange(N) % 61 == 3, 3e38, g[1])])
    cases["ints"] = rng.integers(-3, 4, (2, N))
    cases["halves"] = rng.integers(-8, 9, (2, N)) * 0.5
    sparse = g[:2].copy()
    sparse[rng.random(sparse.shape) < 0.9] = 0
    cases["sparse"] = sparse
    cases["one_signed"] = np.stack([np.abs(g[0]) + 0.1, -np.abs(g[1]) - 0.1])
    scale = np.exp(rng.standard_normal((2, N // 32, 1)) * 3).repeat(32, 2).reshape(2, N)
    cases["multiscale"] = g[:2] * scale
    zs = g[:2].copy()
    zs[:, :64] = 0
    zs[:, 300:316] = 0
    cases["zero_subblocks"] = zs
    # bfloat16-valued weights as real checkpoints hold them (many exact ties)
    bits = (np.asarray(g[:2] * 0.02, np.float32).view(np.uint32) + 0x8000) & 0xFFFF0000
    cases["bf16"] = bits.view(np.float32)
    rows, where, r = [], {}, 0
    for name, a in cases.items():
        a = np.asarray(a, np.float32).reshape(-1, N)
        rows.append(a)
        where[name] = slice(r, r + a.shape[0])
        r += a.shape[0]
    return np.concatenate(rows), where


def tricky_imatrices() -> dict[str, np.ndarray | None]:
    rng = np.random.default_rng(7)
    return {
        "none": None,
        "rand": rng.random(N).astype(np.float32),
        "zeros_some": np.where(rng.random(N) < 0.3, 0, rng.random(N)).astype(np.float32),
        "spiky": np.exp(rng.standard_normal(N) * 4).astype(np.float32),
    }


def real_imatrix(n: int) -> np.ndarray:
    """A positive, heavy-tailed per-column importance like llama-imatrix's mean x^2."""
    return np.exp(np.random.default_rng(n).standard_normal(n) * 1.5).astype(np.float32)


def load_real(model_dir: Path, name: str) -> np.ndarray:
    import torch
    from safetensors import safe_open

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(model_dir / index[name], "pt") as f:
        return f.get_tensor(name).to(torch.float32).numpy()


def layer_experts(model_dir: Path, layer: int) -> np.ndarray:
    """Every routed expert matrix of one layer, rows stacked (for the every-expert comparisons with ggml)."""
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    names = sorted(k for k in index if f".layers.{layer}.mlp.experts." in k)
    return np.concatenate([load_real(model_dir, k) for k in names])


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:32]


def _digests_of(encode, x: np.ndarray, where: dict[str, slice], imats: dict, tag: str) -> dict[str, str]:
    out = {}
    for t in TYPES:
        for im_name, im in imats.items():
            q = encode(x, t, im)
            for case, sl in where.items():
                out[f"{tag}:{case}|{t}|{im_name}"] = sha(q[sl])
    return out


def _real_set(model_dir: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    xs = {k: load_real(model_dir, v) for k, v in REAL.items()}
    return xs, {k: sha(v) for k, v in xs.items()}


def load_tricky() -> tuple[np.ndarray, dict[str, slice], dict[str, np.ndarray | None]]:
    """The recorded edge-case rows, their case slices and the imatrices (tests/data)."""
    z = np.load(INPUTS)
    where = {str(k): slice(int(a), int(b)) for k, a, b in zip(z["case_names"], z["case_start"], z["case_stop"])}
    imats: dict[str, np.ndarray | None] = {"none": None}
    imats.update({str(k): z["imatrix_" + str(k)] for k in z["imatrix_names"]})
    return z["x"], where, imats


def record(model_dir: Path) -> None:
    """Write tests/data/ggml_digests.json (and the edge-case inputs) from ggml's own quantizer."""
    x, where = tricky_rows()
    imats = tricky_imatrices()
    names = [k for k in imats if imats[k] is not None]
    np.savez_compressed(INPUTS, x=x, case_names=np.array(list(where)),
                        case_start=np.array([sl.start for sl in where.values()]),
                        case_stop=np.array([sl.stop for sl in where.values()]),
                        imatrix_names=np.array(names), **{"imatrix_" + k: imats[k] for k in names})
    data = {"inputs": {"tricky": sha(x)}, "outputs": {}}
    data["outputs"].update(_digests_of(libggml.ggml_quantize, x, where, imats, "tricky"))
    xs, input_shas = _real_set(model_dir)
    data["inputs"].update(input_shas)
    for k, a in xs.items():
        data["outputs"].update(_digests_of(libggml.ggml_quantize, a, {k: slice(None)},
                                           {"none": None, "imatrix": real_imatrix(a.shape[1])}, "real"))
    DIGESTS.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")


@pytest.fixture(scope="module")
def digests() -> dict:
    return json.loads(DIGESTS.read_text())


def _mismatches(expected: dict, got: dict) -> list[str]:
    return [k for k, v in got.items() if expected[k] != v]


def test_tricky_rows_match_recorded_ggml(digests):
    x, where, imats = load_tricky()
    assert sha(x) == digests["inputs"]["tricky"]
    assert len(imats) == 4 and set(where) >= {"zeros", "negzero", "overflow", "tiny", "bf16"}
    got = _digests_of(encoders.quantize, x, where, imats, "tricky")
    assert len(got) == len(TYPES) * 4 * len(where)
    assert _mismatches(digests["outputs"], got) == []


@pytest.mark.parametrize("case", sorted(REAL))
def test_k256_tensors_match_recorded_ggml(digests, k256_model, case):
    x = load_real(k256_model, REAL[case])
    assert sha(x) == digests["inputs"][case], "fixture tensor changed; re-record"
    got = _digests_of(encoders.quantize, x, {case: slice(None)},
                      {"none": None, "imatrix": real_imatrix(x.shape[1])}, "real")
    assert _mismatches(digests["outputs"], got) == []


def test_output_layout_decodes_with_gguf_py():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    x = np.random.default_rng(3).standard_normal((4, 512)).astype(np.float32)
    # rms error of a Gaussian at each type, loose upper bounds (ordered by bits)
    bounds = {"Q2_K": 0.45, "Q3_K": 0.22, "Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.025, "IQ4_XS": 0.1, "Q8_0": 0.008,
              "Q4_0": 0.12, "Q4_1": 0.1, "Q5_0": 0.06, "Q5_1": 0.05, "IQ4_NL": 0.1}
    for t, bound in bounds.items():
        q = encoders.quantize(x, t)
        assert q.dtype == np.uint8 and q.shape == (4, encoders.row_bytes(t, 512))
        y = dequantize(q, GGMLQuantizationType[t])
        assert y.shape == x.shape
        assert np.sqrt(np.mean((y - x) ** 2)) < bound, t


def test_sizes_and_bad_input():
    assert (encoders.block_size("Q4_K"), encoders.type_size("Q4_K")) == (256, 144)
    assert (encoders.block_size("Q8_0"), encoders.type_size("Q8_0")) == (32, 34)
    assert encoders.row_bytes("Q6_K", 512) == 420
    x = np.zeros((2, 256), np.float32)
    with pytest.raises(InputError, match="IQ9"):
        encoders.quantize(x, "IQ9")
    with pytest.raises(InputError, match="multiple of 256"):
        encoders.quantize(np.zeros((2, 96), np.float32), "Q4_K")
    with pytest.raises(InputError, match="imatrix"):
        encoders.quantize(x, "Q4_K", np.ones(128, np.float32))
    with pytest.raises(InputError, match="NaN"):
        encoders.quantize(np.full((1, 256), np.nan, np.float32), "Q4_K")
    with pytest.raises(InputError, match="2-D"):
        encoders.quantize(np.zeros(256, np.float32), "Q4_K")


def test_stacked_experts_use_their_own_imatrix_slice():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 4, 256)).astype(np.float32)
    im = rng.random((3, 256)).astype(np.float32)
    q = encoders.quantize_stacked(x, "Q4_K", im.reshape(-1))
    assert q.shape == (3, 4, 144)
    for e in range(3):
        assert np.array_equal(q[e], encoders.quantize(x[e], "Q4_K", im[e]))
    assert not np.array_equal(q[1], encoders.quantize(x[1], "Q4_K", im[0]))
    with pytest.raises(InputError, match="imatrix"):
        encoders.quantize_stacked(x, "Q4_K", im[:2])


def test_chunking_does_not_change_bytes(monkeypatch):
    x = np.random.default_rng(5).standard_normal((6, 512)).astype(np.float32)
    im = np.random.default_rng(6).random(512).astype(np.float32)
    whole = {t: encoders.quantize(x, t, im) for t in ("Q4_K", "Q5_1")}
    monkeypatch.setattr(encoders, "CHUNK_WEIGHTS", 512)  # one row per chunk
    for t, q in whole.items():
        assert np.array_equal(encoders.quantize(x, t, im), q)


needs_ggml = pytest.mark.skipif(not libggml.available(), reason="llama-cpp-python's libggml-base not installed")


@needs_ggml
@pytest.mark.parametrize("qtype", TYPES)
def test_live_random_rows_equal_ggml(qtype):
    rng = np.random.default_rng(99)
    x = (rng.standard_normal((8, 1024)) * np.exp(rng.standard_normal((8, 1)))).astype(np.float32)
    im = rng.random(1024).astype(np.float32)
    for imx in (None, im):
        assert np.array_equal(encoders.quantize(x, qtype, imx), libggml.ggml_quantize(x, qtype, imx))


@needs_ggml
@pytest.mark.slow
def test_live_all_experts_of_a_layer_equal_ggml(k256_model):
    """Every routed expert matrix of one k256 layer, every type, with and without an imatrix."""
    x = layer_experts(k256_model, 2)
    im = real_imatrix(x.shape[1])
    for t in TYPES:
        for imx in (None, im):
            assert np.array_equal(encoders.quantize(x, t, imx), libggml.ggml_quantize(x, t, imx)), t


@needs_ggml
@pytest.mark.slow
def test_live_every_matrix_of_k256_equal_ggml(k256_model):
    """Every 2-D tensor of the k256 fixture (incl. NextN), every type its width allows, +-imatrix."""
    import torch
    from safetensors import safe_open

    checked = 0
    for path in sorted(k256_model.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                shape = t.get_shape()
                if len(shape) != 2 or shape[1] % 32:
                    continue
                x = f.get_tensor(name).to(torch.float32).numpy()
                im = real_imatrix(x.shape[1])
                for q in TYPES:  # the i-quant grid types: tests/quant/test_ggml_iquants.py
                    if x.shape[1] % encoders.block_size(q):
                        continue
                    for imx in (None, im):
                        ok = np.array_equal(encoders.quantize(x, q, imx), libggml.ggml_quantize(x, q, imx))
                        assert ok, (name, q, imx is not None)
                        checked += 1
    assert checked > 1000


if __name__ == "__main__" and "--record" in sys.argv:
    record(Path(__file__).resolve().parents[3] / "shared" / "models" / "glm5next-k256")
    print("wrote", DIGESTS)
