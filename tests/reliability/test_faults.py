"""Faults met mid-run: the GGUF encoder processes die with their parent (even killed with SIGKILL), an interrupt
(Ctrl-C or SIGTERM to the process group) ends the run with one line and exit 128 + the signal, leaving no OUT and
no worker; a disk that fills, a read-only place, a folder removed mid-run are one `mixq: error:` line (exit 2)
with nothing at OUT."""
from __future__ import annotations

import errno
import multiprocessing
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

from mixq.conversion.gguf import workers as gguf_workers
from mixq.conversion.gguf.workers import STOP_SIGNALS, TensorEncoder
from mixq.formats.atomic import atomic_path

from cli_helpers import error_line as _error_line, error_lines as _error_lines, write_compare_report
from cli_helpers import run_cli as _cli

GGUF = ["--format", "gguf", "--type", "Q8_0"]
HAS_PROC = Path("/proc/self/stat").exists()
needs_proc = pytest.mark.skipif(not HAS_PROC, reason="reads processes from /proc (Linux)")

# `mixq` in a subprocess, each tensor the writer asks the encoder for delayed: the run lasts at least
# tensors x PAUSE_S whatever the machine's speed, so a test can always catch it mid-write. SIGINT_IGNORED starts it
# the way a shell starts `mixq ... &` of a script: Ctrl-C ignored.
PAUSE_S = 0.1
SLOW_MIXQ = f"""
import os, signal, sys, time
if os.environ.get("SIGINT_IGNORED"):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
from mixq.conversion.gguf import workers as gguf_workers
get = gguf_workers.TensorEncoder.get
def slow_get(self, name):
    time.sleep({PAUSE_S})
    return get(self, name)
gguf_workers.TensorEncoder.get = slow_get
from mixq.cli import main
main(args=sys.argv[1:], prog_name="mixq")
"""
WAIT_S = 300  # bounds of the waits below: generous, each ends as soon as what it waits for happens


