"""Markdown tables for `mixq eval` reports and `compare`: one table across quants plus a KLD-vs-size plot."""
from __future__ import annotations

from pathlib import Path

from mixq.formats.outputs import check_outputs, writing
from mixq.errors import FormatError, InputError
from mixq.formats.atomic import atomic_path, write_text
from mixq.formats.model_files import read_json

_REQUIRED = ("path", "format", "bytes", "bpw", "kld_mean", "top1", "dppl")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _name(path: str) -> str:
    return Path(path).name or path


def text_label(report: dict) -> str:
    """What a report scored, in a few words: the text file's name, or the generated replies."""
    g = report.get("generated")
    if g:
        return (f"own replies ({g['sequences']} x {g['continuation_tokens']} tokens, {g['greedy']} greedy + "
                f"{g['sampled']} sampled)")
    if report.get("text_kind") == "generated":
        return f"own replies `{_name(report.get('text') or '?')}`"
    return f"text `{_name(report.get('text') or '?')}`"


def _heading(report: dict) -> str:
    where = f"Reference `{report['reference']}`, "
    g = report.get("generated")
    if g:
        s = g["settings"]
        sampled = f", {g['sampled']} sampled at temperature {s.get('temperature')} (seeds {g['seeds']})" \
            if g["sampled"] else ""
        tpl = f" in the chat template of `{s['chat_template']}`" if s.get("chat_template") else ""
        return (where + f"the model's own replies `{report['text']}` (sha256 {g['sha256'][:12]}): {g['sequences']} "
                f"continuations of {g['continuation_tokens']} tokens after prompts of {g['prompt_tokens']} tokens of "
                f"`{s.get('prompts')}`{tpl}; {g['greedy']} greedy{sampled}; only continuation tokens scored, engine "
                f"{report.get('engine', 'torch')}")
    return (where + f"text `{report['text']}`, ctx {report['ctx']} ({report.get('windows', '?')} windows, "
            f"{report.get('score', 'half')} scored), engine {report.get('engine', 'torch')}")


