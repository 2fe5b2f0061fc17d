"""i-quant GGUFs of glm5next-k256: mixq's encoders next to llama.cpp's quantizer, type for type, scored in llama.cpp.

    python bench/quality/iq_ladder.py                      # IQ2_XS and IQ2_S rows + an --gguf-ladder iq plan row
    python bench/quality/iq_ladder.py --types IQ2_XXS,IQ3_XXS --size ''

Rows (all with the same importance matrix, mixq's from data/calibration.txt, as bench/quality/kld_vs_size.py makes it):
  T         `mixq convert --type Q4_K_M --tensor-type 'blk\\.[0-3]\\.ffn_(gate|up|down)_exps=T' --imatrix IMX`
            (the main layers' routed experts at T; the NextN experts have no imatrix entry and stay Q4_K)
  plan      `mixq convert --size S --gguf-ladder iq --imatrix IMX` (the planner's custom i-quant mix)
Each has a llama.cpp twin: the `llama-quantize` tool (bench/tools/llamacpp_tools.py) on mixq's BF16 GGUF with the same
imatrix and the same per-tensor types (--tensor-type, or a --tensor-type-file listing every tensor of the plan
row). Reported per row: bytes, tensors whose type or bytes differ between the twins, and KLD / top-1 against the
BF16 checkpoint from `mixq eval --engine llamacpp` (llama.cpp's own logits) on the bench's held-out windows.
Files go to --work; the table is printed and written to bench/results/k256-iq.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1]),
                 str(Path(__file__).resolve().parents[1] / "tools")]  # llamacpp_tools
from kld_vs_size import CALIBRATION, HELDOUT, MODELS, REPO, tensor_parity  # noqa: E402
from paths import WORK, repo_relative  # noqa: E402

from mixq.formats.atomic import write_json  # noqa: E402
from llamacpp_tools import find_tool  # noqa: E402

EXPS = r"blk\.[0-3]\.ffn_(gate|up|down)_exps"


def log(msg: str) -> None:
    print(f"[iq_ladder {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list, **kw) -> float:
    log("$ " + " ".join(str(c) for c in cmd))
    t0 = time.perf_counter()
    subprocess.run([str(c) for c in cmd], check=True, **kw)
    return time.perf_counter() - t0


def mixq(*args) -> list:
    return [sys.executable, "-m", "mixq", *args]


def ensure(path: Path, make) -> tuple[Path, float | None]:
    """Make `path` under a temporary name unless it exists; returns (path, seconds or None when reused)."""
    if path.is_file():
        return path, None
    tmp = path.with_name("partial-" + path.name)
    secs = make(tmp)
    os.replace(tmp, path)
    return path, secs


def gguf_types(path: Path) -> dict[str, str]:
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="IQ2_XS,IQ2_S", help="routed-expert types of the override rows")
    ap.add_argument("--size", default="14.3MB", help="--size of the --gguf-ladder iq plan row ('' for none)")
    ap.add_argument("--work", default=str(WORK))
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--imatrix-rows", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "k256-iq.json"))
    a = ap.parse_args(argv)
    model = MODELS["k256"]
    base, work = Path(a.work) / "k256", Path(a.work) / "k256-iq"
    base.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    tool = find_tool("llama-quantize")
    if tool is None:
        log("llama-quantize not found: build it with bench/tools/llamacpp_tools.py")
        return 2

    code = ("import sys; from mixq.conversion.gguf.pipeline import collect_imatrix; "
            "from mixq.formats.imatrix_file import write_imatrix; "
            "write_imatrix(sys.argv[4], collect_imatrix(sys.argv[1], [sys.argv[2]], rows=int(sys.argv[3]), seq_len=512))")
    imx, _ = ensure(base / f"imatrix-r{a.imatrix_rows}.gguf",
                    lambda t: run([sys.executable, "-c", code, model, CALIBRATION, a.imatrix_rows, t]))
    bf16, _ = ensure(base / "mixq-gguf-BF16.gguf", lambda t: run(mixq("convert", model, t, "--format", "gguf",
                                                                       "--type", "BF16")))
    ref = base / f"ref-ctx{a.ctx}-w{a.windows}-auto.st"
    if not ref.is_file():
        run(mixq("eval", model, "--text", HELDOUT, "--ctx", a.ctx, "--windows", a.windows, "--save-ref", ref))

    rows = []  # (label, mixq file, llama.cpp file, mixq seconds, llama.cpp seconds)
    for t in [x for x in a.types.split(",") if x]:
        f, s = ensure(work / f"mixq-exps-{t}.gguf", lambda o: run(mixq(
            "convert", model, o, "--format", "gguf", "--type", "Q4_K_M", "--tensor-type", f"{EXPS}={t}",
            "--imatrix", imx)))
        g, s2 = ensure(work / f"llamacpp-exps-{t}.gguf", lambda o: run(
            [tool, "--imatrix", imx, "--tensor-type", f"{EXPS}={t.lower()}", bf16, o, "Q4_K_M", a.threads],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        rows.append((f"Q4_K_M, experts {t}", f, g, s, s2))
    if a.size:
        f, s = ensure(work / f"mixq-plan-iq-{a.size}.gguf", lambda o: run(mixq(
            "convert", model, o, "--format", "gguf", "--size", a.size, "--gguf-ladder", "iq", "--imatrix", imx)))
        # every tensor's type of mixq's file, anchored, for llama-quantize (its base type only names the file)
        tt = work / f"plan-iq-{a.size}.tensor-types.txt"
        tt.write_text("".join(f"^{n.replace('.', chr(92) + '.')}$={ty.lower()}\n"
                              for n, ty in gguf_types(f).items() if ty not in ("F32",)))
        g, s2 = ensure(work / f"llamacpp-plan-iq-{a.size}.gguf", lambda o: run(
            [tool, "--imatrix", imx, "--tensor-type-file", tt, bf16, o, "Q8_0", a.threads],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        rows.append((f"--size {a.size} --gguf-ladder iq", f, g, s, s2))

    cands = [bf16] + [p for r in rows for p in r[1:3]]
    rep_path = work / "_eval.json"
    run(mixq("eval", model, *cands, "--ref-logits", ref, "--engine", "llamacpp", "--json", rep_path,
             "--overwrite"),
        stdout=subprocess.DEVNULL)
    by = {Path(c["path"]).name: c for c in json.loads(rep_path.read_text())["candidates"]}

    def score(p: Path) -> dict:
        c = by[p.name]
        return {"bytes": p.stat().st_size, "kld": c["kld_mean"], "kld_err": c["kld_mean_err"], "top1": c["top1"],
                "engine": c.get("engine")}

    out = {"model": "glm5next-k256", "imatrix": repo_relative(str(imx)), "windows": a.windows, "ctx": a.ctx,
           "engine": "llama.cpp (llama-cpp-python 0.3.36)", "bf16": score(bf16), "rows": []}
    for label, f, g, s, s2 in rows:
        types = {}
        for ty in gguf_types(f).values():
            types[ty] = types.get(ty, 0) + 1
        out["rows"].append({"row": label, "types": types, "mixq": {**score(f), "seconds": s},
                            "llamacpp": {**score(g), "seconds": s2}, "vs_llamacpp": tensor_parity(g, f)})
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(a.out, out)
    print(f"| row | bytes | KLD mixq | KLD llama.cpp | top-1 mixq | top-1 llama.cpp | tensors differing |")
    print("|---|---|---|---|---|---|---|")
    b = out["bf16"]
    print(f"| BF16 | {b['bytes']:,} | {b['kld']:.4g} | | {b['top1']:.4f} | | |")
    for r in out["rows"]:
        m, l = r["mixq"], r["llamacpp"]
        print(f"| {r['row']} | {m['bytes']:,} | {m['kld']:.4g} | {l['kld']:.4g} | {m['top1']:.4f} | {l['top1']:.4f} "
              f"| {r['vs_llamacpp']['differ']} of {r['vs_llamacpp']['tensors']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