def _children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (/proc/*/stat; no psutil)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _start(model: Path, out: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    """The slowed `mixq convert MODEL OUT --threads 2` in its own process group (signals to the group reach
    only it and its workers)."""
    cmd = [sys.executable, "-c", SLOW_MIXQ, "convert", str(model), str(out), *GGUF, "--threads", "2", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env=dict(os.environ, **(env or {})))


def _workers(p: subprocess.Popen, out: Path, *, writing: bool) -> list[int]:
    """Wait until the run has its 2 encoder workers (and, with `writing`, has tensor data in its partial file);
    returns every child process of the run (workers and multiprocessing's resource tracker)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and p.poll() is None:
        kids = _children(p.pid)
        workers = [k for k in kids if b"spawn_main" in _cmdline(k)]
        partial = [f for f in out.parent.glob(f".{out.stem}.partial-*/{out.name}")]
        if len(workers) >= 2 and (not writing or (partial and partial[0].stat().st_size > 1 << 16)):
            return kids
        time.sleep(0.05)
    _, err = p.communicate(timeout=WAIT_S)
    pytest.fail(f"the run ended (rc {p.returncode}) before it could be caught: {err.decode()[-2000:]}")


def _gone(pids: list[int]) -> list[int]:
    """The pids still alive once they had WAIT_S to end (normally well under a second)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and any(_alive(k) for k in pids):
        time.sleep(0.05)
    return [k for k in pids if _alive(k)]


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


# --- encoder processes die with their parent --------------------------------------------------------------------
@needs_proc
@pytest.mark.parametrize("when", ["starting", "writing"])
def test_workers_die_with_a_parent_killed_outright(when, tiny_model, tmp_path):
    """SIGKILL of the converting process, while its workers still start up (they must not take their re-parented
    parent for theirs) or while it writes: every process it started ends by itself."""
    out = tmp_path / "o.gguf"
    p = _start(tiny_model, out)
    try:
        kids = _workers(p, out, writing=when == "writing")
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=WAIT_S)
        assert _gone(kids) == [], [_cmdline(k)[:120] for k in kids if _alive(k)]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.communicate(timeout=WAIT_S)  # its pipes close once no process holds them: no worker left
    assert not out.exists()


def test_a_worker_that_outlived_its_parent_at_start_leaves():
    """The parent's pid comes from the parent: a worker whose parent is not that pid (it died before the worker
    ran its initializer) exits at once instead of watching its new parent."""
    code = "from mixq.conversion.gguf.workers import _worker_init\n_worker_init(-1)\nprint('still here')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 1 and "still here" not in r.stdout, r.stdout + r.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_asks_the_kernel_to_end_it_with_its_parent():
    code = ("import ctypes, os, signal\nfrom mixq.conversion.gguf.workers import _worker_init\n"
            "_worker_init(os.getppid())\nv = ctypes.c_int()\n"
            "ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0)\n"  # PR_GET_PDEATHSIG
            "print(v.value == signal.SIGKILL, [signal.getsignal(s) == signal.SIG_IGN for s in "
            "(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 0 and r.stdout.split() == ["True", "[True,", "True,", "True]"], r.stdout + r.stderr


def test_a_signal_during_a_workers_start_up_does_not_kill_it():
    """Workers start with the group's signals held (a Ctrl-C while they import would print their tracebacks
    and break the pool) and ignore them once set up: the parent alone decides to stop."""
    enc = TensorEncoder([("a", "Q8_0", "a")], lambda name: (np.ones((4, 32), np.float32), None), threads=2)
    try:
        enc.start()
        for pid in list(enc._pool._processes):
            for sig in STOP_SIGNALS:
                os.kill(pid, sig)
        assert all(f.result(timeout=WAIT_S) for f in enc._starts)  # every worker came up and answered
        ignored = enc._pool.submit(signal.getsignal, signal.SIGINT).result(timeout=WAIT_S)
        blocked = enc._pool.submit(signal.pthread_sigmask, signal.SIG_BLOCK, []).result(timeout=WAIT_S)
        assert ignored == signal.SIG_IGN and not set(blocked) & set(STOP_SIGNALS)
        assert np.array_equal(enc.get("a"), gguf_workers.encode(np.ones((4, 32), np.float32), "Q8_0"))
    finally:
        enc.close()
    assert multiprocessing.active_children() == []


def test_an_interrupt_while_encoding_stops_every_worker():
    items = [(n, "Q8_0", n) for n in "abcd"]

    def load(name):
        if name == "c":
            raise KeyboardInterrupt
        return np.ones((64, 256), np.float32), None

    with pytest.raises(KeyboardInterrupt):
        with TensorEncoder(items, load, threads=2, task_weights=2048) as enc:
            for n, _, _ in items:
                enc.get(n)
    assert multiprocessing.active_children() == []


def test_an_interrupted_shutdown_kills_the_workers(monkeypatch):
    """A second Ctrl-C (or a test's timeout) while the pool waits for its running tasks: no more waiting, the
    workers are killed, and no pool thread is left for the interpreter's exit to wait for."""
    enc = TensorEncoder([("a", "Q8_0", "a")], lambda name: (np.ones((4, 32), np.float32), None), threads=2)
    enc.start()
    assert all(f.result(timeout=WAIT_S) for f in enc._starts)
    manager = enc._pool._executor_manager_thread

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(gguf_workers, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        enc.close(abort=True)
    manager.join(WAIT_S)
    assert not manager.is_alive() and multiprocessing.active_children() == []


def test_a_pool_stopped_mid_message_lets_the_interpreter_exit():
    """A result cut short in the pool's pipe (its worker killed mid-send) holds the manager thread in a read that
    the interpreter's exit would wait for; stopping the pool ends that read."""
    enc = TensorEncoder([("a", "Q8_0", "a")], lambda name: (np.ones((4, 32), np.float32), None), threads=2)
    enc.start()
    assert all(f.result(timeout=WAIT_S) for f in enc._starts)
    pool = enc._pool
    manager = pool._executor_manager_thread
    # the length header of a 1 MiB message and one byte of it (multiprocessing.connection's framing)
    os.write(pool._result_queue._writer.fileno(), struct.pack("!i", 1 << 20) + b"x")
    enc._pool = None  # stopped below, by hand
    gguf_workers._stop_now(pool)
    manager.join(WAIT_S)
    assert not manager.is_alive() and multiprocessing.active_children() == []


# --- interrupts -------------------------------------------------------------------------------------------------
INTERRUPTS = [("ctrl-c", signal.SIGINT, {}), ("sigterm", signal.SIGTERM, {}),
              ("ctrl-c-in-background", signal.SIGINT, {"SIGINT_IGNORED": "1"})]


@needs_proc
@pytest.mark.parametrize("case", INTERRUPTS, ids=[c[0] for c in INTERRUPTS])
def test_an_interrupt_mid_write_is_one_line_and_leaves_nothing(case, tiny_model, tmp_path):
    """The signal to the whole process group (a terminal's Ctrl-C, `timeout`, a supervisor), also for a run a
    script started in the background (Ctrl-C ignored at start): exit 128 + signal, one line, no OUT, no partial
    directory, no worker."""
    _, sig, env = case
    out = tmp_path / "o.gguf"
    p = _start(tiny_model, out, env=env)
    try:
        kids = _workers(p, out, writing=True)
        os.killpg(p.pid, sig)
        _, err = p.communicate(timeout=WAIT_S)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate(timeout=WAIT_S)
    err = err.decode()
    assert p.returncode == 128 + sig, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    assert _error_lines(err) == [f"mixq: error: convert interrupted ({signal.Signals(sig).name})"], err[-2000:]
    assert _leftovers(tmp_path) == []  # neither OUT nor its partial directory
    assert _gone(kids) == []


def test_an_interrupt_in_process_is_exit_130_and_the_handlers_come_back(tiny_model, tmp_path, monkeypatch):
    """Through click's runner (as a program embedding mixq): Ctrl-C -> 130, SIGTERM -> 143, one line each, and the
    signal handlers are the caller's again afterwards."""
    from mixq.conversion.gguf import pipeline as gguf_pipeline

    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(gguf_pipeline, "_write", interrupted)
    r = _cli("convert", tiny_model, tmp_path / "o.gguf", *GGUF, "--threads", "1")
    assert r.exit_code == 130 and "Traceback" not in r.output, r.output[-2000:]
    assert _error_lines(r.stderr) == ["mixq: error: convert interrupted (SIGINT)"]

    def terminated(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to this (main) thread at once: raised here
        time.sleep(WAIT_S)
    monkeypatch.setattr(gguf_pipeline, "_write", terminated)
    r = _cli("convert", tiny_model, tmp_path / "o.gguf", *GGUF, "--threads", "1")
    assert r.exit_code == 143 and _error_lines(r.stderr) == ["mixq: error: convert interrupted (SIGTERM)"]
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before
    assert _leftovers(tmp_path) == []


# --- full disk, read-only place, a folder removed mid-run ----------------------------------------------------------
def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_mid_write_with_workers_leaves_nothing(tiny_model, tmp_path, monkeypatch):
    """ENOSPC from the writer while the pool encodes ahead: one line, no OUT, no partial, no worker left."""
    import gguf

    real = gguf.GGUFWriter.write_tensor_data
    calls = []

    def fills_up(self, *a, **k):
        calls.append(1)
        if len(calls) > 5:
            _enospc()
        return real(self, *a, **k)
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", fills_up)
    out = tmp_path / "o.gguf"
    line = _error_line(_cli("convert", tiny_model, out, *GGUF, "--threads", "2"))
    assert str(out) in line and "no space left" in line
    assert _leftovers(tmp_path) == [] and multiprocessing.active_children() == []


@contextmanager
def _file_size_limit() -> Iterator[Callable[[int], None]]:
    """Yields `limit(n)`: files of this process may grow to n bytes only (RLIMIT_FSIZE; Python ignores SIGXFSZ),
    so that the write crossing n really stops short, as on a disk that fills. The limit is lifted afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        yield lambda n: resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_gguf_short_write_is_one_line_and_leaves_nothing(tiny_model, tmp_path, monkeypatch):
    """The disk fills in the middle of a tensor's data: numpy's tofile reports the short write without an errno
    ("N requested and M written"); still one line naming OUT, no OUT, no partial directory."""
    import gguf

    real = gguf.GGUFWriter.write_tensor_data
    with _file_size_limit() as limit:
        def fills_up(self, tensor, *a, **k):
            if tensor.nbytes >= 1 << 16 and not getattr(self, "limited", False):  # half of this tensor fits
                fout = next(f for f, ts in zip(self.fout, self.tensors) if ts)
                fout.flush()
                start = -(-fout.tell() // self.data_alignment) * self.data_alignment
                limit(start + tensor.nbytes // 2)
                self.limited = True
            return real(self, tensor, *a, **k)
        monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", fills_up)
        out = tmp_path / "o.gguf"
        line = _error_line(_cli("convert", tiny_model, out, *GGUF, "--threads", "1"))
    assert line.startswith(f"mixq: error: {out}: no space left on the device while writing"), line
    assert "bytes written" in line  # how short the write stopped
    assert _leftovers(tmp_path) == []


def test_imatrix_short_write_is_one_line_and_leaves_nothing(tiny_model, tmp_path, monkeypatch):
    """`mixq imatrix` whose file outgrows the disk inside its first (1 MiB) sums tensor: one line, no file and no
    temporary left."""
    from mixq.conversion.gguf import imatrix
    from mixq.formats.imatrix_file import IMatrix

    im = IMatrix(datasets=["t"], chunk_count=1)
    im.add("blk.0.attn_output.weight", np.ones((64, 4096)), 1.0)
    monkeypatch.setattr(imatrix, "collect_imatrix", lambda *a, **k: im)
    out = tmp_path / "o.imatrix.gguf"
    with _file_size_limit() as limit:
        limit(1 << 16)  # the header and tensor infos take a few hundred bytes
        line = _error_line(_cli("imatrix", tiny_model, out))
    assert line.startswith(f"mixq: error: {out}: no space left on the device while writing"), line
    assert _leftovers(tmp_path) == []


def test_exl3_short_write_in_a_library_is_one_line(tiny_model, tmp_path, monkeypatch, cheap_exl3):
    """safetensors reports a write the disk cut short as "failed to write whole buffer" (no errno): one line
    naming OUT with the way on, and nothing that looks finished."""
    import safetensors.torch
    from safetensors import SafetensorError

    def short(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\x00" * 100)  # what reached the disk
        raise SafetensorError("Error while serializing: I/O error: failed to write whole buffer")
    _after_stages(monkeypatch, 2, lambda: monkeypatch.setattr(safetensors.torch, "save_file", short))
    out = tmp_path / "e"
    r = _cli("convert", tiny_model, out, *EXL3)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output[-2000:]
    lines = _error_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"mixq: error: {out}: no space left on the device"), lines
    assert "--resume" in lines[0]
    assert not (out / "config.json").exists() and not list(out.glob("*.safetensors"))
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]  # the cut part file is gone


def _remove_mid_write(monkeypatch, victim: Callable[[], Path], after: int = 3) -> None:
    """Delete the directory `victim()` (and everything in it) while the GGUF writer is at tensor `after`."""
    import gguf

    real = gguf.GGUFWriter.write_tensor_data
    calls = []

    def removes(self, *a, **k):
        calls.append(1)
        if len(calls) == after:
            shutil.rmtree(victim())
        return real(self, *a, **k)
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", removes)


@pytest.mark.parametrize("what", ["partial-dir", "parent-dir"])
def test_a_folder_removed_mid_write_is_one_line(what, tiny_model, tmp_path, monkeypatch):
    """The run's temporary directory, or OUT's own directory, deleted while the GGUF is written: one line naming
    OUT, and nothing that looks finished."""
    import mixq.formats.gguf_writer as gw

    out = tmp_path / "sub" / "o.gguf"
    out.parent.mkdir()
    made: list[Path] = []
    real_make = gw.make_partial_dir
    monkeypatch.setattr(gw, "make_partial_dir", lambda *a, **k: made.append(real_make(*a, **k)) or made[-1])
    _remove_mid_write(monkeypatch, (lambda: made[0]) if what == "partial-dir" else (lambda: out.parent))
    line = _error_line(_cli("convert", tiny_model, out, *GGUF, "--threads", "1"))
    assert str(out) in line and "removed during the run" in line
    assert not out.exists() and (not out.parent.exists() or _leftovers(out.parent) == [])


EXL3 = ["--bpw", "4", "--rows", "2", "--seq-len", "16", "--device", "cpu"]


@pytest.fixture
def cheap_exl3(monkeypatch):
    """EXL3 conversions in seconds: conftest's well-formed random trellis codes instead of the encoder."""
    from conftest import cheap_trellis
    from mixq.quant import trellis

    monkeypatch.setattr(trellis, "quantize", cheap_trellis)


def _after_stages(monkeypatch, n: int, then: Callable[[], None]) -> None:
    """Run `then()` once the EXL3 job has recorded `n` finished stages."""
    from mixq.conversion.job import Job

    real = Job.record
    calls = []

    def record(self, *a, **k):
        real(self, *a, **k)
        calls.append(1)
        if len(calls) == n:
            then()
    monkeypatch.setattr(Job, "record", record)


def test_exl3_out_removed_mid_run_is_one_line(tiny_model, tmp_path, monkeypatch, cheap_exl3):
    """OUT (an EXL3 directory, with its resume state) deleted after a stage: one line naming OUT, nothing that
    looks like a finished EXL3 directory."""
    out = tmp_path / "e"
    _after_stages(monkeypatch, 2, lambda: shutil.rmtree(out))
    r = _cli("convert", tiny_model, out, *EXL3)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output[-2000:]
    lines = _error_lines(r.stderr)  # the EXL3 progress bars move the cursor: read past their escapes
    assert len(lines) == 1 and str(out) in lines[0] and "removed during the run" in lines[0], r.stderr[-1500:]
    assert not (out / "config.json").exists() and not list(out.glob("*.safetensors"))


def test_exl3_disk_full_in_a_library_write_is_one_line(tiny_model, tmp_path, monkeypatch, cheap_exl3):
    """safetensors reports a full disk in its own exception type: still one line naming OUT, with the way on."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(tensors, filename, metadata=None):
        raise SafetensorError(f'Error while serializing: I/O error: No space left on device (os error 28) at path '
                              f'"{filename}"')
    _after_stages(monkeypatch, 2, lambda: monkeypatch.setattr(safetensors.torch, "save_file", full))
    out = tmp_path / "e"
    r = _cli("convert", tiny_model, out, *EXL3)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output[-2000:]
    lines = _error_lines(r.stderr)
    assert len(lines) == 1 and str(out) in lines[0] and "no space left" in lines[0] and "--resume" in lines[0]
    assert not (out / "config.json").exists()


def test_exl3_interrupt_keeps_only_the_resumable_state(tiny_model, tmp_path, monkeypatch, cheap_exl3):
    """Ctrl-C mid-run: exit 130, one line; OUT holds the job state --resume continues from, nothing finished."""
    def interrupt():
        raise KeyboardInterrupt
    _after_stages(monkeypatch, 2, interrupt)
    out = tmp_path / "e"
    r = _cli("convert", tiny_model, out, *EXL3)
    assert r.exit_code == 130 and "Traceback" not in r.output, r.output[-2000:]
    assert _error_lines(r.stderr) == ["mixq: error: convert interrupted (SIGINT)"]
    assert (out / ".mixq-job" / "job.json").is_file()
    assert not (out / "config.json").exists() and not list(out.glob("*.safetensors"))


# --- compare --plot / --markdown ----------------------------------------------------------------------------------
def _savefig_fails(monkeypatch, err: int, what: str):
    import matplotlib.figure

    def fails(self, fname, *a, **k):
        Path(fname).write_bytes(b"\x89PNG half")  # a partial file, as a real full disk leaves
        raise OSError(err, what, str(fname))
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", fails)


def _erofs(*a, **k):
    raise OSError(errno.EROFS, "Read-only file system")


PLOT_FAULTS = [
    ("disk-full", lambda mp, d: _savefig_fails(mp, errno.ENOSPC, "No space left on device"), "no space left"),
    ("read-only-at-write", lambda mp, d: _savefig_fails(mp, errno.EROFS, "Read-only file system"),
     "read-only filesystem"),
    ("read-only-up-front", lambda mp, d: mp.setattr("mixq.formats.outputs.tempfile.mkstemp", _erofs),
     "read-only filesystem"),
    ("folder-removed", lambda mp, d: _savefig_fails(mp, errno.ENOENT, "No such file or directory"),
     "removed during the run"),
]


@pytest.mark.parametrize("case", PLOT_FAULTS, ids=[c[0] for c in PLOT_FAULTS])
def test_a_plot_that_cannot_be_written_is_one_line(case, tmp_path, monkeypatch):
    _, fault, needle = case
    rep = write_compare_report(tmp_path)
    out = tmp_path / "plots"
    out.mkdir()
    fault(monkeypatch, out)
    line = _error_line(_cli("compare", rep, "--plot", out / "kld.png"))
    assert needle in line and "kld.png" in line
    assert _leftovers(out) == []  # no PNG, no temporary


def test_markdown_on_a_full_disk_is_one_line(tmp_path, monkeypatch):
    rep = write_compare_report(tmp_path)
    monkeypatch.setattr("mixq.formats.atomic.os.fsync", _enospc)
    line = _error_line(_cli("compare", rep, "--markdown", tmp_path / "t.md"))
    assert "t.md" in line and "no space left" in line
    assert _leftovers(tmp_path) == ["r.json"]


def test_a_plot_into_a_new_folder_creates_it(tmp_path):
    rep = write_compare_report(tmp_path)
    png = tmp_path / "new" / "dir" / "kld.png"
    r = _cli("compare", rep, "--plot", png)
    assert r.exit_code == 0, r.output[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and _leftovers(png.parent) == ["kld.png"]


def test_a_failed_write_never_hides_its_error_behind_the_cleanup(tmp_path):
    """The folder of a temporary file replaced by a file mid-write: the write's own error comes out (ENOSPC
    here), not the cleanup's NotADirectoryError."""
    d = tmp_path / "d"
    d.mkdir()
    with pytest.raises(OSError) as ei:
        with atomic_path(d / "f.bin") as tmp:
            tmp.write_bytes(b"x")
            shutil.rmtree(d)
            d.write_bytes(b"a file now")
            _enospc()
    assert ei.value.errno == errno.ENOSPC
