"""`mixq convert --format gguf --threads N` (conversion/gguf/workers.py): the bytes do not depend on N, errors raised
inside a worker come back as the same one line naming the tensor, and nothing is left behind."""
from __future__ import annotations

import hashlib
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from mixq.cli import main
from mixq.conversion.gguf.pipeline import convert_gguf
from mixq.conversion.gguf.workers import Piece, TensorEncoder, encode, split
from mixq.errors import InputError


def _sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _synthetic_imatrix(model):
    """Positive per-column importances for every quantizable GGUF tensor (one vector per expert for *_exps), so
    the importance paths and the per-expert slicing of the imatrix are exercised without a calibration forward."""
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.gguf_names import gguf_tensors
    from mixq.formats.imatrix_file import IMatrix

    rng = np.random.default_rng(7)
    im = IMatrix(datasets=["synthetic"], chunk_count=1, chunk_size=512)
    for s in gguf_tensors(open_checkpoint(model)):
        if len(s.shape) >= 2 and s.name != "token_embd.weight":
            e = s.shape[0] if len(s.shape) == 3 else 1
            im.add(s.name, rng.gamma(2.0, 1.0, size=(e, s.shape[-1])).astype(np.float32) * 64, 64.0)
    return im


def test_split_covers_every_row_once():
    assert split((10, 256), 1024) == [Piece(0, 1, r, min(r + 4, 10)) for r in range(0, 10, 4)]
    assert split((5, 3, 256), 2048) == [Piece(0, 2, 0, 3), Piece(2, 4, 0, 3), Piece(4, 5, 0, 3)]  # whole experts
    assert split((2, 7, 256), 768) == [Piece(e, e + 1, r, min(r + 3, 7)) for e in range(2) for r in (0, 3, 6)]
    assert split((0, 256)) == []


def test_pool_equals_one_process_on_every_split_kind():
    """Row blocks of a 2-D tensor, groups of whole experts, row blocks inside one expert; per-expert and shared
    imatrix; K-quant, legacy and i-quant paths; in a pool of 2 with tiny tasks vs. encode() in this process."""
    rng = np.random.default_rng(3)
    cases = {
        "a": (rng.standard_normal((37, 512)).astype(np.float32), "Q4_K", rng.random(512).astype(np.float32) + .1),
        "b": (rng.standard_normal((5, 6, 256)).astype(np.float32), "Q6_K", rng.random((5, 256)).astype(np.float32) + .1),
        "c": (rng.standard_normal((3, 9, 256)).astype(np.float32), "IQ4_XS", rng.random((1, 256)).astype(np.float32) + .1),
        "d": (rng.standard_normal((4, 5, 64)).astype(np.float32), "Q5_0", rng.random((4, 64)).astype(np.float32) + .1),
        "e": (rng.standard_normal((11, 64)).astype(np.float32), "Q8_0", None),
        "f": (rng.standard_normal((3, 64)).astype(np.float32), "F16", None),  # encoded in the parent
    }
    items = [(k, q, f"label-{k}") for k, (_, q, _) in cases.items()]
    loaded = []

    def load(name):
        loaded.append(name)
        x, _, w = cases[name]
        return x, None if w is None else w.reshape(-1)

    # 1024 weights: "a" -> 2-row blocks, "b" -> 1 expert per task in 2 row blocks, "d" -> 3 experts per task
    with TensorEncoder(items, load, threads=2, task_weights=1024) as enc:
        got = {k: enc.get(k) for k, _, _ in items}
        assert enc._pool is not None  # the pool really ran
    assert loaded == list(cases)  # each tensor read once, in file order
    for k, (x, q, w) in cases.items():
        want = encode(x, q, w)
        assert got[k].dtype == want.dtype and got[k].shape == want.shape and np.array_equal(got[k], want), k


def test_first_failing_tensor_is_reported_whatever_the_look_ahead():
    """A NaN in tensor 1 (found by a worker) is reported, not the load error of tensor 2 met while looking ahead."""
    rng = np.random.default_rng(0)
    bad = rng.standard_normal((8, 256)).astype(np.float32)
    bad[5, 17] = np.nan

    def load(name):
        if name == "t2":
            raise InputError("t2: unreadable")
        return {"t0": rng.standard_normal((4, 256)).astype(np.float32), "t1": bad}[name], None

    items = [("t0", "Q4_K", "T0"), ("t1", "Q4_K", "T1 -> blk.9"), ("t2", "Q4_K", "T2")]
    for threads in (1, 2):
        with pytest.raises(InputError) as ei:
            with TensorEncoder(items, load, threads=threads, task_weights=512) as enc:
                for name, _, _ in items:
                    enc.get(name)
        assert str(ei.value).startswith("T1 -> blk.9: ") and "NaN" in str(ei.value), threads


