"""KLD versus size: mixq GGUF (with / without imatrix), llama.cpp's quantizer on mixq's BF16 GGUF (same types,
same imatrix) and mixq EXL3, all scored by `mixq eval` on the same held-out windows.

    python bench/quality/kld_vs_size.py                           # k256: GGUF + llama.cpp rows, then the table and plot
    python bench/quality/kld_vs_size.py --model mini --types Q4_K_M,Q8_0
    python bench/quality/kld_vs_size.py --only exl3 --device cuda # the EXL3 rows (hours on 2 CPU cores for k256)
    python bench/quality/kld_vs_size.py --report                  # only rebuild tables and plot from bench/results/

Each row is one quantized file scored against the BF16 checkpoint: the reference log-probs are computed once
per model (`mixq eval --save-ref`) and every candidate reuses them (`--ref-logits`), so all rows see the same
windows. A row whose report bench/results/<model>/<row>.json exists is skipped (resumable); quantized files
live in --work (outside the repo) and are reused too. Rows:
  mixq-gguf     `mixq convert --format gguf --type T [--imatrix IMX]`            (+ the BF16 GGUF itself)
  llamacpp      llama.cpp's quantizer on mixq's BF16 GGUF: `llama_model_quantize` (llama-cpp-python 0.3.36)
                without imatrix, the `llama-quantize` tool (bench/tools/llamacpp_tools.py) with `--imatrix IMX`
  mixq-exl3     `mixq convert --format exl3 --bpw X --calibration calibration.txt`
IMX is mixq's importance matrix from data/calibration.txt (`collect_imatrix`, llama.cpp's GGUF imatrix format):
both quantizers get the same file. Sizes are bytes on disk of the weight files (GGUF: the file, no mmproj;
EXL3: *.safetensors, which include the small vision tower at source precision).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1]),
                 str(Path(__file__).resolve().parents[1] / "tools")]  # llamacpp_tools
from paths import REPO, SHARED, WORK, repo_relative  # noqa: E402

from mixq.formats.atomic import atomic_path, write_json, write_text  # noqa: E402
MODELS = {"k256": SHARED / "models" / "glm5next-k256", "mini": SHARED / "models" / "glm5next-mini"}
HELDOUT = SHARED / "data" / "heldout.txt"
CALIBRATION = SHARED / "data" / "calibration.txt"
GGUF_TYPES = ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
EXL3_BPW = (2.0, 2.5, 3.05, 4.0, 5.0, 6.0)
GROUPS = ("mixq-gguf", "llamacpp", "mixq-exl3")
GROUP_ALIASES = {"gguf": "mixq-gguf", "llama": "llamacpp", "llama.cpp": "llamacpp", "exl3": "mixq-exl3"}
METHOD = {"mixq-gguf": "mixq GGUF", "llamacpp": "llama.cpp", "mixq-exl3": "mixq EXL3"}
# llama_ftype values of llama.h (LLAMA_FTYPE_MOSTLY_*) for llama_model_quantize
FTYPES = {"Q8_0": 7, "Q2_K": 10, "Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15,
          "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18}


@dataclass(frozen=True)
class Row:
    model: str
    group: str
    quant: str          # GGUF type name, or "4.0bpw" for EXL3
    imatrix: bool = False

    @property
    def id(self) -> str:
        return f"{self.group}-{self.quant}" + ("-imx" if self.imatrix else "")

    @property
    def suffix(self) -> str:
        return "" if self.group == "mixq-exl3" else ".gguf"


_LLAMA_QUANTIZE_PY = r"""
import ctypes, sys
import numpy as np
import llama_cpp as L
src, dst, ftype, nthread, imx = sys.argv[1:6]
p = L.llama_model_quantize_default_params()
p.ftype = int(ftype)
p.nthread = int(nthread)
keep = []
if imx:
    import gguf
    r = gguf.GGUFReader(imx)
    t = {x.name: np.asarray(x.data, dtype=np.float32) for x in r.tensors}
    names = sorted(n[: -len(".in_sum2")] for n in t if n.endswith(".in_sum2"))
    arr = (L.llama_model_imatrix_data * (len(names) + 1))()
    for i, n in enumerate(names):
        s = t[n + ".in_sum2"].reshape(-1)
        c = np.round(t[n + ".counts"].reshape(-1)).astype(np.float32)
        e = s.reshape(len(c), -1)
        m = np.where(c[:, None] > 0, e / np.where(c > 0, c, 1)[:, None], np.float32(1)).astype(np.float32).reshape(-1)
        keep.append((n.encode(), m))
        arr[i].name = keep[-1][0]
        arr[i].data = keep[-1][1].ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        arr[i].size = m.size
    p.imatrix = ctypes.cast(arr, ctypes.POINTER(L.llama_model_imatrix_data))
