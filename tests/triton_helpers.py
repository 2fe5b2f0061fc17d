"""Triton for the kernel tests: a test that needs it skips where it is absent, except under CI (the CI variable set,
as .ci/run sets it), where a missing Triton fails the test: CI installs it, so a skip there would hide the kernels."""
from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import signal
import subprocess
import sys
from types import ModuleType

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require(module: str = "triton") -> ModuleType:
    """`module` imported; outside CI a skip when it cannot be, under CI a failure."""
    if not under_ci():
        return pytest.importorskip(module)
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"{module} cannot be imported under CI ({e}); .ci/run installs Triton, so the kernel tests "
                    "must run", pytrace=False)


# --- Triton's interpreter in one warm process ---------------------------------------------------------------------
# The kernel tests run their scripts in a process with TRITON_INTERPRET=1 (it must be set before triton is
# imported). Starting Python, torch, triton and mixq takes seconds of CPU per script; the server below imports them
# once and forks a fresh child per script, so each script still starts from untouched modules (the scripts patch
# module state freely) and a crash or a hang stays its own.
_SERVER = r"""
import importlib, json, os, sys, tempfile, traceback
import numpy, torch, triton  # noqa: F401
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a script that needs the module reports the error itself
        pass
for line in sys.stdin:
    job = json.loads(line)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            code = 0
            try:
                sys.argv = ["-c", *job["args"]]
                exec(compile(job["script"], "<script>", "exec"), {"__name__": "__main__"})
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:  # noqa: BLE001 - reported as a failed run, as a fresh interpreter would
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status),
                          "stdout": out.read().decode(errors="replace"),
                          "stderr": err.read().decode(errors="replace")}), flush=True)
"""
# modules the kernel scripts import: imported once in the server (each import costs every script it serves)
_WARM = ("mixq.quant.ggml.encoders", "mixq.quant.ggml.rounding.hessian", "mixq.quant.ggml.rounding.block_tuning",
         "mixq.quant.ggml.rounding.levels", "mixq.quant.ggml.triton_kernels.search",
         "mixq.quant.ggml.triton_kernels.descent", "mixq.quant.ggml.triton_kernels.grid",
         "mixq.quant.ggml.triton_kernels.iq2s", "mixq.quant.ggml.triton_kernels.iq2s_descent",
         "mixq.quant.ggml.triton_kernels.subscales", "mixq.quant.ggml.triton_kernels.refine",
         "mixq.quant.ggml.triton_kernels.iq2_decode", "mixq.quant.ggml.i_quants.torch_grid",
         "mixq.quant.ggml.k_quants.torch_search", "mixq.quant.trellis.viterbi", "mixq.quant.trellis.viterbi_fused",
         "mixq.quant.trellis.codebooks")
_server: subprocess.Popen | None = None


def _kill_server() -> None:
    """The server and a script it is running (its own process group), gone."""
    global _server
    if _server is not None:
        try:
            os.killpg(_server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _server.wait()
    _server = None


def _stop_server() -> None:
    if _server is not None and _server.poll() is None:
        _server.stdin.close()
        try:
            _server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    _kill_server()


def interpret(script: str, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    """`python -c script *args` with TRITON_INTERPRET=1, as a fresh process would run it (stdout, stderr and exit
    status), forked from a process that has imported torch, triton and the kernel modules once."""
    global _server
    require("triton")
    if _server is None or _server.poll() is not None:
        _kill_server()
        # the tests' folder importable, as under pytest: a script may import a test module, which imports this one
        path = os.pathsep.join(p for p in (os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH"))
                               if p)
        _server = subprocess.Popen([sys.executable, "-c", _SERVER, *_WARM], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, start_new_session=True,
                                   env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path))
        atexit.register(_stop_server)
    try:
        _server.stdin.write(json.dumps({"script": script, "args": list(args)}) + "\n")
        _server.stdin.flush()
        ready, _, _ = select.select([_server.stdout], [], [], timeout)
        line = _server.stdout.readline() if ready else ""
    except BaseException:  # a test's timeout or an interrupt mid-script: its answer must not reach the next one
        _kill_server()
        raise
    if not line:
        _kill_server()
        raise AssertionError(f"the interpreted script did not answer within {timeout:.0f} s (or its server died)")
    r = json.loads(line)
    return subprocess.CompletedProcess([sys.executable, "-c", "<script>", *args], r["returncode"], r["stdout"],
                                       r["stderr"])
