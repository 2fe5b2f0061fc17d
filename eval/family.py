"""Families in `mixq eval`: a candidate directory holding family.json (convert/family.py) stands for its members.

`expand_families(candidates)` replaces such a directory by its members' files (in family.json order), so the one
streamed forward of eval/api.py scores all of them against one reference pass (the reference's layers run once
for every candidate, eval/streamed.py). `record_scores(report, families, text)` then writes each member's scores
into family.json and into `<file>.receipt.json` beside it (formats/receipt.py): KLD figures are known only after
an evaluation, and the GGUF itself is sealed, so it is not rewritten.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from mixq.errors import FormatError, InputError
from mixq.formats.atomic import write_json
from mixq.formats.gguf_reader import read_gguf
from mixq.formats.receipt import read_receipt, write_receipt_json
from mixq.formats.safetensors_io import sha256_file

FAMILY_JSON = "family.json"  # the name convert/family.py writes (eval may not import convert's family module)
SCORE_KEYS = ("kld_mean", "kld_mean_err", "kld_p99", "top1", "top1_err", "ppl", "ppl_ref", "dppl", "positions")


@dataclass
class Family:
    """A family directory as eval sees it: its family.json and its members' first files."""
    root: Path
    doc: dict
    files: list[Path]


def read_family(root: str | Path) -> Family:
    """The family in directory `root` (InputError / FormatError naming family.json when it cannot be used)."""
    root = Path(root)
    fj = root / FAMILY_JSON
    try:
        doc = json.loads(fj.read_text())
    except OSError as e:
        raise InputError(f"{fj}: cannot read ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{fj}: not JSON ({e})") from None
    members = doc.get("members") if isinstance(doc, dict) else None
    if not isinstance(members, list) or not members or not all(isinstance(m, dict) and m.get("file")
                                                                for m in members):
        raise FormatError(f"{fj}: no members listed")
    files = [root / Path(m["file"]).name for m in members]  # names only: a member never lies outside its family
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise InputError(f"{fj}: member {missing[0].name} is missing")
    return Family(root, doc, files)


def is_family_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / FAMILY_JSON).is_file()


def expand_families(candidates: Sequence[str | Path]) -> tuple[list[str | Path], list[Family]]:
    """The candidates with every family directory replaced by its members, and the families met."""
    out: list[str | Path] = []
    fams: list[Family] = []
    for c in candidates:
        if is_family_dir(c):
            fam = read_family(c)
            fams.append(fam)
            out.extend(str(f) for f in fam.files)
        else:
            out.append(c)
    return out, fams


def _text_info(report: dict) -> dict:
    text = report.get("text") or ""
    info = {"text": Path(text).name if text else None, "ctx": report.get("ctx"), "windows": report.get("windows"),
            "score": report.get("score")}
    if text and Path(text).is_file():
        info["text_sha256"] = sha256_file(text)
    return info


def record_scores(report: dict, families: Sequence[Family]) -> None:
    """Each evaluated member's scores (SCORE_KEYS, the engine, the text and its sha256) into its family's
    family.json (`members[i].scores`) and its `<file>.receipt.json`, both written atomically."""
    if not families:
        return
    by_path = {Path(c["path"]).resolve(): c for c in report.get("candidates", [])}
    text = _text_info(report)
    for fam in families:
        for m, f in zip(fam.doc["members"], fam.files):
            c = by_path.get(f.resolve())
            if c is None:
                continue
            scores = {k: c.get(k) for k in SCORE_KEYS}
            scores.update(engine=c.get("engine", "torch"), reference=Path(report["reference"]).name, **text)
            m["scores"] = scores
            write_receipt_json(f, read_receipt(read_gguf(f).kv) or {}, scores)
        write_json(fam.root / FAMILY_JSON, fam.doc)
