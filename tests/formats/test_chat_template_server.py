"""The real engine: llama-server (built with cmake from the llama.cpp vendored in llama-cpp-python 0.3.36,
-DGGML_NATIVE=OFF) loads mixq's GGUF of glm5next-mini; with the fixed chat template it reports tool-call support
and applies the template to a tool-call conversation, with the original template it does not."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from mixq.formats.chat_template import sample_conversations


def _glm_like_template() -> str:
    """The GLM-style template with numeric attribute access used by test_chat_template.py."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_chat_template_cases", Path(__file__).with_name("test_chat_template.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.GLM_LIKE

pytestmark = pytest.mark.slow


def _server_binary() -> Path:
    cand = (os.environ.get("MIXQ_LLAMA_SERVER") or shutil.which("llama-server")
            or Path(__file__).resolve().parents[3] / "vendor" / "llama-build" / "bin" / "llama-server")
    p = Path(cand)
    if not p.is_file():
        pytest.skip("llama-server not built (set MIXQ_LLAMA_SERVER; bench/tools/llamacpp_tools.py builds it)")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(port: int, path: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


class _Server:
    """One llama-server on loopback for a GGUF; stopped on exit (bounded waits, no outside traffic)."""

    def __init__(self, binary: Path, gguf: Path, log: Path):
        self.port = _free_port()
        self.log = log.open("w")
        self.proc = subprocess.Popen([str(binary), "-m", str(gguf), "--jinja", "--host", "127.0.0.1",
                                      "--port", str(self.port), "-c", "512", "-t", "2", "--no-warmup"],
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, seconds: float = 120) -> bool:
        end = time.time() + seconds
        while time.time() < end:
            if self.proc.poll() is not None:
                return False
            try:
                if _http(self.port, "/health")[0] == 200:
                    return True
            except OSError:
                pass
            time.sleep(0.5)
        return False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _gguf_with_template(model: Path, out: Path, template: str, fix: bool) -> Path:
    from mixq.conversion.gguf.pipeline import convert_gguf

    t = out.with_suffix(".jinja")
    t.write_text(template)
    convert_gguf(model, out, qtype="BF16", chat_template=t, fix_chat_template=fix, no_mtp=True, progress=False)
    return out


def test_llama_server_reports_tool_support_only_for_the_fixed_template(mini_model, tmp_path):
    binary = _server_binary()
    GLM_LIKE = _glm_like_template()
    conv = next(c for c in sample_conversations() if any(m.get("tool_calls") for m in c["messages"]))
    body = {"messages": conv["messages"], "tools": conv.get("tools", [])}

    fixed = _gguf_with_template(mini_model, tmp_path / "fixed.gguf", GLM_LIKE, fix=True)
    with _Server(binary, fixed, tmp_path / "fixed.log") as srv:
        assert srv.wait_ready(), (tmp_path / "fixed.log").read_text()[-3000:]
        status, props = _http(srv.port, "/props")
        assert status == 200
        caps = props["chat_template_caps"]
        assert caps["supports_tool_calls"] is True and caps["supports_tools"] is True, caps
        status, res = _http(srv.port, "/apply-template", body)
        assert status == 200, res
        assert "<tool_call>get_weather" in res["prompt"], res

    orig = _gguf_with_template(mini_model, tmp_path / "orig.gguf", GLM_LIKE, fix=False)
    with _Server(binary, orig, tmp_path / "orig.log") as srv:
        assert srv.wait_ready(), (tmp_path / "orig.log").read_text()[-3000:]
        status, props = _http(srv.port, "/props")
        caps = props.get("chat_template_caps", {})
        status, res = _http(srv.port, "/apply-template", body)
        # the chained `.0.0` access breaks tool-call rendering: no tool support, or the request is refused
        assert status == 400 and "template" in json.dumps(res), (caps, status, res)  # the HTTP 400 users hit
