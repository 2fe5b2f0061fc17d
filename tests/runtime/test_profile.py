"""`--profile FILE` (runtime/profile.py): the JSON a real run writes, read back against the files it wrote and the
checkpoint it read; the outputs are those of a run without it."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mixq.formats.checkpoint import open_checkpoint
from mixq.formats.gguf_names import gguf_tensors
from mixq.runtime import profile
from cli_helpers import error_line, run_cli

MINI_LAYERS = ["0", "1", "2", "3"]


def _read(path: Path) -> dict:
    d = profile.check_profile(json.loads(path.read_text()))
    assert d["stages"], "no stage recorded"
    for s in d["stages"]:
        assert s["seconds"] >= 0 and s["bytes_read"] >= 0 and s["bytes_written"] >= 0
        assert s["peak_host_bytes"] > 0 and s["peak_gpu_bytes"] == 0  # these runs are on the CPU
    t = d["total"]
    assert t["seconds"] >= sum(s["seconds"] for s in d["stages"] if s["layer"] is not None) * 0.99
    assert t["peak_host_bytes"] == max(s["peak_host_bytes"] for s in [t, *d["stages"]])
    return d


def _layers(d: dict, stage: str) -> list:
    return [s["layer"] for s in d["stages"] if s["stage"] == stage]


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def test_gguf_convert_profile(mini_model, mini_q8_gguf, tmp_path):
    """Q8_0 of mini with --profile: a stage per layer, the bytes written are the file's size to the byte, the bytes
    read the sources of every GGUF tensor (the NextN block included), and the file is the one a run without
    --profile writes."""
    out, prof = tmp_path / "mini.gguf", tmp_path / "p.json"
    r = run_cli("convert", mini_model, out, "--type", "Q8_0", "--threads", "1", "--profile", prof)
    assert r.exit_code == 0, r.output[-2000:]
    assert "profile (convert, cpu):" in r.output  # the per-stage table ends the run
    d = _read(prof)
    assert d["verb"] == "convert" and d["format"] == "gguf" and d["device"] == "cpu"
    assert isinstance(d["argv"], list)  # the process's sys.argv (here pytest's: the runner is in-process)
    assert d["layers"] == {"0": {"attention": "linear_attention", "mlp": "dense"},
                           "1": {"attention": "linear_attention", "mlp": "moe"},
                           "2": {"attention": "linear_attention", "mlp": "moe"},
                           "3": {"attention": "deepseek_sparse_attention", "mlp": "moe"},
                           "nextn": {"attention": "deepseek_sparse_attention", "mlp": "moe"}}
    assert sorted(_layers(d, "encode"), key=str) == sorted(MINI_LAYERS + ["embed", "head", "nextn"], key=str)
    assert all(s["seconds"] > 0 for s in d["stages"] if s["stage"] == "encode")
    size = out.stat().st_size
    assert d["total"]["bytes_written"] == size == sum(s["bytes_written"] for s in d["stages"])
    ck = open_checkpoint(mini_model)  # each GGUF tensor reads its sources (kv_b twice: attn_k_b and attn_v_b)
    assert d["total"]["bytes_read"] == sum(ck.nbytes(h) for s in gguf_tensors(ck) for h in s.hf_names)
    assert out.read_bytes() == mini_q8_gguf.read_bytes()


@pytest.mark.slow
def test_exl3_convert_profile(tiny_model, tiny_exl3_cheap, tmp_path, monkeypatch):
    """EXL3 (the trellis codes stubbed as the session fixture's are, so it takes seconds): calibrate, hessians,
    encode, advance and write per decoder layer; the finalize stage writes exactly the output directory; the
    directory is byte for byte the fixture's, made without --profile."""
    from conftest import cheap_trellis
    from mixq.conversion.api import convert
    from mixq.quant import trellis

    monkeypatch.setattr(trellis, "quantize", cheap_trellis)
    out, prof = tmp_path / "tiny-4.0", tmp_path / "p.json"
    convert(tiny_model, out, "exl3", bpw=4.0, rows=2, seq_len=16, device="cpu", progress=False, profile=prof)
    d = _read(prof)
    n = open_checkpoint(tiny_model).num_hidden_layers
    layers = [str(i) for i in range(n)]
    assert _layers(d, "calibrate") == layers + ["head"]
    assert _layers(d, "advance") == layers
    assert _layers(d, "hessians") == ["embed", *layers, "head", "nextn", "vision"]
    assert sorted(_layers(d, "encode"), key=str) == sorted(["embed", *layers, "head", "nextn", "vision"], key=str)
    assert sorted(_layers(d, "write"), key=str) == sorted(_layers(d, "encode"), key=str)
    fin = [s for s in d["stages"] if s["stage"] == "finalize"]
    assert len(fin) == 1 and fin[0]["bytes_written"] == _dir_bytes(out)
    assert fin[0]["bytes_read"] > 0  # the parts, copied into the shards
    # every part written once, then the output: nothing else
    parts = sum(s["bytes_written"] for s in d["stages"] if s["stage"] == "write")
    assert parts > 0 and d["total"]["bytes_written"] >= parts + _dir_bytes(out)
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tiny_exl3_cheap) for p in tiny_exl3_cheap.rglob("*") if p.is_file())
    for f in files:
        assert (out / f).read_bytes() == (tiny_exl3_cheap / f).read_bytes(), f


