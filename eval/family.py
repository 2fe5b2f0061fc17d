"""Families in `mixq eval`: a candidate directory holding family.json (conversion/gguf/family.py, conversion/exl3/family.py)
stands for its members: GGUF files, or EXL3 directories (family.json "format": "exl3"; a member is a directory
holding config.json).

`expand_families(candidates)` replaces such a directory by its members (in family.json order), so the one
streamed forward of eval/api.py scores all of them against one reference pass (the reference's layers run once
for every candidate, eval/streamed.py). `record_scores(report, families, text)` then writes each member's scores
into family.json and into `<member>.receipt.json` beside it (formats/receipt.py): KLD figures are known only after
an evaluation, and a member is sealed (a GGUF's header, an EXL3 directory's every file), so it is not rewritten.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from mixq.errors import FormatError, InputError
from mixq.formats.atomic import write_json
from mixq.formats.gguf_reader import read_gguf
from mixq.formats.receipt import read_receipt, read_receipt_json, write_receipt_json
from mixq.formats.safetensors_io import sha256_file
from mixq.formats.model_files import read_json

FAMILY_JSON = "family.json"  # the name conversion/gguf/family.py writes (eval imports no conversion module)
FORMATS = ("gguf", "exl3")
SCORE_KEYS = ("kld_mean", "kld_mean_err", "kld_p99", "top1", "top1_err", "ppl", "ppl_ref", "dppl", "positions")


@dataclass
class Family:
    """A family directory as eval sees it: its family.json and its members (GGUF: each one's first file; EXL3:
    each one's directory)."""
    root: Path
    doc: dict
    files: list[Path]

    @property
    def format(self) -> str:
        return self.doc.get("format") or "gguf"  # the first GGUF families wrote no format


def read_family(root: str | Path) -> Family:
    """The family in directory `root` (InputError / FormatError naming family.json when it cannot be used)."""
    root = Path(root)
    fj = root / FAMILY_JSON
    doc = read_json(fj, FAMILY_JSON, FormatError)
    members = doc.get("members") if isinstance(doc, dict) else None
    if not isinstance(members, list) or not members or not all(isinstance(m, dict) and m.get("file")
                                                                for m in members):
        raise FormatError(f"{fj}: no members listed")
    fmt = doc.get("format") or "gguf"
    if fmt not in FORMATS:
        raise FormatError(f"{fj}: format {fmt!r} is not one of {', '.join(FORMATS)}")
    files = [root / Path(str(m["file"])).name for m in members]  # names only: a member never lies outside its family
    if fmt == "exl3":
        missing = [f for f in files if not (f / "config.json").is_file()]
        if missing:
            what = "has no config.json" if missing[0].is_dir() else "is missing"
            raise InputError(f"{fj}: member directory {missing[0].name} {what}")
    else:
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
    g = report.get("generated")
    if g:  # the token file (its sha256 taken from the bytes generated, written or read) and how it was made
        info.update(text_sha256=g["sha256"], replies=g["sequences"], reply_tokens=g["continuation_tokens"],
                    greedy=g["greedy"], sampled=g["sampled"], prompts=g["settings"].get("prompts"))
    elif text and Path(text).is_file():
        info["text_sha256"] = sha256_file(text)
    return info


SCORES_KEY = {"text": "scores", "generated": "scores_own_replies"}  # family.json's member keys per text kind


def record_scores(report: dict, families: Sequence[Family]) -> None:
    """Each evaluated member's scores (SCORE_KEYS, the engine, the text and its sha256) into its family's
    family.json (`members[i].scores`; on the model's own replies `members[i].scores_own_replies`, so a card
    carries both) and its `<file>.receipt.json`, both written atomically."""
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
            key = SCORES_KEY.get(report.get("text_kind", "text"), "scores")
            m[key] = scores
            if key == "scores":
                write_receipt_json(f, _receipt(fam, m, f), scores)
        write_json(fam.root / FAMILY_JSON, fam.doc)


def _receipt(fam: Family, member: dict, path: Path) -> dict:
    """A member's receipt: a GGUF's `mixq.receipt.*` keys; an EXL3 member's `<dir>.receipt.json` (written by the
    conversion), else what family.json records of it."""
    if fam.format == "gguf":
        return read_receipt(read_gguf(path).kv) or {}
    side = read_receipt_json(path)
    if side is not None:
        return side["receipt"]
    target = {"size": member["target_bytes"]} if member.get("target_bytes") else {"bpw": member.get("target_bpw")}
    return {"source": fam.doc.get("model"), "target": target, "plan": member.get("plan") or {},
            "options": member.get("options") or fam.doc.get("options") or {}}
