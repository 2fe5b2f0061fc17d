"""End-to-end EXL3 conversion of a tiny random glm5_next checkpoint: verify, read back, transformers forward,
kill -9 + --resume byte-identical, bad input (the DFlash2 drafter: tests/conversion/test_drafter.py).

The trellis encoder (quant/trellis/encoder.py, tested on its own in tests/quant) needs minutes per tiny model on 2 shared
CPU cores, so the default-suite tests here swap in FAKE_TRELLIS: a deterministic stand-in with the same API and
tensor layout whose output depends on the weight and on the calibration Hessian (so calibration state, resume
and byte-identity are still exercised). The real encoder runs end to end (about two minutes) in tests/conversion/test_exl3_real_trellis.py, a module of
its own so that this module's fake never leaks into it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

ROWS, SEQ = 4, 32
SLOW_STAGES_ENV = "MIXQ_TEST_STAGE_PAUSE"  # read by the fake-trellis sitecustomize only (tests, never mixq)
ARGS = ["--bpw", "4.0", "--rows", str(ROWS), "--seq-len", str(SEQ), "--device", "cpu", "--shard-size", "3MiB"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The resume test compares bytes with a 1-thread subprocess: this module computes with one thread too."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)

FAKE_TRELLIS = """
import torch

class QL:
    def __init__(self, trellis, suh, svh, shape):
        self.trellis, self.suh, self.svh, self.shape = trellis, suh, svh, tuple(shape)
    @property
    def bits(self):
        return self.trellis.shape[-1] / 16
    def dequantize(self):
        out_f, in_f = self.shape
        return torch.outer(self.suh.float(), self.svh.float())[:in_f, :out_f].t().contiguous()
    def tensors(self):
        return {"trellis": self.trellis, "suh": self.suh, "svh": self.svh,
                "mul1": torch.tensor(0x83DCD12D - (1 << 32), dtype=torch.int32)}