def test_imatrix_profile(mini_model, calibration_text, tmp_path):
    """`mixq imatrix --profile`: a calibrate stage per layer and the head, the write stage writes the file's bytes,
    and the file equals one written without --profile."""
    args = ["imatrix", mini_model, None, "--calibration", calibration_text, "--rows", "2", "--seq-len", "24",
            "--device", "cpu"]
    a, b, prof = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "p.json"
    r = run_cli(*[a if x is None else x for x in args])
    assert r.exit_code == 0, r.output[-2000:]
    r = run_cli(*[b if x is None else x for x in args], "--profile", prof)
    assert r.exit_code == 0, r.output[-2000:]
    d = _read(prof)
    assert d["verb"] == "imatrix" and _layers(d, "calibrate") == MINI_LAYERS + ["head", "nextn"]
    (w,) = [s for s in d["stages"] if s["stage"] == "write"]
    assert w["bytes_written"] == b.stat().st_size == d["total"]["bytes_written"]
    assert a.read_bytes() == b.read_bytes()


def test_eval_profile(mini_model, mini_q8_gguf, heldout_text, tmp_path):
    """`mixq eval --profile`: the reference's load and forward and the candidate's decode and forward per layer, the
    scores at the head; the candidate's decode reads the GGUF's tensors; the numbers are a run's without it."""
    base = ["eval", mini_model, mini_q8_gguf, "--text", heldout_text, "--windows", "1", "--ctx", "32",
            "--device", "cpu"]
    ja, jb, prof = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "p.json"
    r = run_cli(*base, "--json", ja)
    assert r.exit_code == 0, r.output[-2000:]
    r = run_cli(*base, "--json", jb, "--profile", prof)
    assert r.exit_code == 0, r.output[-2000:]
    d = _read(prof)
    assert d["verb"] == "eval"
    for st in ("reference_load", "candidate_decode"):
        assert _layers(d, st) == MINI_LAYERS + ["head"], st
    for st in ("reference_forward", "candidate_forward"):
        assert _layers(d, st) == ["embed"] + MINI_LAYERS + ["head"], st
    assert set(_layers(d, "score")) == {"head"}
    ck = open_checkpoint(mini_model)
    decode = sum(s["bytes_read"] for s in d["stages"] if s["stage"] == "candidate_decode")
    assert 0 < decode < mini_q8_gguf.stat().st_size
    ref = sum(s["bytes_read"] for s in d["stages"] if s["stage"] in ("reference_load", "reference_forward"))
    assert ref == sum(ck.nbytes(n) for n in ck.names() if ck.info(n).role != "vision" and not ck.info(n).mtp)
    a, b = json.loads(ja.read_text()), json.loads(jb.read_text())
    keep = ("kld_mean", "top1", "ppl", "ppl_ref", "bytes", "bpw")
    ka = {k: v for k, v in a["candidates"][0].items() if k in keep}
    assert ka and ka == {k: v for k, v in b["candidates"][0].items() if k in keep}