@pytest.mark.slow  # one of the longest of the default run: bench/results/ci_fresh_clone_283e8d1_durations.tsv
def test_k256_q4_k_m_file_identical_at_1_and_2_threads(k256_model, tmp_path):
    """Whole k256 GGUF, Q4_K_M with an imatrix (importance paths, per-expert slices): same sha256 at N=1 and 2."""
    im = _synthetic_imatrix(k256_model)
    one = convert_gguf(k256_model, tmp_path / "t1.gguf", qtype="Q4_K_M", imatrix=im, threads=1, progress=False)
    two = convert_gguf(k256_model, tmp_path / "t2.gguf", qtype="Q4_K_M", imatrix=im, threads=2, progress=False)
    assert one["threads"] == 1 and two["threads"] == 2
    assert one["types"] == two["types"] and one["types"].get("Q4_K", 0) > 0 and one["types"].get("Q6_K", 0) > 0
    assert _sha256(one["files"][0]) == _sha256(two["files"][0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t1.gguf", "t2.gguf"]  # no partial directories left


def _nan_copy(tiny_model, dst):
    """A copy of the tiny checkpoint with one NaN in expert 1 of the last MoE layer's up_proj."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model, dst)
    shard = next(p for p in sorted(dst.glob("*.safetensors")) if "mtp" not in p.name)
    sd = load_file(shard)
    name = sorted(n for n in sd if n.endswith("mlp.experts.1.up_proj.weight"))[-1]
    sd[name] = sd[name].clone()
    sd[name].view(-1)[5] = float("nan")
    save_file(sd, shard, metadata={"format": "pt"})
    return name


def test_worker_error_is_the_same_one_line_and_leaves_no_file(tiny_model, tmp_path):
    name = _nan_copy(tiny_model, tmp_path / "nan-model")
    lines = {}
    for threads in ("1", "2"):
        out = tmp_path / f"o{threads}" / "o.gguf"
        r = CliRunner().invoke(main, ["convert", str(tmp_path / "nan-model"), str(out), "--format", "gguf",
                                      "--type", "Q8_0", "--threads", threads])
        assert r.exit_code == 2, r.output
        err = [ln for ln in r.stderr.splitlines() if ln.startswith("mixq: error")]
        assert len(err) == 1 and "Traceback" not in r.stderr, r.stderr
        lines[threads] = err[0]
        assert not list(out.parent.iterdir())  # neither the file nor its temporary directory
    assert lines["1"] == lines["2"]
    assert f"'{name}'" in lines["2"] and "NaN" in lines["2"]  # the expert tensor that holds the NaN, by name


def test_bad_thread_counts(tiny_model, tmp_path):
    with pytest.raises(InputError, match="threads"):
        convert_gguf(tiny_model, tmp_path / "x.gguf", qtype="Q8_0", threads=0, progress=False)
    r = CliRunner().invoke(main, ["convert", str(tiny_model), str(tmp_path / "x.gguf"), "--format", "gguf",
                                  "--type", "Q8_0", "--threads", "0"])
    assert r.exit_code == 2
    r = CliRunner().invoke(main, ["convert", str(tiny_model), str(tmp_path / "x"), "--threads", "2"])
    assert r.exit_code == 2 and "--threads applies to --format gguf only" in r.output
    assert not list(tmp_path.iterdir())


def test_default_is_every_core(monkeypatch):
    from mixq.conversion.gguf.pipeline import _thread_count

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert _thread_count(None) == 3 and _thread_count(5) == 5


@pytest.mark.parametrize("how", ["stdin", pytest.param("file", marks=pytest.mark.slow)])  # tests/test_readme.py
# runs the README's own example as a file in the default suite
def test_unguarded_script_converts_with_workers(tiny_model, tmp_path, how):
    """The README's Python example as a user pastes it: top-level code, no `if __name__ == "__main__":`, run as a
    file or read from standard input. The spawned encoder workers do not run the caller's script again, so it
    converts with 2 workers, once, and writes the bytes of a one-process conversion."""
    import subprocess
    import sys

    code = ("import mixq\n"
            f"res = mixq.convert({str(tiny_model)!r}, 'w2.gguf', qtype='Q8_0', threads=2, progress=False)\n"
            "print('converted', res.out)\n")
    args = [sys.executable, "script.py"] if how == "file" else [sys.executable, "-"]
    (tmp_path / "script.py").write_text(code)
    r = subprocess.run(args, input=None if how == "file" else code, capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("converted") == 1  # the workers did not run the script again
    convert_gguf(tiny_model, tmp_path / "w1.gguf", qtype="Q8_0", threads=1, progress=False)
    assert (tmp_path / "w2.gguf").read_bytes() == (tmp_path / "w1.gguf").read_bytes()


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_encoding_writes_the_cpu_bytes(k256_model, tmp_path):
    """--device cuda (mixq's torch encoders, in this process) writes the file the CPU encoders write: Q4_K_M with
    an imatrix, and i-quants on the experts."""
    im = _synthetic_imatrix(k256_model)
    cases = {"q4km": {}, "iq": {"tensor_type": [(r"ffn_(up|gate)_exps", "IQ2_XS"), (r"ffn_down_exps", "IQ3_S")]}}
    for label, kw in cases.items():
        cpu = convert_gguf(k256_model, tmp_path / f"{label}-cpu.gguf", qtype="Q4_K_M", imatrix=im, threads=1,
                           progress=False, **kw)
        gpu = convert_gguf(k256_model, tmp_path / f"{label}-gpu.gguf", qtype="Q4_K_M", imatrix=im, device="cuda",
                           progress=False, **kw)
        assert gpu["device"].startswith("cuda") and gpu["threads"] == 1 and cpu["device"] == "cpu"
        assert cpu["types"] == gpu["types"]
        assert _sha256(cpu["files"][0]) == _sha256(gpu["files"][0]), label


def test_threads_with_an_accelerator_is_refused(tiny_model, tmp_path):
    """--threads sizes the CPU worker pool: with --device cuda it would be silently unused."""
    import torch

    if torch.cuda.is_available():
        with pytest.raises(InputError, match="--threads applies to CPU encoding"):
            convert_gguf(tiny_model, tmp_path / "x.gguf", qtype="Q8_0", threads=2, device="cuda", progress=False)
    else:
        with pytest.raises(InputError, match="CUDA is not available"):
            convert_gguf(tiny_model, tmp_path / "x.gguf", qtype="Q8_0", device="cuda", progress=False)
    assert not list(tmp_path.iterdir())
