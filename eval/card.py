"""`mixq card OUT_DIR`: a Hugging Face model card (OUT_DIR/README.md) for a family that convert wrote and eval scored.

Front matter as the Hub reads it (base_model, base_model_relation: quantized, library_name, tags), a table of the
members (file, bytes, bpw, KLD ± s.e., top-1, the engine that scored them: family.json's scores, which `mixq eval
MODEL OUT_DIR` records), the KLD-vs-size PNG when matplotlib is installed (eval/report.py's plot), how the files
were made (from the receipts in the files), and a line leaving the upload to the user. A GGUF family's card is
library gguf; an EXL3 family's (family.json "format": "exl3") is library exllamav3, one row per member directory,
its receipts read from `<dir>.receipt.json`.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from mixq.formats.outputs import check_output_file, writing
from mixq.errors import InputError
from mixq.eval.family import FAMILY_JSON, read_family
from mixq.eval.report import plot_kld_vs_size
from mixq.formats.atomic import write_text
from mixq.formats.gguf_reader import read_gguf
from mixq.formats.receipt import read_receipt, read_receipt_json

PLOT_NAME = "kld_vs_size.png"


def _yaml_str(s: str) -> str:
    """A YAML scalar that stays a string whatever it holds."""
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f} MB" if n < 1e9 else f"{n / 1e9:,.2f} GB"


def _score_cells(s: dict | None) -> tuple[str, str, str]:
    if not s or s.get("kld_mean") is None:
        return "not evaluated", "", ""
    err = s.get("kld_mean_err")
    kld = f"{s['kld_mean']:.4g}" + (f" ± {err:.2g}" if err is not None else "")
    top1 = "" if s.get("top1") is None else f"{100 * s['top1']:.2f} %"
    return kld, top1, str(s.get("engine") or "")


def _made_lines(fam, receipt: dict | None) -> list[str]:
    doc = fam.doc
    lines = []
    if receipt:
        lines.append(f"- mixq {receipt.get('mixq', '?')}, from `{receipt.get('source', '?')}`.")
        cal = receipt.get("calibration") or {}
        im = cal.get("imatrix")
        if im:
            ds = ", ".join(im.get("datasets") or []) or "?"
            lines.append(f"- One importance matrix shared by every member: `{im.get('file')}` (sha256 "
                         f"`{im.get('sha256', '?')}`), {im.get('chunks', '?')} rows x {im.get('chunk_size', '?')} "
                         f"tokens of {ds}.")
        if cal.get("hessian"):
            h = cal["hessian"]
            lines.append(f"- Hessian-aware rounding, {h.get('rows')} x {h.get('seq_len')} calibration tokens, "
                         f"{h.get('tune_iters')} tuning steps per layer.")
        if not cal:
            lines.append("- No calibration data (no importance matrix).")
        opts = receipt.get("options") or {}
        shown = {k: v for k, v in opts.items() if v not in (None, [], False) and k not in ("format", "version")}
        lines.append("- Options: " + ", ".join(f"`{k}={v}`" for k, v in sorted(shown.items())) + ".")
    lines.append("- Each member was planned to its own byte target from the same inputs and written by the same "
                 "single-conversion path; each (tensor, type) was encoded once for the whole family. Every file "
                 "carries a `mixq.receipt.*` receipt and a `mixq.integrity.*` seal (`mixq inspect FILE`, "
                 "`mixq verify FILE`).")
    lines += _score_lines(doc)
    return lines


def _exl3_made_lines(fam, receipt: dict | None) -> list[str]:
    """How an EXL3 family was made: what its members share (the curves) and what each did on its own."""
    doc = fam.doc
    cal = (receipt or {}).get("calibration") or {}
    layers = cal.get("layers") or doc.get("calibration") or {}
    curves = cal.get("curves") or doc.get("curves") or {}
    lines = []
    if receipt:
        lines.append(f"- mixq {receipt.get('mixq', '?')}, from `{receipt.get('source', '?')}`.")
    if curves:
        how = f", measured with `--measure {curves['method']}`" if curves.get("method") else ""
        lines.append(f"- Every member planned from one set of error curves: `{curves.get('file', '?')}` (sha256 "
                     f"`{curves.get('sha256', '?')}`{how}).")
    if layers:
        files = ", ".join(f"`{f.get('file')}`" for f in layers.get("files") or []) or "?"
        lines.append(f"- Each member's decoder layers were calibrated on the hidden states of its own quantized "
                     f"layers: {layers.get('rows', '?')} rows x {layers.get('seq_len', '?')} tokens of {files}; its "
                     "Hessians and trellis encodes are its own.")
    opts = doc.get("options") or (receipt or {}).get("options") or {}
    shown = {k: v for k, v in opts.items() if v not in (None, [], False) and k not in ("format", "version")}
    if shown:
        lines.append("- Options: " + ", ".join(f"`{k}={v}`" for k, v in sorted(shown.items())) + ".")
    lines.append("- Each member was written by the single-conversion path; every directory's files are sealed by "
                 "its `mixq_manifest.json` (`mixq verify DIR`), its receipt is `DIR.receipt.json` beside it "
                 "(`mixq inspect DIR`). bpw is the trellis rate of the quantized Linears, as exllamav3 reports it.")
    lines += _score_lines(doc)
    return lines


def _score_lines(doc: dict) -> list[str]:
    lines = []
    if any(m.get("scores") for m in doc["members"]):
        s = next(m["scores"] for m in doc["members"] if m.get("scores"))
        lines.append(f"- Scores: `mixq eval` against the BF16 reference `{s.get('reference', '?')}` on "
                     f"{s.get('windows', '?')} windows of {s.get('ctx', '?')} tokens of `{s.get('text', '?')}`"
                     + (f" (sha256 `{s['text_sha256']}`)" if s.get("text_sha256") else "") + "; KLD in nats, "
                     "± its standard error.")
    if any(m.get("scores_own_replies") for m in doc["members"]):
        s = next(m["scores_own_replies"] for m in doc["members"] if m.get("scores_own_replies"))
        lines.append(f"- Own replies: the same KLD and top-1 on {s.get('replies', '?')} replies of "
                     f"{s.get('reply_tokens', '?')} tokens the reference `{s.get('reference', '?')}` wrote itself "
                     f"({s.get('greedy', '?')} greedy, {s.get('sampled', '?')} sampled) to prompts from "
                     f"`{s.get('prompts', '?')}`, only the reply tokens scored (`mixq eval --text generated:N`; "
                     f"token file `{s.get('text', '?')}`, sha256 `{s.get('text_sha256', '?')}`). Held-out text "
                     "flatters a quant: its own replies are where its errors compound.")
    return lines


def write_card(out_dir: str | Path, *, base_model: str | None = None, overwrite: bool = False,
               plot: bool = True) -> dict:
    """Write OUT_DIR/README.md (and OUT_DIR/kld_vs_size.png when members are scored and matplotlib is there).
    `base_model`: the Hub id of the source model (default: the source directory's name, family.json's model).
    Returns {"card", "plot", "members"}."""
    root = Path(out_dir)
    if not (root / FAMILY_JSON).is_file():
        raise InputError(f"{root}: no {FAMILY_JSON} (write a family with `mixq convert MODEL {root} --format gguf "
                         "--size A,B,C`, or --format exl3 --bpw x,y,z)")
    fam = read_family(root)
    card = root / "README.md"
    check_output_file(card, overwrite=overwrite, label="card")
    doc = fam.doc
    base = base_model or doc.get("model") or "unknown"
    exl3 = fam.format == "exl3"
    if exl3:
        side = read_receipt_json(fam.files[0])
        receipt = side["receipt"] if side else None
    else:
        receipt = read_receipt(read_gguf(fam.files[0]).kv)
    own = any(m.get("scores_own_replies") for m in doc["members"])
    rows_md = [f"| {'directory' if exl3 else 'file'} | bytes | bpw | KLD ± s.e. | top-1 | "
               + ("KLD own replies | top-1 own replies | " if own else "") + "scored by |",
               "|---|---:|---:|---:|---:|" + ("---:|---:|" if own else "") + "---|"]
    plot_rows = []
    for m in doc["members"]:
        kld, top1, engine = _score_cells(m.get("scores"))
        extra = ""
        if own:
            okld, otop1, oengine = _score_cells(m.get("scores_own_replies"))
            extra, engine = f" {okld} | {otop1} |", engine or oengine
        rows_md.append(f"| `{m['file']}` | {m['bytes']:,} ({_mb(m['bytes'])}) | {m['bpw']:.3f} | {kld} | {top1} |"
                       f"{extra} {engine} |")
        s = m.get("scores") or {}
        if s.get("kld_mean") is not None:
            plot_rows.append({"reference": base, "format": fam.format, "name": m["file"], "bpw": m["bpw"],
                              "kld_mean": s["kld_mean"]})
    png = None
    if plot and plot_rows and importlib.util.find_spec("matplotlib") is not None:
        png = root / PLOT_NAME
        plot_kld_vs_size(plot_rows, png)
    model = doc.get("model", base)
    if exl3:
        head = ["library_name: exllamav3", "tags:", "- exl3", "- exllamav3", "- mixq", "- quantized",
                "- mixed-precision", "---", "", f"# {model} EXL3 family", "",
                f"{len(doc['members'])} mixed-precision EXL3 directories of [{base}](https://huggingface.co/{base}), "
                "made in one pass by mixq (one set of error curves plans them all). bpw = the trellis rate of the "
                "quantized Linears; bytes = the whole directory."]
        made = _exl3_made_lines(fam, receipt)
        upload = (f"`huggingface-cli upload YOUR_NAME/{doc.get('model', 'model')}-exl3 {root}/MEMBER . "
                  "--revision LABEL` (one branch per member, e.g. `--revision 3.05bpw`), or the whole "
                  f"directory: `huggingface-cli upload YOUR_NAME/{doc.get('model', 'model')}-exl3 {root} .`")
    else:
        head = ["library_name: gguf", "tags:", "- gguf", "- mixq", "- quantized", "- mixed-precision", "---", "",
                f"# {model} GGUF family", "",
                f"{len(doc['members'])} mixed-precision GGUF files of [{base}](https://huggingface.co/{base}), "
                "each at or below its byte target, made in one pass by mixq. bpw = file bytes x 8 / the source "
                "model's parameters."]
        made = _made_lines(fam, receipt)
        upload = f"`huggingface-cli upload YOUR_NAME/{doc.get('model', 'model')}-GGUF {root} .`"
    lines = ["---", f"base_model: {_yaml_str(base)}", "base_model_relation: quantized", *head, "", *rows_md, ""]
    if png is not None:
        lines += [f"![KLD against size]({PLOT_NAME})", ""]
    lines += ["## How they were made", "", *made, "",
              "## Upload", "",
              "mixq does not upload anything; publishing is yours, e.g. " + upload, ""]
    with writing(card):
        write_text(card, "\n".join(lines))
    return {"card": str(card), "plot": str(png) if png else None, "members": len(doc["members"])}
