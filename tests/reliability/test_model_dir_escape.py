"""A model directory is untrusted: no index entry, symbolic link or config value makes mixq open a file outside it.

Each case edits a copy of the two-shard FP8 tiny model so that one file it names lives outside MODEL (a real shard
there, which would convert and verify if it were followed, or /etc/passwd). Every command that reads a model is
run with every file open audited (Python's open events and the safetensors library's safe_open): the command
ends in one `mixq: error:` line naming the entry, and nothing outside MODEL was opened.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import safetensors

from cli_helpers import copy_model, error_line, run_cli

INDEX = "model.safetensors.index.json"
SHARD2 = "model-00002-of-00002.safetensors"

_AUDIT: dict[str, list[str] | None] = {"opened": None}


def _audit_hook(event: str, args: tuple) -> None:
    # Audit hooks cannot be removed: this one records only while a case runs
    if _AUDIT["opened"] is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _AUDIT["opened"].append(os.fsdecode(args[0]))


sys.addaudithook(_audit_hook)


@contextmanager
def audited_opens(monkeypatch):
    """Collect every path opened in this process (Python opens and safetensors' safe_open) inside the block."""
    opened: list[str] = []
    real = safetensors.safe_open

    def recording_safe_open(filename, *args, **kwargs):
        opened.append(os.fsdecode(filename))
        return real(filename, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", recording_safe_open)
    _AUDIT["opened"] = opened
    try:
        yield opened
    finally:
        _AUDIT["opened"] = None


def _point_index(d: Path, value) -> None:
    """Every weight_map entry of shard 2 now names `value`."""
    idx = json.loads((d / INDEX).read_text())
    idx["weight_map"] = {k: (value if v == SHARD2 else v) for k, v in idx["weight_map"].items()}
    (d / INDEX).write_text(json.dumps(idx))


def _relative_outside(d: Path, outside: Path) -> None:
    shutil.move(d / SHARD2, outside / SHARD2)
    _point_index(d, f"../outside/{SHARD2}")


def _absolute_outside(d: Path, outside: Path) -> None:
    shutil.move(d / SHARD2, outside / SHARD2)
    _point_index(d, str(outside / SHARD2))


def _passwd(d: Path, outside: Path) -> None:
    _point_index(d, "../../../../../../../../etc/passwd")


def _shard_link(d: Path, outside: Path) -> None:
    shutil.move(d / SHARD2, outside / SHARD2)
    (d / SHARD2).symlink_to(outside / SHARD2)


def _config_link(d: Path, outside: Path) -> None:
    shutil.move(d / "config.json", outside / "config.json")
    (d / "config.json").symlink_to(outside / "config.json")


def _tokenizer_link(d: Path, outside: Path) -> None:
    shutil.move(d / "tokenizer.json", outside / "tokenizer.json")
    (d / "tokenizer.json").symlink_to(outside / "tokenizer.json")


def _index_link(d: Path, outside: Path) -> None:
    shutil.move(d / INDEX, outside / INDEX)
    (d / INDEX).symlink_to(outside / INDEX)


# (case, edit, fragment the error names)
ESCAPES = [
    ("index-relative", _relative_outside, f"../outside/{SHARD2}"),
    ("index-absolute", _absolute_outside, "absolute path"),
    ("index-etc-passwd", _passwd, "etc/passwd"),
    ("shard-symlink", _shard_link, SHARD2),
    ("config-symlink", _config_link, "config.json"),
    ("tokenizer-symlink", _tokenizer_link, "tokenizer.json"),
    ("index-symlink", _index_link, INDEX),
]

COMMANDS = {
    "inspect": lambda m, o: ["inspect", m],
    "plan": lambda m, o: ["plan", m, "--format", "gguf", "--type", "Q8_0"],
    "convert-exl3": lambda m, o: ["convert", m, o / "x-exl3", "--bpw", "4", "--device", "cpu"],
    "convert-gguf": lambda m, o: ["convert", m, o / "x.gguf", "--type", "Q8_0", "--threads", "1"],
    "imatrix": lambda m, o: ["imatrix", m, o / "x.imatrix.gguf", "--rows", "2", "--seq-len", "16",
                             "--device", "cpu"],
    "eval": lambda m, o: ["eval", m, "--text", m / "config.json.txt", "--save-ref", o / "ref.bin", "--ctx", "16",
                          "--windows", "1", "--device", "cpu"],
}


@pytest.fixture
def layout(tiny_fp8_model, tmp_path):
    """(model, outside, outputs): a writable copy of the model, the folder beside it, an output folder."""
    model = copy_model(tiny_fp8_model, tmp_path / "model")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not a model file")
    outs = tmp_path / "outs"
    outs.mkdir()
    (model / "config.json.txt").write_text("held-out text " * 50)  # eval's --text, inside MODEL
    return model, outside, outs


def _outside_opened(opened: list[str], model: Path, outside: Path) -> list[str]:
    model = model.resolve()
    bad = []
    for p in opened:
        r = Path(p).resolve()
        if r == Path("/etc/passwd") or outside.resolve() in r.parents:
            bad.append(p)
    return bad


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", ESCAPES, ids=[c[0] for c in ESCAPES])
def test_no_file_outside_the_model_directory_is_opened(case, command, layout, monkeypatch):
    _, edit, fragment = case
    model, outside, outs = layout
    edit(model, outside)
    with audited_opens(monkeypatch) as opened:
        r = run_cli(*COMMANDS[command](model, outs))
    line = error_line(r)
    assert fragment in line, line
    assert "outside" in line or "absolute" in line, line
    assert _outside_opened(opened, model, outside) == []
    assert list(outs.iterdir()) == []


@pytest.mark.parametrize("value", [7, None, "", ["a"]], ids=["number", "null", "empty", "list"])
def test_weight_map_values_that_are_not_file_names(value, layout):
    model, _, outs = layout
    _point_index(model, value)
    line = error_line(run_cli("convert", model, outs / "x.gguf", "--type", "Q8_0", "--threads", "1"))
    assert INDEX in line and "weight_map" in line and repr(value) in line
    assert list(outs.iterdir()) == []


def test_links_inside_the_model_directory_still_work(layout):
    """A shard that is a link to another file inside MODEL (as hub snapshots and dedup tools make) reads."""
    model, _, outs = layout
    (model / "blobs").mkdir()
    shutil.move(model / SHARD2, model / "blobs" / "b1")
    (model / SHARD2).symlink_to(Path("blobs") / "b1")
    r = run_cli("inspect", model, "--json")
    assert r.exit_code == 0, r.output[-2000:]
    assert len(json.loads(r.stdout)["tensors"]) > 0


def test_a_hub_snapshot_may_link_into_its_blobs(tiny_model, tmp_path):
    """The hub's cache layout: snapshots/<rev>/FILE -> ../../blobs/<hash>, the repo folder is the trust root."""
    repo = tmp_path / "models--org--tiny"
    snap = repo / "snapshots" / "abc123"
    blobs = repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in sorted(tiny_model.iterdir()):
        shutil.copy(f, blobs / f.name)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / f.name)
    r = run_cli("inspect", snap, "--json")
    assert r.exit_code == 0, r.output[-2000:]
    # but a link from the snapshot out of the repo folder is refused
    (snap / "config.json").unlink()
    shutil.copy(tiny_model / "config.json", tmp_path / "config.json")
    (snap / "config.json").symlink_to(tmp_path / "config.json")
    assert "outside" in error_line(run_cli("inspect", snap))


@pytest.mark.parametrize("how", ["manifest-entry", "shard-symlink"])
def test_an_exl3_directory_cannot_point_outside_itself(how, tiny_exl3_cheap, tmp_path, monkeypatch):
    """EXL3 directories are read by verify and eval as untrusted input too."""
    d = tmp_path / "exl3"
    shutil.copytree(tiny_exl3_cheap, d, symlinks=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    shard = sorted(d.glob("*.safetensors"))[0]
    shutil.move(shard, outside / shard.name)
    if how == "shard-symlink":
        shard.symlink_to(outside / shard.name)
    else:
        man = json.loads((d / "mixq_manifest.json").read_text())
        man["shards"] = {f"../outside/{shard.name}": v for v in man["shards"].values()}
        (d / "mixq_manifest.json").write_text(json.dumps(man))
    with audited_opens(monkeypatch) as opened:
        line = error_line(run_cli("verify", d))
    assert shard.name in line and "outside" in line
    assert _outside_opened(opened, d, outside) == []


def test_an_eval_candidate_directory_cannot_point_outside_itself(tiny_exl3_cheap, tiny_model, tmp_path, monkeypatch):
    """A candidate's config.json is read to tell its format: a link out of the directory is refused before."""
    d = tmp_path / "cand"
    shutil.copytree(tiny_exl3_cheap, d, symlinks=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(d / "config.json", outside / "config.json")
    (d / "config.json").symlink_to(outside / "config.json")
    (tmp_path / "text.txt").write_text("held-out words " * 50)
    with audited_opens(monkeypatch) as opened:
        line = error_line(run_cli("eval", tiny_model, d, "--text", tmp_path / "text.txt", "--ctx", "16",
                                  "--windows", "1", "--device", "cpu"))
    assert "config.json" in line and "outside" in line
    assert _outside_opened(opened, d, outside) == []