rc = L.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p))
sys.exit(1 if rc else 0)
"""


# `mixq eval` with one workaround: llama-quantize drops the trailing 1 of ssm_conv1d's 4-D GGUF shape
# ([4,1,C,1] -> [4,1,C]; data unchanged) and mixq.formats.gguf_reader's conv inverse expects the 4-D form.
_EVAL_PY = r"""
import sys
import mixq.formats.gguf_names as names
import mixq.formats.gguf_reader as reader
_orig = names.unbuild_tensor
def unbuild(spec, t, hf_shapes=None):
    if spec.transform == "conv" and len(spec.shape) == 3:
        return {spec.hf_names[0]: t.reshape(tuple(spec.shape))}
    return _orig(spec, t, hf_shapes)
reader.unbuild_tensor = unbuild
from mixq.cli import main
sys.argv[0] = "mixq"
main()
"""


def log(msg: str) -> None:
    print(f"[kld_vs_size {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list[str], **kw) -> float:
    """Run a command (inheriting stdout/stderr); returns its wall seconds; raises on failure."""
    log("$ " + " ".join(str(c) for c in cmd))
    t0 = time.perf_counter()
    subprocess.run([str(c) for c in cmd], check=True, **kw)
    return time.perf_counter() - t0


def mixq(*args) -> list[str]:
    return [sys.executable, "-m", "mixq", *args]


def py(code: str, *args) -> list[str]:
    return [sys.executable, "-c", code, *args]


sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1]),
                 str(Path(__file__).resolve().parents[1] / "tools")]  # llamacpp_tools
from llamacpp_tools import find_tool  # noqa: E402


class Bench:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.work = Path(a.work)
        self.results = Path(a.results)

    # ---- paths -------------------------------------------------------------------------------------------
    def wdir(self, model: str) -> Path:
        d = self.work / model
        d.mkdir(parents=True, exist_ok=True)
        return d

    def artifact(self, row: Row) -> Path:
        return self.wdir(row.model) / f"{row.id}{row.suffix}"

    def report(self, row: Row) -> Path:
        return self.results / row.model / f"{row.id}.json"

    def ref_file(self, model: str) -> Path:
        dev = self.a.device or "auto"
        return self.wdir(model) / f"ref-ctx{self.a.ctx}-w{self.a.windows}-{dev}.st"

    # ---- shared inputs -----------------------------------------------------------------------------------
    def ensure_ref(self, model: str) -> Path:
        f = self.ref_file(model)
        if not f.is_file():
            cmd = mixq("eval", MODELS[model], "--text", HELDOUT, "--ctx", self.a.ctx, "--windows", self.a.windows,
                       "--save-ref", f)
            run(cmd + (["--device", self.a.device] if self.a.device else []))
        return f

    def ensure_imatrix(self, model: str) -> Path:
        f = self.wdir(model) / f"imatrix-r{self.a.imatrix_rows}.gguf"
        if not f.is_file():
            code = ("import sys; from mixq.conversion.gguf.pipeline import collect_imatrix; "
                    "from mixq.formats.imatrix_file import write_imatrix; "
                    "im = collect_imatrix(sys.argv[1], [sys.argv[2]], rows=int(sys.argv[3]), seq_len=512, "
                    "device=sys.argv[4] or None); write_imatrix(sys.argv[5], im)")
            secs = run(py(code, MODELS[model], CALIBRATION, self.a.imatrix_rows, self.a.device or "", f))
            self._note(model, "imatrix_seconds", secs)
        return f

    def ensure_bf16(self, model: str) -> Path:
        f = self.artifact(Row(model, "mixq-gguf", "BF16"))
        if not f.is_file():
            run(mixq("convert", MODELS[model], f, "--format", "gguf", "--type", "BF16"))
        return f

    def _note(self, model: str, key: str, value) -> None:
        """Side facts (imatrix time, quantizer used) kept in bench/results/<model>.meta.json, so that
        `mixq compare bench/results/<model>/*.json` reads only reports."""
        p = self.results / f"{model}.meta.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        meta = json.loads(p.read_text()) if p.is_file() else {}
        meta[key] = value
        write_json(p, meta)

    # ---- producing one quantized artifact ----------------------------------------------------------------
    def produce(self, row: Row) -> float | None:
        """Create the row's quantized file/dir (None when it already exists); returns the seconds taken."""
        out = self.artifact(row)
        if row.group == "mixq-exl3":
            if (out / "config.json").is_file() and not (out / ".mixq-job").exists():
                return None
            cmd = mixq("convert", MODELS[row.model], out, "--format", "exl3", "--bpw", row.quant.removesuffix("bpw"),
                       "--calibration", CALIBRATION, "--rows", self.a.exl3_rows)
            if self.a.device:
                cmd += ["--device", self.a.device]
            if (out / ".mixq-job").exists():
                cmd.append("--resume")
            return run(cmd)
        if out.is_file():
            return None
        if row.group == "mixq-gguf":
            cmd = mixq("convert", MODELS[row.model], out, "--format", "gguf", "--type", row.quant)
            if row.imatrix:
                cmd += ["--imatrix", self.ensure_imatrix(row.model)]
            return run(cmd)
        # llama.cpp's quantizer on mixq's BF16 GGUF, written under a temporary name
        src = self.ensure_bf16(row.model)
        tmp = out.with_name(out.name + ".partial")
        tool = find_tool("llama-quantize") if row.imatrix else None
        if tool is not None:
            secs = run([tool, "--imatrix", self.ensure_imatrix(row.model), src, tmp, row.quant, str(self.a.threads)],
                       stdout=subprocess.DEVNULL)
            self._note(row.model, f"quantizer:{row.id}", f"{tool} --imatrix")
        else:
            # llama_model_quantize through ctypes; in 0.3.36 its imatrix is a NULL-terminated C array of
            # {name, data, size}, filled with what llama-quantize's load_imatrix computes (float32 sum/count,
            # 1.0 for experts never seen)
            imx = str(self.ensure_imatrix(row.model)) if row.imatrix else ""
            secs = run(py(_LLAMA_QUANTIZE_PY, src, tmp, FTYPES[row.quant], self.a.threads, imx),
                       stderr=subprocess.DEVNULL)
            self._note(row.model, f"quantizer:{row.id}", "llama_model_quantize (llama-cpp-python ctypes)")
        os.replace(tmp, out)
        return secs

    # ---- evaluation --------------------------------------------------------------------------------------
    def evaluate(self, model: str, rows: list[Row], convert_secs: dict[Row, float | None]) -> None:
        """Score rows in chunks (one `mixq eval` per chunk) and split the report into per-row JSONs."""
        ref = self.ensure_ref(model)
        for i in range(0, len(rows), self.a.chunk):
            chunk = rows[i: i + self.a.chunk]
            tmp = self.wdir(model) / "_eval_chunk.json"
            args = ["eval", MODELS[model], *[self.artifact(r) for r in chunk], "--ref-logits", ref, "--json", tmp,
                    "--overwrite"]
            cmd = py(_EVAL_PY, *args) if any(r.group == "llamacpp" for r in chunk) else mixq(*args)
            if self.a.device:
                cmd += ["--device", self.a.device]
            try:
                secs = run(cmd, stdout=subprocess.DEVNULL)
            except subprocess.CalledProcessError as e:
                log(f"{model}: eval of {', '.join(r.id for r in chunk)} FAILED ({e}); rows skipped")
                continue
            rep = json.loads(tmp.read_text())
            common = {k: v for k, v in rep.items() if k != "candidates"}
            for r, c in zip(chunk, rep["candidates"]):
                c["bench"] = {"model": r.model, "group": r.group, "method": METHOD[r.group], "quant": r.quant,
                              "imatrix": r.imatrix, "convert_seconds": convert_secs.get(r),
                              "calibration_rows": (self.a.exl3_rows if r.group == "mixq-exl3"
                                                   else self.a.imatrix_rows if r.imatrix else None),
                              "eval_chunk_seconds": secs, "eval_chunk_size": len(chunk)}
                out = self.report(r)
                out.parent.mkdir(parents=True, exist_ok=True)
                write_json(out, repo_relative({**common, "candidates": [c]}))
                log(f"{r.model} {r.id}: {c['bytes']} bytes, KLD {c['kld_mean']:.4g}, top-1 {c['top1']:.4f}")
            tmp.unlink(missing_ok=True)

    def parity(self, model: str) -> None:
        """For each llama.cpp row, how many tensors differ (type or raw bytes) from mixq's file of the same type
        and imatrix; written into the row's report as bench.vs_mixq."""
        for r in self.rows(model):
            rep_p, mine = self.report(r), self.artifact(Row(model, "mixq-gguf", r.quant, r.imatrix))
            if r.group != "llamacpp" or not rep_p.is_file() or not mine.is_file() or not self.artifact(r).is_file():
                continue
            rep = json.loads(rep_p.read_text())
            b = rep["candidates"][0].setdefault("bench", {})
            if "vs_mixq" in b:
                continue
            b["vs_mixq"] = tensor_parity(self.artifact(r), mine)
            write_json(rep_p, rep)
            log(f"{model} {r.id} vs mixq: {b['vs_mixq']['differ']} of {b['vs_mixq']['tensors']} tensors differ")

    def rows(self, model: str) -> list[Row]:
        out = []
        for g in self.a.only:
            if g == "mixq-exl3":
                out += [Row(model, g, f"{b:g}bpw") for b in self.a.bpws]
                continue
            if g == "mixq-gguf" and self.a.bf16:
                out.append(Row(model, g, "BF16"))
            for t in self.a.types:
                for imx in self.a.imatrix_modes:
                    out.append(Row(model, g, t, imx))
        return out

    def run_model(self, model: str) -> None:
        todo = [r for r in self.rows(model) if not self.report(r).is_file()]
        log(f"{model}: {len(todo)} row(s) to do: {', '.join(r.id for r in todo) or '-'}")
        secs: dict[Row, float | None] = {}
        ready = []
        for r in todo:
            try:
                secs[r] = self.produce(r)
                ready.append(r)
            except (subprocess.CalledProcessError, RuntimeError, KeyError) as e:
                log(f"{model} {r.id}: FAILED to produce ({e}); row skipped")
            if len(ready) >= self.a.chunk:
                self.evaluate(model, ready, secs)
                ready = []
        if ready:
            self.evaluate(model, ready, secs)
        self.parity(model)