def render_markdown(report: dict) -> str:
    """One `mixq eval` report as a markdown table (probabilities in %)."""
    lines = [
        _heading(report),
        "",
        "| candidate | format | size | bpw | KLD mean ± err | KLD median | KLD p99 | KLD max | top-1 % | PPL ref | PPL | ΔPPL | RMS Δp % | positions | engine |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in report["candidates"]:
        # the engine per candidate: with --engine llamacpp / exllamav3 only the matching format runs in it
        lines.append(
            f"| {_name(c['path'])} | {c['format']} | {_size(c['bytes'])} | {c['bpw']:.3f} | "
            f"{c['kld_mean']:.3g} ± {c['kld_mean_err']:.2g} | {c['kld_median']:.3g} | {c['kld_p99']:.3g} | {c['kld_max']:.3g} | "
            f"{100 * c['top1']:.2f} | {c['ppl_ref']:.4f} | {c['ppl']:.4f} | {c['dppl']:+.4f} | {100 * c['rms_dp']:.3f} | {c['positions']} | "
            f"{c.get('engine', 'torch')} |"
        )
    lines += mtp_markdown(report)
    return "\n".join(lines) + "\n"


def mtp_markdown(report: dict) -> list[str]:
    """The --mtp table: each candidate's NextN draft agreement beside the reference's (empty without --mtp)."""
    ref = report.get("mtp")
    if not ref:
        return []
    if "agreement" not in ref:
        return ["", f"NextN draft agreement: not measured ({ref.get('note')})."]
    lines = ["", f"NextN (MTP) draft agreement with the reference's next-next token over {ref['positions']} "
             f"positions: reference head {100 * ref['agreement']:.2f} %", "",
             "| candidate | format | bpw | NextN agreement % | relative to the reference | paired Δ points ± SE |",
             "|---|---|---:|---:|---:|---:|"]
    for c in report["candidates"]:
        if "mtp_agreement" in c:
            rel = "" if c.get("mtp_relative") is None else f"{c['mtp_relative']:.4f}"
            delta = ("" if c.get("mtp_delta") is None else
                     f"{100 * c['mtp_delta']:+.2f} ± {100 * c['mtp_delta_se']:.2f}")
            lines.append(f"| {_name(c['path'])} | {c['format']} | {c['bpw']:.3f} | {100 * c['mtp_agreement']:.2f} "
                         f"| {rel} | {delta} |")
        else:
            lines.append(f"| {_name(c['path'])} | {c['format']} | {c['bpw']:.3f} | not run: {c.get('mtp_note')} "
                         "| | |")
    return lines


def load_report(path: str | Path) -> dict:
    """A `mixq eval --json` report, checked for the keys `compare` needs."""
    p = Path(path)
    rep = read_json(p, "report", FormatError)
    if not isinstance(rep, dict) or not isinstance(rep.get("candidates"), list) or "reference" not in rep:
        raise FormatError(f"{path}: not a `mixq eval --json` report (no reference / candidates)")
    for c in rep["candidates"]:
        missing = [k for k in _REQUIRED if k not in c]
        if missing:
            raise FormatError(f"{path}: candidate {c.get('path', '?')} lacks {missing[0]!r}")
    return rep


def compare_rows(reports: list[dict]) -> list[dict]:
    """One row per candidate across reports, grouped by reference, smallest first."""
    rows = []
    for rep in reports:
        for c in rep["candidates"]:
            rows.append(
                {
                    "reference": rep["reference"],
                    "ctx": rep.get("ctx"),
                    "text": text_label(rep),
                    "text_kind": rep.get("text_kind", "text"),
                    "name": _name(c["path"]),
                    "path": c["path"],
                    "format": c["format"],
                    "engine": c.get("engine", "torch"),
                    "bytes": c["bytes"],
                    "bpw": c["bpw"],
                    "kld_mean": c["kld_mean"],
                    "kld_mean_err": c.get("kld_mean_err", 0.0),
                    "kld_p99": c.get("kld_p99"),
                    "top1": c["top1"],
                    "dppl": c["dppl"],
                }
            )
    rows.sort(key=lambda r: (r["reference"], r["bytes"]))
    return rows


def compare_markdown(rows: list[dict]) -> str:
    """One markdown table per reference model; where its reports scored more than one text (held-out text and
    the model's own replies), a column per text: each candidate's KLD and top-1 side by side."""
    out: list[str] = []
    for ref in dict.fromkeys(r["reference"] for r in rows):
        mine = [r for r in rows if r["reference"] == ref]
        texts = list(dict.fromkeys(r.get("text", "") for r in mine))
        out += [f"Reference `{ref}`", ""]
        if len(texts) > 1:
            out += _side_by_side(mine, texts)
            continue
        out += [
            "| quant | format | engine | size | bpw | KLD mean ± err | KLD p99 | top-1 % | ΔPPL |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in mine:
            p99 = "" if r["kld_p99"] is None else f"{r['kld_p99']:.3g}"
            out.append(
                f"| {r['name']} | {r['format']} | {r['engine']} | {_size(r['bytes'])} | {r['bpw']:.3f} | "
                f"{r['kld_mean']:.3g} ± {r['kld_mean_err']:.2g} | {p99} | {100 * r['top1']:.2f} | {r['dppl']:+.4f} |"
            )
        out.append("")
    return "\n".join(out)


def _side_by_side(rows: list[dict], texts: list[str]) -> list[str]:
    """One row per candidate (by path and engine), KLD ± err and top-1 on each text; blank where not scored."""
    cells = {(r["path"], r["engine"], r.get("text", "")): r for r in rows}
    head = "| quant | format | engine | size | bpw | " + " | ".join(
        f"KLD {t} | top-1 % {t}" for t in texts) + " |"
    out = [head, "|---|---|---|---:|---:|" + "---:|---:|" * len(texts)]
    for r in {(r["path"], r["engine"]): r for r in rows}.values():
        line = f"| {r['name']} | {r['format']} | {r['engine']} | {_size(r['bytes'])} | {r['bpw']:.3f} |"
        for t in texts:
            c = cells.get((r["path"], r["engine"], t))
            line += " | |" if c is None else f" {c['kld_mean']:.3g} ± {c['kld_mean_err']:.2g} | {100 * c['top1']:.2f} |"
        out.append(line)
    return out + [""]


def plot_kld_vs_size(rows: list[dict], out: Path) -> None:
    """KLD (log y) against bits per reference weight, one series per model and format, written as PNG (zero KLD is left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    # one series per (model, format): quants of one format form a curve; HF checkpoints are lone points
    for ref in dict.fromkeys(r["reference"] for r in rows):
        for fmt in dict.fromkeys(r["format"] for r in rows if r["reference"] == ref):
            pts = sorted((r for r in rows if r["reference"] == ref and r["format"] == fmt and r["kld_mean"] > 0),
                         key=lambda r: r["bpw"])
            if not pts:
                continue
            xs, ys = [r["bpw"] for r in pts], [r["kld_mean"] for r in pts]
            ax.plot(xs, ys, marker="o", linestyle="-" if fmt != "hf" else "none", label=f"{_name(ref)} {fmt}")
            for r, x, y in zip(pts, xs, ys):
                ax.annotate(Path(r["name"]).stem if r["format"] == "gguf" else r["name"], (x, y),
                            textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel("size (bits per reference weight)")
    ax.set_ylabel("mean KL divergence to reference (nats)")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    try:
        # a full disk, a read-only place or a folder removed meanwhile: one line naming the file, no PNG left
        with writing(out):
            out.parent.mkdir(parents=True, exist_ok=True)  # a new folder, as for every other output
            with atomic_path(out) as tmp:
                fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)


def compare(report_paths: list[str | Path], plot: str | Path | None = None, markdown: str | Path | None = None,
            *, overwrite: bool = False) -> dict:
    """Combine `mixq eval` reports: {'rows': [...], 'markdown': table text}; optional PNG plot / markdown file
    (neither may be one of the reports, nor an existing file unless `overwrite`)."""
    if not report_paths:
        raise InputError("give at least one REPORT.json")
    check_outputs({"--plot": plot, "--markdown": markdown},
                  {f"REPORT {p}": p for p in report_paths}, overwrite=overwrite)
    rows = compare_rows([load_report(p) for p in report_paths])
    if not rows:
        raise InputError("the reports hold no candidates")
    md = compare_markdown(rows)
    if plot:
        plot_kld_vs_size(rows, Path(plot))
    if markdown:
        with writing(markdown):
            Path(markdown).parent.mkdir(parents=True, exist_ok=True)
            write_text(Path(markdown), md)
    return {"rows": rows, "markdown": md, "plot": str(plot) if plot else None}
