"""GGUF quality at equal bytes: `--rounding hessian` and `--measure` plans next to llama.cpp's own quantizer.

    python bench/quality/gguf_quality.py --model k256 --json bench/results/gguf-quality-k256.json
    python bench/quality/gguf_quality.py --model mini --no-measure --json bench/results/gguf-quality-mini.json
    python bench/quality/gguf_quality.py --report bench/results/gguf-quality-k256.json     # the markdown table again

Rows, all with one importance matrix (mixq's, from data/calibration.txt, --rows x 512 tokens) and, for the Hessian
rows, the same calibration tokens:
  exact     `mixq convert --type T --imatrix IMX`: byte-identical to llama.cpp's quantizer (checked here against
            llama_model_quantize on mixq's BF16 GGUF for the named mixes: "tensors ≠"), so its KLD is llama.cpp's
  hessian   the same with `--rounding hessian`: same ggml types and bytes, codes chosen for the layer output, then
            tuned for each decoder layer's output on the quantized model's streams (--tune-iters steps per stage)
  measured  `--size S --measure CURVES --rounding hessian`, S = the bytes of llama.cpp's Q2_K/Q3_K_M/Q4_K_M file,
            CURVES from `plan --measure` (measured once per model, same rounding and imatrix)
T: Q2_K, Q3_K_M, Q4_K_M, and "IQ2_S-exps" / "IQ2_XS-exps" / "IQ4_XS-exps" = Q4_K_M with the main layers' routed
experts at that type (`--tensor-type 'blk\\.(0|1|2|3)\\.ffn_(gate|up|down)_exps=IQ2_S'`: the NextN experts have no
imatrix entry).
Every file is checked with `mixq verify` and scored with llama.cpp's own logits (`mixq eval --engine llamacpp`,
--windows x 512 tokens of heldout.txt, second half scored) against the BF16 checkpoint. The JSON (paths relative to
the repo) holds every row's eval report; the table (KLD ± standard error, ratio to the exact row) is printed.
On a CUDA machine the calibration and the Hessian rounding run on the GPU (--device cuda); llama.cpp scores on CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from kld_vs_size import _LLAMA_QUANTIZE_PY, FTYPES, tensor_parity  # noqa: E402
from paths import SHARED, WORK, repo_relative  # noqa: E402

MODELS = {"k256": "glm5next-k256", "mini": "glm5next-mini"}
TYPES = ("Q2_K", "Q3_K_M", "Q4_K_M", "IQ2_S-exps", "IQ2_XS-exps", "IQ4_XS-exps")
NAMED_SIZES = ("Q2_K", "Q3_K_M", "Q4_K_M")


def log(msg: str) -> None:
    print(f"[gguf_quality {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def made(path: Path, make) -> float | None:
    """Run make(tmp) unless `path` exists, then move tmp into place; seconds taken (None when reused)."""
    if path.exists():
        return None
    tmp = path.with_name("partial-" + path.name)
    t0 = time.time()
    make(tmp)
    os.replace(tmp, path)
    return time.time() - t0


def convert(model: Path, out: Path, **kw) -> None:
    from mixq.conversion.gguf.pipeline import convert_gguf

    convert_gguf(model, out, progress=False, overwrite=True, **kw)


def mix_options(t: str, n_layers: int) -> dict:
    """--type (and --tensor-type) of a row type; IQ2_S-exps / IQ2_XS-exps: the main layers' routed experts at that
    type (the NextN block's have no imatrix entry, and llama-quantize refuses the IQ2 types without one)."""
    if not t.endswith("-exps"):
        return {"qtype": t}
    layers = "|".join(str(i) for i in range(n_layers))
    experts = t.removesuffix("-exps")
    return {"qtype": "Q4_K_M", "tensor_type": [rf"blk\.({layers})\.ffn_(gate|up|down)_exps={experts}"]}


class Bench:
    def __init__(self, a: argparse.Namespace, model: str):
        self.a, self.name = a, model
        self.model = SHARED / "models" / MODELS[model]
        self.work = Path(a.work) / f"gguf-quality-{model}"
        self.work.mkdir(parents=True, exist_ok=True)
        self.cal = [str(SHARED / "data" / "calibration.txt")]
        self.n_layers = int(json.loads((self.model / "config.json").read_text()).get("text_config", {})
                            .get("num_hidden_layers", 0))
        self.seconds: dict[str, float] = {}
        from mixq.conversion.options import DEFAULT_TUNE_ITERS

        self.tune_iters = DEFAULT_TUNE_ITERS if a.tune_iters is None else a.tune_iters

    def step(self, key: str, path: Path, make) -> Path:
        s = made(path, make)
        if s is not None:
            self.seconds[key] = round(s, 1)
            log(f"{key}: {s:.0f} s")
        return path

    def imatrix(self) -> Path:
        def make(tmp):
            from mixq.conversion.gguf.pipeline import collect_imatrix
            from mixq.formats.imatrix_file import write_imatrix

            write_imatrix(tmp, collect_imatrix(self.model, self.cal, rows=self.a.rows, seq_len=512,
                                               device=self.a.device, progress=False))
        return self.step("imatrix", self.work / f"imatrix-r{self.a.rows}.gguf", make)

    def reference(self) -> Path:
        from mixq.eval.api import evaluate

        return self.step("reference", self.work / f"ref-w{self.a.windows}.st", lambda tmp: evaluate(
            self.model, [], SHARED / "data" / "heldout.txt", ctx=512, windows=self.a.windows, save_ref=tmp,
            device=self.a.device, progress=False))

    def llamacpp(self, t: str, imx: Path) -> Path | None:
        """llama.cpp's own quantizer on mixq's BF16 GGUF (named mixes; the ctypes API has no per-tensor types)."""
        if t not in FTYPES:
            return None
        bf16 = self.step("bf16", self.work / "bf16.gguf", lambda tmp: convert(self.model, tmp, qtype="BF16"))
        return self.step(f"llamacpp-{t}", self.work / f"llamacpp-{t}.gguf", lambda tmp: subprocess.run(
            [sys.executable, "-c", _LLAMA_QUANTIZE_PY, str(bf16), str(tmp), str(FTYPES[t]), str(self.a.threads),
             str(imx)], check=True))

    def rows(self) -> list[dict]:
        imx = self.imatrix()
        rows = []
        hess = dict(rounding="hessian", calibration=self.cal, rows=self.a.rows, seq_len=512, device=self.a.device,
                    tune_iters=self.tune_iters, refine_passes=self.a.refine_passes)
        # its own files per descent-pass setting (the default is per type: files made under another default are
        # not taken for it)
        passes = "-ptype" if self.a.refine_passes is None else f"-p{self.a.refine_passes}"
        for t in self.a.types:
            ex = self.step(f"exact-{t}", self.work / f"exact-{t}.gguf",
                           lambda tmp: convert(self.model, tmp, imatrix=imx, **mix_options(t, self.n_layers)))
            rows.append({"row": "exact", "type": t, "file": ex})
            lc = self.llamacpp(t, imx)
            if lc is not None:
                rows[-1]["vs_llamacpp"] = tensor_parity(ex, lc)
            hs = self.step(f"hessian-{t}{passes}", self.work / f"hessian-{t}{passes}.gguf",
                           lambda tmp: convert(self.model, tmp, imatrix=imx, **mix_options(t, self.n_layers), **hess))
            rows.append({"row": "hessian", "type": t, "file": hs, "vs_exact": layout_parity(ex, hs)})
        if self.a.measure:
            curves = self.step("curves", self.work / f"curves-hessian-r{self.a.rows}.json", lambda tmp: measure(
                self.model, tmp, imx, self.cal, self.a.device))
            for t in NAMED_SIZES:
                ref = self.llamacpp(t, imx) or self.work / f"exact-{t}.gguf"
                size = ref.stat().st_size
                f = self.step(f"measured-{t}{passes}", self.work / f"measured-{t}{passes}.gguf", lambda tmp: convert(
                    self.model, tmp, size=size, measure=str(curves), imatrix=imx, **hess))
                rows.append({"row": "measured", "type": f"size of {t}", "file": f, "target_bytes": size,
                             "bytes_off": (f.stat().st_size - size) / size})
        return rows

    def run(self) -> dict:
        rows = self.rows()
        ref = self.reference()
        from mixq.conversion.api import verify
        from mixq.eval.api import evaluate

        for r in rows:
            v = verify(r["file"], model=self.model)
            r["verify_problems"] = len(v.get("problems", []))
            r["bytes"] = r["file"].stat().st_size
        log(f"scoring {len(rows)} files in llama.cpp")
        rep = evaluate(self.model, [r["file"] for r in rows], ref_logits=ref, engine="llamacpp", progress=False)
        for r, c in zip(rows, rep["candidates"]):
            r["eval"] = c
        return {"model": MODELS[self.name], "rows_calibration": self.a.rows, "windows": self.a.windows,
                "tune_iters": self.tune_iters, "seconds": self.seconds, "results": rows,
                **({} if self.a.refine_passes is None else {"refine_passes": self.a.refine_passes})}


def layout_parity(a: Path, b: Path) -> dict:
    """Tensors whose ggml type or byte count differ between two GGUFs (the Hessian file must have none)."""
    import gguf

    ta = {t.name: (t.tensor_type, t.n_bytes) for t in gguf.GGUFReader(a).tensors}
    tb = {t.name: (t.tensor_type, t.n_bytes) for t in gguf.GGUFReader(b).tensors}
    differ = sorted(n for n in set(ta) | set(tb) if ta.get(n) != tb.get(n))
    same_bytes = sum(1 for n in ta if n in tb and ta[n] == tb[n])
    return {"tensors": len(ta), "layout_differs": len(differ), "same_layout": same_bytes}


def measure(model: Path, out: Path, imx: Path, cal: list[str], device: str | None) -> None:
    from mixq.measurement.gguf_kld import gguf_kld_curves
    from mixq.measurement.trellis import save_curves
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.imatrix_file import read_imatrix

    t0 = time.time()
    curves = gguf_kld_curves(open_checkpoint(model), cal, rounding="hessian", imatrix=read_imatrix(imx).means(),
                             device=device, progress=False)
    save_curves(curves, out, meta={"method": "gguf kld", "rounding": "hessian", "seconds": round(time.time() - t0)})


def table(res: dict) -> str:
    """Markdown: per type, exact (= llama.cpp) vs hessian; then the measured plans vs llama.cpp's named mixes."""
    rows = res["results"]
    exact = {r["type"]: r for r in rows if r["row"] == "exact"}
    out = [f"{res['model']}: KLD vs BF16 in llama.cpp's logits ({res['windows']} x 512 tokens, half scored), "
           f"imatrix and Hessians from {res['rows_calibration']} x 512 calibration tokens", "",
           "| row | type / size | bytes | KLD ± s.e. | ratio to llama.cpp | top-1 % | verify "
           "| tensors ≠ llama.cpp |",
           "|---|---|---:|---:|---:|---:|:-:|:-:|"]
    for r in rows:
        e = r["eval"]
        base = exact.get(r["type"]) or exact.get(r["type"].replace("size of ", ""))
        ratio = e["kld_mean"] / base["eval"]["kld_mean"] if base else float("nan")
        # the ratio's error treats the two means as independent (they share positions, so this overstates it)
        rel = ((e["kld_mean_err"] / e["kld_mean"]) ** 2 + (base["eval"]["kld_mean_err"] / base["eval"]["kld_mean"])
               ** 2) ** 0.5 if base else 0.0
        par = r.get("vs_llamacpp")
        out.append(f"| {r['row']} | {r['type']} | {r['bytes']:,} | {e['kld_mean']:.4g} ± {e['kld_mean_err']:.2g} | "
                   f"{ratio:.3f} ± {ratio * rel:.3f} | {100 * e['top1']:.2f} | "
                   f"{'ok' if r['verify_problems'] == 0 else r['verify_problems']} | "
                   f"{'' if par is None else str(par['differ']) + ' of ' + str(par['tensors'])} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="k256")
    ap.add_argument("--types", default=",".join(TYPES), help="comma list of " + ", ".join(TYPES))
    ap.add_argument("--rows", type=int, default=128, help="calibration rows (x 512 tokens) for imatrix and Hessians")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--tune-iters", type=int, default=None,
                    help="block-output tuning steps per stage of the hessian rows [default: the converter's]")
    ap.add_argument("--refine-passes", type=int, default=None,
                    help="the hessian rows' descent passes after the walk [default: the converter's]")
    ap.add_argument("--no-measure", dest="measure", action="store_false", help="skip the measured-plan rows")
    ap.add_argument("--device", default=None, help="cuda|cpu for calibration and rounding [default: cuda if any]")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp quantizer threads")
    ap.add_argument("--work", default=str(WORK), help="where the GGUF files go (outside the repo)")
    ap.add_argument("--json", help="write the results JSON here (paths relative to the repo)")
    ap.add_argument("--report", help="print the table of a results JSON and exit")
    a = ap.parse_args(argv)
    if a.report:
        print(table(json.loads(Path(a.report).read_text())))
        return 0
    a.types = [t for t in a.types.split(",") if t]
    bad = [t for t in a.types if t not in TYPES]
    if bad:
        ap.error(f"unknown --types {bad}; choose from {', '.join(TYPES)}")
    res = Bench(a, a.model).run()
    if a.json:
        Path(a.json).write_text(json.dumps(repo_relative(res), indent=1, default=str) + "\n")
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