def tensor_parity(a: Path, b: Path) -> dict:
    """Tensors of GGUF `a` whose ggml type or raw bytes differ from `b`'s (shapes may differ only by trailing 1s,
    which llama-quantize drops)."""
    import gguf
    import numpy as np

    ta = {t.name: t for t in gguf.GGUFReader(a).tensors}
    tb = {t.name: t for t in gguf.GGUFReader(b).tensors}
    differ = sorted(set(ta) ^ set(tb))
    for n in sorted(set(ta) & set(tb)):
        x, y = ta[n], tb[n]
        if x.tensor_type != y.tensor_type or not np.array_equal(np.asarray(x.data).view(np.uint8).reshape(-1),
                                                                np.asarray(y.data).view(np.uint8).reshape(-1)):
            differ.append(n)
    return {"tensors": len(ta), "differ": len(differ), "names": differ[:20]}


# ---- tables and plot ---------------------------------------------------------------------------------------
def load_rows(results: Path, model: str) -> list[dict]:
    rows = []
    for p in sorted((results / model).glob("*.json")):
        if p.name.startswith("_"):
            continue
        rep = json.loads(p.read_text())
        for c in rep["candidates"]:
            b = c.get("bench", {})
            rows.append({**c, **b, "report": str(p), "reference": rep["reference"], "ctx": rep["ctx"],
                         "windows": rep.get("windows")})
    return rows


