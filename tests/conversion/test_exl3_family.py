"""EXL3 families (conversion/exl3/family.py): `--format exl3 --bpw x,y,z` writes one directory per member from one set
of error curves; each member verified, byte-identical to the same member converted alone with those curves, kept
on a rerun, scored by `mixq eval` of the family directory and listed by `mixq card`.

The trellis encoder needs minutes per member on a CPU, so the conversions here use tests/conversion/
test_exl3_convert.py's deterministic stand-in (same API and layout; its output depends on the weight, the rate and
the member's own calibration Hessians, so planning, calibration and byte identity are still exercised). The
curves are measured for real, with `--measure proxy` (one calibration pass, seconds).
"""
from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from cli_helpers import error_line, run_cli
from mixq.api import card, convert, evaluate, inspect
from mixq.conversion.exl3 import family as exl3_family
from mixq.errors import InputError
from mixq.eval.family import expand_families
from mixq.formats.exl3_reader import verify_exl3
from mixq.formats.receipt import read_receipt_json, receipt_json_path
from mixq.formats.safetensors_io import sha256_file

from .test_exl3_convert import FAKE_TRELLIS

MODEL = "glm5next-mini"
BPWS = (2.5, 3.05, 4.0)
SETTINGS = {"rows": 4, "seq_len": 64, "device": "cpu", "progress": False}
CURVES = f"{MODEL}.exl3-curves.json"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: on a shared 2-core machine a 2-thread pool spins against other work (a member took
    ~15 s instead of ~1 s), and the byte-identity test compares two runs of this process."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True, scope="module")
def fake_trellis():
    import mixq.quant

    fake = types.ModuleType("mixq.quant.trellis")
    exec(FAKE_TRELLIS, fake.__dict__)
    fake.__path__ = [str(Path(mixq.quant.__file__).parent / "trellis")]  # the package's other modules stay real
    mp = pytest.MonkeyPatch()
    mp.setitem(sys.modules, "mixq.quant.trellis", fake)
    mp.setattr(mixq.quant, "trellis", fake, raising=False)
    yield fake
    mp.undo()


def _family(mini_model, out: Path, **kw):
    return convert(mini_model, out, "exl3", **{"bpw": ",".join(f"{b:g}" for b in BPWS), **SETTINGS, **kw})


def _digests(d: Path) -> dict[str, str]:
    """sha256 of every file of a directory (a finished conversion leaves no job or timing files behind)."""
    return {str(f.relative_to(d)): sha256_file(f) for f in sorted(d.rglob("*")) if f.is_file()}


def _refuse(monkeypatch) -> None:
    """Any conversion or measurement from here on fails the test."""
    def boom(*a, **k):
        raise AssertionError("no conversion or measurement was expected")

    monkeypatch.setattr(exl3_family, "run_exl3", boom)
    monkeypatch.setattr(exl3_family, "resolve_measure", boom)


