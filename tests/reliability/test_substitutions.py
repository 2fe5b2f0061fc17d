"""Whatever mixq writes other than what was asked is said or refused: a type asked for a tensor (--tensor-type,
--override, --output-tensor-type) that its rows cannot hold is written in its shape fallback with one
`mixq: warning:` line naming the tensor, the type asked and by what, the type written and why; an imatrix that
holds no importance data (no entries, or none that saw a token) is refused in one line naming the file."""
from __future__ import annotations

import json
import re
import struct
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest

from cli_helpers import error_line, run_cli
from mixq.formats.imatrix_file import IMatrix, write_imatrix

EXPS_RULE = "ffn_.*_exps=IQ2_XXS"
WARNING = re.compile(r"^mixq: warning: (?P<name>\S+)(?: and (?P<more>\d+) more)?: written as (?P<written>\w+), "
                     r"not the (?P<asked>\w+) asked by (?P<by>.+): rows of (?P<ne0>\d+) values are not a multiple "
                     r"of (?P=asked)'s (?P<block>\d+)-value blocks$")


def _warnings(stderr: str) -> list[re.Match]:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("mixq: warning")]
    found = [WARNING.match(ln) for ln in lines]
    assert all(found), lines
    return found


def _types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def test_tensor_type_on_rows_it_cannot_hold_is_said(mini_model, tmp_path):
    """glm5next-mini's expert rows are not multiples of 256: IQ2_XXS becomes IQ4_NL, and every such tensor of the
    written file is counted in a warning naming the rule."""
    out = tmp_path / "o.gguf"
    r = run_cli("convert", mini_model, out, "--type", "Q8_0", "--tensor-type", EXPS_RULE, "--threads", "1")
    assert r.exit_code == 0, r.output[-2000:]
    written = _types(out)
    exps = {n: t for n, t in written.items() if re.search(r"ffn_.*_exps", n)}
    assert exps and set(exps.values()) == {"IQ4_NL"}, exps
    warned = _warnings(r.stderr)
    assert warned
    for m in warned:
        assert m["by"] == f"--tensor-type {EXPS_RULE}" and m["asked"] == "IQ2_XXS" and m["block"] == "256"
        assert m["written"] == written[m["name"]] and int(m["ne0"]) % 256 != 0
    assert sum(1 + int(m["more"] or 0) for m in warned) == len(exps)


def test_output_tensor_type_on_rows_it_cannot_hold_is_said(tiny_model, tmp_path):
    out = tmp_path / "o.gguf"
    r = run_cli("convert", tiny_model, out, "--type", "Q8_0", "--output-tensor-type", "Q4_K", "--threads", "1")
    assert r.exit_code == 0, r.output[-2000:]
    (m,) = _warnings(r.stderr)
    assert (m["name"], m["more"], m["by"], m["asked"]) == ("output.weight", None, "--output-tensor-type Q4_K", "Q4_K")
    assert m["written"] == _types(out)["output.weight"] == "Q5_0"


def test_override_on_rows_it_cannot_hold_is_said_by_plan(tiny_model):
    """plan and convert share the planner: plan says it too, for each routed-expert stack (rows of 128), and its
    JSON shows the type written."""
    r = run_cli("plan", tiny_model, "--format", "gguf", "--type", "Q4_K_M", "--override", "routed_expert=IQ2_XS",
                "--json")
    assert r.exit_code == 0, r.output[-2000:]
    warned = _warnings(r.stderr)
    assert {(m["asked"], m["written"], m["by"], m["ne0"]) for m in warned} == {
        ("IQ2_XS", "IQ4_NL", "--override routed_expert=IQ2_XS", "128")}
    planned = {t["name"]: t["type"] for t in json.loads(r.stdout)["tensors"]}
    exps = [n for n in planned if re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight", n)]
    assert exps and {planned[n] for n in exps} == {"IQ4_NL"}
    assert sum(1 + int(m["more"] or 0) for m in warned) == len(exps)


def test_a_type_the_rows_hold_is_not_warned(k256_model, tmp_path):
    """k256's expert rows are multiples of 256: the type asked is the type planned, and nothing is said."""
    r = run_cli("plan", k256_model, "--format", "gguf", "--type", "Q4_K_M", "--override", "routed_expert=Q2_K")
    assert r.exit_code == 0, r.output[-2000:]
    assert "mixq: warning" not in r.stderr, r.stderr


# --- imatrix files without importance data ----------------------------------------------------------------------
def _imatrix(path: Path, entries: dict[str, float]) -> Path:
    im = IMatrix(datasets=["t"], chunk_count=1)
    for name, count in entries.items():
        im.add(name, np.ones((1, 128)), count)
    return write_imatrix(path, im)


def _legacy_empty(path: Path) -> Path:
    path.write_bytes(struct.pack("<i", 0))
    return path


IMATRIX_CASES = [
    ("gguf-no-entries", lambda p: _imatrix(p / "e.imatrix.gguf", {}), "has no entries"),
    ("legacy-no-entries", lambda p: _legacy_empty(p / "e.dat"), "has no entries"),
    ("counts-all-zero", lambda p: _imatrix(p / "z.imatrix.gguf", {"blk.0.attn_output.weight": 0.0,
                                                                   "blk.1.attn_output.weight": 0.0}),
     "entries for this model's tensors hold no data (every token count is 0)"),
]


@pytest.mark.parametrize("case", IMATRIX_CASES, ids=[c[0] for c in IMATRIX_CASES])
def test_an_imatrix_without_data_is_refused(case, tiny_model, tmp_path):
    _, make, needle = case
    imx = make(tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    line = error_line(run_cli("convert", tiny_model, out_dir / "o.gguf", "--type", "Q8_0", "--threads", "1",
                              "--imatrix", imx))
    assert f"--imatrix {imx}" in line and needle in line, line
    assert not list(out_dir.iterdir())


def test_an_imatrix_with_some_zero_counts_is_used(tiny_model, tmp_path):
    """Entries that saw no token beside ones that did are normal (a never-routed expert): converted."""
    imx = _imatrix(tmp_path / "z.imatrix.gguf", {"blk.0.attn_output.weight": 0.0, "blk.1.attn_output.weight": 4.0})
    out = tmp_path / "o.gguf"
    r = run_cli("convert", tiny_model, out, "--type", "Q8_0", "--threads", "1", "--imatrix", imx)
    assert r.exit_code == 0 and out.is_file(), r.output[-2000:]


def test_imatrix_that_collects_nothing_writes_nothing(tiny_model, tmp_path, monkeypatch):
    from mixq.conversion.gguf import imatrix

    monkeypatch.setattr(imatrix, "collect_imatrix", lambda *a, **k: IMatrix(datasets=["t"], chunk_count=1))
    out = tmp_path / "o.imatrix.gguf"
    line = error_line(run_cli("imatrix", tiny_model, out))
    assert str(out) in line and "no tensor importance data" in line
    assert Counter(p.name for p in tmp_path.iterdir()) == Counter()