def _quant_order(r: dict) -> tuple:
    q = r["quant"]
    if q.endswith("bpw"):
        return (2, float(q[:-3]))
    return (1 if q != "BF16" else 3, GGUF_TYPES.index(q) if q in GGUF_TYPES else 99)


def _parity(r: dict) -> str:
    v = r.get("vs_mixq")
    return "" if not v else f"{v['differ']} of {v['tensors']}"


def markdown_table(rows: list[dict]) -> str:
    lines = ["| method | quant | imatrix | bytes | bpw | KLD mean ± err | KLD p99 | top-1 % | ΔPPL | convert s | tensors ≠ mixq |",
             "|---|---|:-:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    order = {"mixq-gguf": 0, "llamacpp": 1, "mixq-exl3": 2}
    for r in sorted(rows, key=lambda r: (_quant_order(r), order[r["group"]], r["imatrix"])):
        cs = r.get("convert_seconds")
        lines.append(
            f"| {r['method']} | {r['quant']} | {'yes' if r['imatrix'] else 'no'} | {r['bytes']:,} | {r['bpw']:.3f} | "
            f"{r['kld_mean']:.4g} ± {r['kld_mean_err']:.2g} | {r['kld_p99']:.3g} | {100 * r['top1']:.2f} | "
            f"{r['dppl']:+.4f} | {'' if cs is None else f'{cs:.0f}'} | {_parity(r)} |")
    return "\n".join(lines) + "\n"


def pivot_table(rows: list[dict]) -> str:
    """GGUF types side by side: mixq vs llama.cpp, without and with the imatrix (KLD; bytes)."""
    by = {(r["group"], r["quant"], r["imatrix"]): r for r in rows}

    def cell(g, q, imx):
        r = by.get((g, q, imx))
        return "—" if r is None else f"{r['kld_mean']:.4g}"

    def size(g, q):
        r = by.get((g, q, False)) or by.get((g, q, True))
        return "—" if r is None else f"{r['bytes']:,}"

    lines = ["| type | mixq bytes | llama.cpp bytes | KLD mixq | KLD llama.cpp | KLD mixq +imx | KLD llama.cpp +imx |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for q in GGUF_TYPES:
        if not any(k[1] == q for k in by):
            continue
        lines.append(f"| {q} | {size('mixq-gguf', q)} | {size('llamacpp', q)} | {cell('mixq-gguf', q, False)} | "
                     f"{cell('llamacpp', q, False)} | {cell('mixq-gguf', q, True)} | {cell('llamacpp', q, True)} |")
    return "\n".join(lines) + "\n"


def plot(all_rows: dict[str, list[dict]], out: Path) -> None:
    """KLD (log) against bytes (MB), one panel per model, one series per method/imatrix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m, rs in all_rows.items() if rs]
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.6), dpi=120, squeeze=False)
    # llama.cpp's rows sit on top of mixq's when the bytes are identical: hollow, larger markers keep both visible
    style = {("mixq-gguf", False): ("mixq GGUF", "C0", "o", "-", 5),
             ("mixq-gguf", True): ("mixq GGUF + imatrix", "C2", "s", "-", 5),
             ("llamacpp", False): ("llama.cpp quantizer", "C1", "o", ":", 10),
             ("llamacpp", True): ("llama.cpp quantizer + imatrix", "C3", "s", ":", 10),
             ("mixq-exl3", False): ("mixq EXL3", "C4", "^", "-", 6)}
    for ax, m in zip(axes[0], models):
        rs = [r for r in all_rows[m] if r["quant"] != "BF16" and r["kld_mean"] > 0]
        for key, (label, color, marker, ls, size) in style.items():
            pts = sorted((r for r in rs if (r["group"], r["imatrix"]) == key), key=lambda r: r["bytes"])
            if not pts:
                continue
            xs = [r["bytes"] / 1e6 for r in pts]
            ys = [r["kld_mean"] for r in pts]
            hollow = key[0] == "llamacpp"
            ax.plot(xs, ys, marker=marker, color=color, linestyle=ls, label=label, markersize=size,
                    markerfacecolor="none" if hollow else color, linewidth=1 if hollow else 1.5)
            if key in (("mixq-gguf", False), ("mixq-exl3", False)):
                for r, x, y in zip(pts, xs, ys):
                    ax.annotate(r["quant"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)
        ax.set_yscale("log")
        ax.set_title(f"glm5next-{m}: KLD to BF16 vs size ({rs[0]['windows'] if rs else '?'}×{rs[0]['ctx'] if rs else '?'} tokens)",
                     fontsize=9)
        ax.set_xlabel("size on disk (MB, 10^6 bytes)")
        ax.set_ylabel("mean KL divergence (nats/token)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def write_reports(results: Path, models: list[str], plot_out: Path | None) -> None:
    all_rows = {}
    for m in models:
        rows = load_rows(results, m)
        all_rows[m] = rows
        if not rows:
            continue
        r0 = rows[0]
        head = (f"# KLD vs size: glm5next-{m}\n\nReference `{r0['reference']}`; "
                f"{r0['windows']} windows × {r0['ctx']} tokens of heldout.txt, second half of each scored "
                f"({r0['positions']} positions); KLD in nats/token; bytes = weight files on disk.\n\n")
        text = head + markdown_table(rows) + "\n## GGUF: mixq vs llama.cpp's quantizer\n\n" + pivot_table(rows)
        write_text(results / f"{m}.md", text)
        log(f"wrote {results / f'{m}.md'} ({len(rows)} rows)")
    if plot_out and any(all_rows.values()):
        plot(all_rows, plot_out)
        log(f"wrote {plot_out}")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", choices=sorted(MODELS), help="k256 (default) and/or mini; repeatable")
    ap.add_argument("--only", default="gguf,llamacpp", help="comma list of groups: gguf, llamacpp, exl3 [gguf,llamacpp]")
    ap.add_argument("--types", default=",".join(GGUF_TYPES), help="GGUF types")
    ap.add_argument("--bpws", default=",".join(f"{b:g}" for b in EXL3_BPW), help="EXL3 bits per weight")
    ap.add_argument("--imatrix", dest="imatrix_modes", default="both", choices=["both", "no", "yes"],
                    help="GGUF rows without / with the imatrix")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false", help="skip the BF16 GGUF baseline row")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=4,
                    help="windows of --ctx tokens, second half scored (4 = the published rows; keep it equal across rows)")
    ap.add_argument("--device", default=None, help="cpu | cuda for eval, imatrix and EXL3 [default: mixq's choice]")
    ap.add_argument("--imatrix-rows", type=int, default=32,
                    help="calibration rows of 512 tokens for the imatrix (published: 32 for k256, 64 for mini)")
    ap.add_argument("--exl3-rows", type=int, default=64, help="calibration rows for EXL3 Hessians")
    ap.add_argument("--threads", type=int, default=2, help="threads for llama.cpp's quantizer")
    ap.add_argument("--chunk", type=int, default=4, help="candidates per `mixq eval` call")
    ap.add_argument("--work", default=str(WORK), help="quantized files (outside the repo)")
    ap.add_argument("--results", default=str(REPO / "bench" / "results"), help="per-row JSON reports and tables")
    ap.add_argument("--plot", default=str(REPO / "docs" / "kld_vs_size.png"), help="plot path ('' for none)")
    ap.add_argument("--report", action="store_true", help="only rebuild the tables and the plot")
    a = ap.parse_args(argv)
    a.model = a.model or ["k256"]
    a.only = [GROUP_ALIASES.get(g.strip(), g.strip()) for g in a.only.split(",") if g.strip()]
    bad = [g for g in a.only if g not in GROUPS]
    if bad:
        ap.error(f"--only: unknown group {bad[0]!r} (gguf, llamacpp, exl3)")
    a.types = [t.strip().upper() for t in a.types.split(",") if t.strip()]
    bad = [t for t in a.types if t not in FTYPES]
    if bad:
        ap.error(f"--types: unsupported {bad[0]!r}")
    a.bpws = [float(b) for b in a.bpws.split(",") if b.strip()]
    a.imatrix_modes = {"both": (False, True), "no": (False,), "yes": (True,)}[a.imatrix_modes]
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    results = Path(a.results)
    all_models = sorted({p.name for p in results.iterdir() if p.is_dir()} | set(a.model)) if results.is_dir() else a.model
    if not a.report:
        b = Bench(a)
        for m in a.model:
            b.run_model(m)
    write_reports(results, [m for m in ("k256", "mini") if m in all_models], Path(a.plot) if a.plot else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