@pytest.fixture(scope="module")
def family(mini_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("exl3fam") / "mini-exl3"
    res = _family(mini_model, out, measure="proxy")
    return out, res


def test_members_named_sized_verified_with_receipts(family):
    out, res = family
    doc = json.loads((out / "family.json").read_text())
    assert doc["format"] == "exl3" and res.format == "exl3"
    assert [m["file"] for m in doc["members"]] == [f"{MODEL}-exl3-{b:g}bpw" for b in BPWS]
    curves = out / CURVES
    assert doc["curves"]["measured"] and doc["curves"]["method"] == "proxy"
    assert doc["curves"]["sha256"] == sha256_file(curves)
    for m, b in zip(doc["members"], BPWS):
        d = out / m["file"]
        assert m["target_bpw"] == b and abs(m["bpw"] - b) <= 0.05  # the achieved trellis rate
        assert m["bytes"] == sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        assert m["file_bpw"] == pytest.approx(m["bytes"] * 8 / doc["ref_params"])
        assert m["curves_sha256"] == doc["curves"]["sha256"] and not m["kept"]
        rep = verify_exl3(d)
        assert rep["ok"] and rep["problems"] == [], rep["problems"]
        assert rep["receipt"] == "checked"
        r = read_receipt_json(d)["receipt"]
        assert r["target"] == {"bpw": b} and r["source"] == MODEL
        assert r["calibration"]["curves"]["sha256"] == doc["curves"]["sha256"]
        assert r["calibration"]["layers"]["rows"] == SETTINGS["rows"]
    assert doc["members"][0]["bytes"] < doc["members"][1]["bytes"] < doc["members"][2]["bytes"]


def test_verify_names_a_receipt_that_disagrees_with_its_member(family, tmp_path):
    out, _ = family
    name = f"{MODEL}-exl3-2.5bpw"
    member = tmp_path / name
    shutil.copytree(out / name, member)
    side = receipt_json_path(member)
    doc = json.loads(receipt_json_path(out / name).read_text())
    side.write_text(json.dumps(doc))
    r = run_cli("verify", member, "--no-decode")
    assert r.exit_code == 0 and "receipt" in r.output and "checked" in r.output, r.output
    rates = doc["receipt"]["plan"]["rates"]
    first = next(iter(rates))
    doc["receipt"]["plan"]["rates"] = dict(rates, **{first: rates[first] + 1})
    side.write_text(json.dumps(doc))
    r = run_cli("verify", member, "--no-decode")
    assert r.exit_code == 1 and f"{name}.receipt.json: plan has trellis units per rate" in r.output, r.output
    side.write_text("{not json")
    assert f"{name}.receipt.json: not a receipt" in " ".join(verify_exl3(member)["problems"])
    side.unlink()
    rep = verify_exl3(member)
    assert rep["ok"] and rep["receipt"] is None  # a directory without a receipt is not a problem


def test_member_identical_to_its_single_conversion(family, mini_model, tmp_path):
    out, res = family
    m = res.members[1]
    single = tmp_path / "single"
    convert(mini_model, single, "exl3", bpw=BPWS[1], measure=out / CURVES, **SETTINGS)
    assert _digests(single) == _digests(out / m["file"])


def test_rerun_keeps_every_member(family, mini_model, monkeypatch):
    out, res = family
    before = {m["file"]: _digests(out / m["file"]) for m in res.members}
    _refuse(monkeypatch)
    again = _family(mini_model, out)  # no --measure: the family's own curves file is kept
    assert [m["kept"] for m in again.members] == [True, True, True]
    assert again.curves["sha256"] == res.curves["sha256"] and not again.curves["measured"]
    assert {m["file"]: _digests(out / m["file"]) for m in again.members} == before
    r = run_cli("convert", mini_model, out, "--format", "exl3", "--bpw", "2.5,3.05,4", "--rows", "4",
                "--seq-len", "64", "--device", "cpu", "--json")
    assert r.exit_code == 0, r.output[-2000:]
    assert [m["kept"] for m in json.loads(r.stdout)["members"]] == [True, True, True]


def test_interrupted_family_continues(family, mini_model, tmp_path, monkeypatch):
    out, res = family
    fresh = tmp_path / "fam"
    real = exl3_family.run_exl3
    calls: list[str] = []

    def second_fails(model, path, opts):
        calls.append(Path(path).name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a user's Ctrl-C
        return real(model, path, opts)

    monkeypatch.setattr(exl3_family, "run_exl3", second_fails)
    with pytest.raises(KeyboardInterrupt):
        _family(mini_model, fresh, measure=out / CURVES)
    listed = json.loads((fresh / "family.json").read_text())["members"]
    assert [m["file"] for m in listed] == [res.members[0]["file"]]  # the finished member, recorded at once
    monkeypatch.setattr(exl3_family, "run_exl3", real)
    again = _family(mini_model, fresh, measure=out / CURVES)
    assert [m["kept"] for m in again.members] == [True, False, False]
    for m in res.members:  # the same curves given as a file: the same bytes
        assert _digests(fresh / m["file"]) == _digests(out / m["file"])


def test_refusals_before_any_work(mini_model, tmp_path, monkeypatch):
    _refuse(monkeypatch)
    out = tmp_path / "fam"
    stray = out / f"{MODEL}-exl3-3.05bpw"
    stray.mkdir(parents=True)
    (stray / "notes.txt").write_text("not a member")
    with pytest.raises(InputError, match="mini-exl3-3.05bpw already exists"):
        _family(mini_model, out)
    assert sorted(p.name for p in out.iterdir()) == [stray.name]  # no curves, no family.json, no member
    with pytest.raises(InputError, match="--resume with a family"):
        _family(mini_model, tmp_path / "other", resume=True)
    assert "--resume with a family" in error_line(run_cli("convert", mini_model, tmp_path / "other", "--format",
                                                          "exl3", "--bpw", "2.5,3", "--resume"))
    with pytest.raises(InputError, match="given twice"):
        _family(mini_model, tmp_path / "other", bpw="3,3.0")
    assert not (tmp_path / "other").exists()


def test_eval_of_the_family_dir_scores_every_member(family, mini_model, heldout_text):
    out, res = family
    members, fams = expand_families([out])
    assert members == [str(out / m["file"]) for m in res.members] and all(Path(m).is_dir() for m in members)
    assert fams[0].format == "exl3"
    rep = evaluate(mini_model, [out], heldout_text, ctx=128, windows=2, device="cpu", progress=False)
    assert [c["path"] for c in rep["candidates"]] == members
    doc = json.loads((out / "family.json").read_text())
    for m, c in zip(doc["members"], rep["candidates"]):
        assert m["scores"]["kld_mean"] == c["kld_mean"] and m["scores"]["text_sha256"]
        side = json.loads(receipt_json_path(out / m["file"]).read_text())
        assert side["scores"]["kld_mean"] == c["kld_mean"] and side["receipt"]["target"] == {"bpw": m["target_bpw"]}
        assert verify_exl3(out / m["file"])["ok"]  # the scores sit beside the sealed directory, not in it
        info = inspect(out / m["file"])
        assert info["scores"]["kld_mean"] == c["kld_mean"] and "planned from curves" in info["receipt_summary"]


def test_card_of_an_exl3_family(family, mini_model, tmp_path):
    hub = pytest.importorskip("huggingface_hub")
    out, res = family
    d = card(out, base_model="example/glm5next-mini", overwrite=True)
    mc = hub.ModelCard.load(d["card"])
    assert mc.data.library_name == "exllamav3" and "exl3" in mc.data.tags
    assert mc.data.base_model_relation == "quantized"
    text = Path(d["card"]).read_text()
    assert f"# {MODEL} EXL3 family" in text and "GGUF" not in text
    for m in json.loads((out / "family.json").read_text())["members"]:
        row = next(ln for ln in text.splitlines() if f"`{m['file']}`" in ln)
        assert f"{m['bytes']:,}" in row and f"{m['bpw']:.3f}" in row
    assert f"huggingface-cli upload YOUR_NAME/{MODEL}-exl3 " in text and CURVES in text