def _one(w, bits, h):
    out_f, in_f = w.shape
    k, n = -(-in_f // 128) * 128, -(-out_f // 128) * 128
    wk = torch.zeros(k, n, dtype=torch.float64)
    wk[:in_f, :out_f] = w.t().double()
    s = torch.ones(k, dtype=torch.float64)
    if h is not None:  # Hessian-weighted rank-1 fit: the output depends on the calibration statistics
        s[:in_f] = h.double().diagonal().clamp_min(1e-12).sqrt()
    a = wk * s[:, None]
    v = torch.ones(n, dtype=torch.float64)
    for _ in range(12):
        u = a @ v
        v = a.t() @ u
        v = v / v.norm().clamp_min(1e-30)
    u = (a @ v) / s
    width = int(16 * bits) if bits == int(bits) else 16 * int(bits) + 8
    codes = (wk.flatten() * 4096).round().remainder(65536).to(torch.int64)
    need = (k // 16) * (n // 16) * width
    codes = codes.repeat(need // codes.numel() + 1)[:need]
    trellis = (codes - 32768).to(torch.int16).view(k // 16, n // 16, width)
    return QL(trellis, u.to(torch.float16), v.to(torch.float16), (out_f, in_f))

def quantize(weight, bits, hessian=None, codebook="mul1", seed=0):
    if weight.dim() == 3:
        return [_one(weight[i], bits, None if hessian is None else hessian[i]) for i in range(weight.shape[0])]
    return _one(weight, bits, hessian)

def from_tensors(tensors, shape):
    return QL(tensors["trellis"], tensors["suh"], tensors["svh"], shape)
"""


def _fake_module() -> types.ModuleType:
    import mixq.quant

    m = types.ModuleType("mixq.quant.trellis")
    exec(FAKE_TRELLIS, m.__dict__)
    m.__path__ = [str(Path(mixq.quant.__file__).parent / "trellis")]  # the package's other modules stay real
    return m


@pytest.fixture(scope="module")
def fake_trellis(tmp_path_factory):
    """Swap in FAKE_TRELLIS in this process; returns a dir whose sitecustomize.py does it in subprocesses."""
    import mixq.quant

    mp = pytest.MonkeyPatch()
    fake = _fake_module()
    mp.setitem(sys.modules, "mixq.quant.trellis", fake)
    mp.setattr(mixq.quant, "trellis", fake, raising=False)
    d = tmp_path_factory.mktemp("fake_trellis")
    (d / "sitecustomize.py").write_text(
        "import os, sys, time, types\n"
        "import mixq.quant\n"
        f"src = {FAKE_TRELLIS!r}\n"
        "m = types.ModuleType('mixq.quant.trellis')\n"
        "exec(src, m.__dict__)\n"
        "m.__path__ = [os.path.join(os.path.dirname(mixq.quant.__file__), 'trellis')]\n"
        "sys.modules['mixq.quant.trellis'] = m\n"
        "mixq.quant.trellis = m\n"
        # SLOW_STAGES_ENV: sleep after each recorded stage, so a test can kill -9 a conversion mid-way
        f"pause = float(os.environ.get({SLOW_STAGES_ENV!r}) or 0)\n"
        "if pause:\n"
        "    from mixq.conversion.job import Job\n"
        "    record = Job.record\n"
        "    def slow_record(self, *a, **k):\n"
        "        record(self, *a, **k)\n"
        "        time.sleep(pause)\n"
        "    Job.record = slow_record\n")
    yield d
    mp.undo()


def _env(site: Path | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TQDM_DISABLE="1")
    paths = ([str(site)] if site else []) + [str(Path(__file__).resolve().parents[3])] + sys.path
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _run(*args):
    """In-process CLI run (click's runner keeps the exit code and both streams)."""
    from click.testing import CliRunner

    from mixq.cli import main

    return CliRunner().invoke(main, list(args))


def _cli(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mixq", *args], capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.fixture(scope="module")
def tiny_exl3(tiny_model, tmp_path_factory, fake_trellis):
    from mixq.conversion.api import convert

    out = tmp_path_factory.mktemp("exl3") / "tiny-4.0"
    res = convert(tiny_model, out, "exl3", bpw=4.0, rows=ROWS, seq_len=SEQ, device="cpu", shard_size="3MiB",
                  progress=False)
    return out, res


def test_convert_verify_and_plan_coverage(tiny_model, tiny_exl3):
    from mixq.conversion.api import verify
    from mixq.planning.planner import plan_model
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.exl3_names import exl3_layout

    out, res = tiny_exl3
    rep = verify(out)
    assert rep["ok"], rep["problems"]
    ck = open_checkpoint(tiny_model)
    units = exl3_layout(ck)
    assert rep["quantized"] == sum(u.kind == "trellis" for u in units) == res.quantized > 0
    plan = plan_model(ck, "exl3", bpw=4.0)
    stored = set(json.loads((out / "mixq_manifest.json").read_text())["tensors"])
    by_hf = {n: u for u in units for n in u.hf_names}
    for t in plan.tensors:  # every planned tensor is stored (under its EXL3 key)
        u = by_hf[t.hf_names[0]]
        assert set(u.tensor_specs(t.bits if u.kind == "trellis" else None)) <= stored, t.name
        if u.kind == "trellis":
            k, n = u.padded
            assert tuple(ck.shape(t.hf_names[0])) == t.shape
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "exl3" and abs(qc["bits"] - 4.0) <= 0.1 and qc["head_bits"] == 6
    assert qc["mtp_bits"] == 4 and "vision_bits" not in qc
    assert cfg["text_config"]["layer_types"] == ["linear_attention"] * 3 + ["deepseek_sparse_attention"]
    ts = json.loads((out / "quantization_config.json").read_text())["tensor_storage"]
    qkv = ts["model.language_model.layers.0.self_attn.qkv_proj"]
    assert qkv["quant_format"] == "exl3" and qkv["mul1_multiplier"] == 2212286765
    assert qkv["stored_tensors"]["model.language_model.layers.0.self_attn.qkv_proj.trellis"]["dtype"] == "torch.int16"
    assert len(res.shards) >= 2 and all((out / s).stat().st_size <= 3 * 2**20 for s in res.shards)
    assert (out / "model.safetensors.index.json").exists() and (out / "tokenizer.json").exists()
    assert not (out / ".mixq-job").exists()
    assert res.seconds > 0 and res.peak_rss_mib > 0 and "peak RSS" in res.summary()
    assert res.format == "exl3" and res.bpw == res.bits and res.files == [f"{out}/{s}" for s in res.shards]


def test_read_back_and_transformers_forward(tiny_model, tiny_exl3):
    from mixq.runtime.reference import build_model
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.runtime.dequant import read_exl3

    out, _ = tiny_exl3
    ck = open_checkpoint(tiny_model)
    w = read_exl3(out)
    assert set(w) == set(ck.names())
    for n in ck.names():
        src = ck.get(n)
        assert w[n].shape == src.shape, n
        info = ck.info(n)
        if info.exl3 == "trellis" and not (info.role == "vision"):
            assert bool(torch.isfinite(w[n]).all()) and w[n].abs().sum() > 0, n
        elif ck.source_dtype(n) == "bfloat16" and (info.exl3 in ("native", "fp32") or info.role == "vision"):
            assert torch.equal(w[n], src), n  # bf16 kept (vision at source precision)
        else:
            torch.testing.assert_close(w[n], src.half().float(), rtol=0, atol=0)  # fp16 rounding only
    model = build_model(out, w, torch.device("cpu"))
    ids = torch.randint(0, 8192, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 24, 8192) and bool(torch.isfinite(logits).all())
    assert logits.abs().max() > 0


def test_verify_reports_corruption_and_exits_1(tiny_exl3, tmp_path):
    import shutil

    out, res = tiny_exl3
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    shard = bad / res.shards[0]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    man = json.loads((bad / "mixq_manifest.json").read_text())
    victim = next(n for n in man["expected"] if n.endswith(".suh"))
    man["expected"][victim]["shape"] = [7]
    (bad / "mixq_manifest.json").write_text(json.dumps(man))
    r = _run("verify", str(bad))
    assert r.exit_code == 1, r.output
    assert "sha256 mismatch" in r.output and victim in r.output
    r = _run("verify", str(tmp_path / "nowhere"))
    assert r.exit_code == 2 and "error" in r.stderr and isinstance(r.exception, SystemExit)
    assert _run("verify", str(out)).exit_code == 0


def test_kill9_then_resume_is_byte_identical(tiny_model, tiny_exl3, fake_trellis, tmp_path):
    ref, res = tiny_exl3
    out = tmp_path / "killed"
    env = dict(_env(fake_trellis), **{SLOW_STAGES_ENV: "0.5"})
    p = subprocess.Popen([sys.executable, "-m", "mixq", "convert", str(tiny_model), str(out), *ARGS],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    job = out / ".mixq-job" / "job.json"
    deadline = time.time() + 300
    done = 0
    while time.time() < deadline and p.poll() is None:
        try:
            done = len(json.loads(job.read_text())["done"])
        except (OSError, ValueError, KeyError):
            done = 0
        if done >= 3:  # embed + two decoder layers finished
            break
        time.sleep(0.05)
    assert p.poll() is None, "conversion ended before it could be killed"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (out / "config.json").exists()  # no complete-looking output
    r = _run("convert", str(tiny_model), str(out), *ARGS)  # without --resume: refuses
    assert r.exit_code == 2 and "--resume" in r.stderr
    r = _cli("convert", str(tiny_model), str(out), *ARGS, "--resume", "--json", env=_env(fake_trellis))
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout)
    assert summary["resumed_stages"] >= 3
    for name in res.shards + ["config.json", "quantization_config.json", "model.safetensors.index.json"]:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    assert not (out / ".mixq-job").exists()


def test_bad_input_exits_2(tiny_model, tmp_path):
    cases = [
        (["convert", str(tmp_path / "missing"), str(tmp_path / "o1"), "--bpw", "4"], "missing"),
        (["convert", str(tiny_model), str(tmp_path / "o2")], "--bpw"),
        (["convert", str(tiny_model), str(tmp_path / "o3"), "--bpw", "4", "--resume"], "nothing to resume"),
        (["convert", str(tiny_model), str(tmp_path / "o4"), "--bpw", "4", "--calibration",
          str(tmp_path / "nope.txt")], "calibration file"),
        (["convert", str(tiny_model), str(tmp_path / "o5"), "--bpw", "4", "--shard-size", "lots"], "size"),
        (["convert", str(tiny_model), str(tmp_path / "o6"), "--bpw", "4", "--type", "Q4_K_M"], "gguf only"),
    ]
    for args, needle in cases:
        r = _run(*args)
        assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (args, r.output[-500:])
        assert needle in r.stderr, r.stderr[-500:]


def test_head16_vision_bits_and_no_mtp(tiny_model, fake_trellis, tmp_path):
    from mixq.conversion.api import convert, verify
    from mixq.formats.safetensors_io import read_header

    out = tmp_path / "v"
    res = convert(tiny_model, out, "exl3", bpw=4.0, rows=2, seq_len=16, device="cpu", head_bits=16,
                  vision_bits=6, include_mtp=False, progress=False)
    assert verify(out)["ok"]
    _, hdr = read_header(out / res.shards[0])
    assert hdr["lm_head.weight"]["dtype"] == "F16" and hdr["lm_head.weight"]["shape"] == [8192, 128]
    assert "lm_head.trellis" not in hdr
    qkv = "model.visual.blocks.0.attn.qkv"
    assert hdr[f"{qkv}.trellis"]["shape"][-1] == 96 and hdr[f"{qkv}.bias"]["dtype"] == "F16"
    assert not [n for n in hdr if ".layers.4." in n]  # no NextN block
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["head_bits"] == 16 and qc["vision_bits"] == 6 and "mtp_bits" not in qc


def test_fp8_source_keeps_original_quantization_config(tiny_fp8_model, fake_trellis, tmp_path):
    from mixq.conversion.api import convert, verify
    from mixq.formats.exl3_reader import Exl3Dir

    out = tmp_path / "fp8"
    convert(tiny_fp8_model, out, "exl3", bpw=4.0, rows=2, seq_len=16, device="cpu", progress=False)
    assert verify(out)["ok"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "exl3" and qc["original_quantization_config"]["quant_method"] == "fp8"
    d = Exl3Dir(out)
    assert not [n for n in d.where if n.endswith("scale_inv")]
    assert d.tensor("model.language_model.layers.3.self_attn.kv_b_proj.weight").dtype == torch.float16


def test_convert_with_measured_curves_follows_the_sensitivity_plan(tiny_model, fake_trellis, tmp_path):
    """`mixq convert --measure CURVES.json` writes the plan that `mixq plan --measure CURVES.json` prints: a unit
    whose curve says it is very sensitive gets more bits than the role default, an insensitive one fewer."""
    from mixq.conversion.exl3.pipeline import unit_bits
    from mixq.planning.planner import plan_model
    from mixq.measurement.trellis import budget_units, save_curves
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.exl3_names import exl3_layout
    from mixq.formats.exl3_reader import Exl3Dir
    from mixq.planning.allocator import EXL3_RATES

    ck = open_checkpoint(tiny_model)
    keys = sorted(budget_units(ck))
    hot = next(k for k in keys if "o_proj" in k)
    cold = next(k for k in keys if "experts" in k and "shared" not in k)
    weight = {k: 1e6 if k == hot else 1e-6 if k == cold else 1.0 for k in keys}
    curves = {k: {b: w * 2.0 ** (-2 * b) for b in EXL3_RATES} for k, w in weight.items()}
    path = tmp_path / "curves.json"
    save_curves(curves, path)
    r = _run("convert", str(tiny_model), str(tmp_path / "m"), *ARGS, "--measure", str(path))
    assert r.exit_code == 0, r.output
    units = exl3_layout(ck)
    want = unit_bits(units, plan_model(ck, "exl3", bpw=4.0, measure=curves))
    role = unit_bits(exl3_layout(ck), plan_model(ck, "exl3", bpw=4.0))
    d = Exl3Dir(tmp_path / "m")
    got = {k: d.tensor(f"{k}.trellis").shape[-1] / 16 for k in want}
    assert got == want
    groups = budget_units(ck)
    assert all(want[u.key] > role[u.key] for u in groups[hot])
    assert all(want[u.key] < role[u.key] for u in groups[cold])
    r = _run("convert", str(tiny_model), str(tmp_path / "g.gguf"), "--format", "gguf", "--type", "Q8_0",
             "--measure", str(path))
    assert r.exit_code == 2 and "--measure plans a GGUF to --bpw or --size, not --type Q8_0" in r.output


def test_nextn_block_is_calibrated(tiny_model, fake_trellis, tmp_path, monkeypatch):
    """Every trellis Linear of the NextN block gets a Hessian from the calibration forward (the block run on the
    quantized trunk's final hidden state and the next token's embedding), none is a fallback."""
    from mixq.conversion.api import convert
    from mixq.conversion.exl3 import pipeline

    seen: dict[str, list] = {}
    real = pipeline._stage_hessians

    def spy(run, stage_units, stats):
        units, hs = real(run, stage_units, stats)
        if stage_units and stage_units[0].stage.startswith("mtp."):
            seen.update({u.key: h for u, h in zip(units, hs)})
        return units, hs

    monkeypatch.setattr(pipeline, "_stage_hessians", spy)
    res = convert(tiny_model, tmp_path / "n", "exl3", bpw=4.0, rows=2, seq_len=16, device="cpu", progress=False)
    assert any(k.endswith("eh_proj") for k in seen) and len(seen) > 5, sorted(seen)
    for key, h in seen.items():
        assert h is not None and torch.isfinite(h).all() and h.diagonal().gt(0).any(), key
    assert not [k for k in res.fallbacks if ".layers.4." in k]