def test_plan_measure_profile(tmp_path):
    """`mixq plan --measure proxy --profile` (a tiny checkpoint): a calibrate and a measure stage per decoder layer
    and the head; `--profile` without `--measure` is refused in one line."""
    from mixq.formats.tiny import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "m", nextn=False, vision=False,
                                  layer_types=("linear_attention", "linear_attention"))
    prof = tmp_path / "p.json"
    base = ["plan", model, "--format", "exl3", "--bpw", "3.05", "--device", "cpu"]
    r = run_cli(*base, "--measure", "proxy", "--profile", prof)
    assert r.exit_code == 0, r.output[-2000:]
    d = _read(prof)
    assert d["verb"] == "plan" and d["format"] == "exl3"
    assert d["layers"] == {"0": {"attention": "linear_attention", "mlp": "dense"},
                           "1": {"attention": "linear_attention", "mlp": "moe"}}
    assert _layers(d, "calibrate") == _layers(d, "measure") == ["0", "1", "head"]
    assert d["total"]["bytes_read"] > 0
    r = run_cli(*base, "--profile", tmp_path / "q.json")
    assert error_line(r) == "mixq: error: --profile applies to `plan --measure` (a plan alone runs no model)"


def test_profile_path_checked_before_work(mini_model, tmp_path):
    """A --profile path that cannot be written, or an existing file without --overwrite, is one line and exit 2,
    before anything is written."""
    out = tmp_path / "x.gguf"
    blocker = tmp_path / "file"
    blocker.write_text("")
    for prof, msg in ((blocker / "p.json", "is not a directory"),
                      (tmp_path, "is a directory"),
                      (blocker, "already exists; pass --overwrite")):
        r = run_cli("convert", mini_model, out, "--type", "Q8_0", "--threads", "1", "--profile", prof)
        last = error_line(r)
        assert ("--profile" in last or str(prof) in last) and msg in last, last
        assert not out.exists()
    r = run_cli("convert", mini_model, out, "--type", "Q8_0", "--profile", out)
    assert r.exit_code == 2 and "same file" in r.output


def test_stage_peaks_and_bytes_are_per_stage(tmp_path):
    """A stage that holds 256 MiB shows it in its own host peak and the stage after (the memory freed) does not:
    the peak is reset at every boundary. Bytes reach the stage of the thread that reports them; nothing is
    recorded, and `stage` is one shared no-op, outside a recording."""
    import threading

    from mixq.formats import io_counts

    assert profile.stage("a") is profile.stage("b", "0")
    big = 256 * 2**20
    with profile.recording(tmp_path / "p.json", "test") as p:
        with profile.stage("hold", "0"):
            x = np.ones(big, dtype=np.uint8)
            io_counts.count_read(7)
            del x
        with profile.stage("after", "0"):
            io_counts.count_written(5)
            t = threading.Thread(target=io_counts.count_read, args=(3,))  # a reader thread: the main's stage
            t.start()
            t.join()
    d = _read(tmp_path / "p.json")
    hold, after = d["stages"]
    assert hold["peak_host_bytes"] - after["peak_host_bytes"] > 0.9 * big
    assert (hold["bytes_read"], hold["bytes_written"], after["bytes_read"], after["bytes_written"]) == (7, 0, 3, 5)
    assert d["total"]["bytes_read"] == 10 and p.total.bytes_written == 5
    io_counts.count_read(11)  # no recording: counted nowhere
    assert profile.active() is None and json.loads((tmp_path / "p.json").read_text())["total"]["bytes_read"] == 10


def test_profile_with_several_devices_is_refused():
    """A profile is one process's: --profile with --devices of several devices is one InputError naming both."""
    from mixq.conversion.options import Exl3Options
    from mixq.errors import InputError
    from mixq.eval.options import EvalOptions

    for make in (lambda: Exl3Options(bpw=3.0, devices="cpu,cpu", profile="p.json"),
                 lambda: EvalOptions(devices="cpu,cpu", profile="p.json")):
        with pytest.raises(InputError, match="--profile records one process.*--devices"):
            make()
    assert Exl3Options(bpw=3.0, devices="cpu", profile="p.json").profile == "p.json"
