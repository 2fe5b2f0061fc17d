"""Encode speed per ggml type: mixq on CUDA, mixq on CPU (1 core and all cores) and ggml (1 core and all cores).

Same tensors for every encoder, and every result checked byte for byte against ggml's:
- mixq CUDA: ``encoders.quantize(x, t, im, device="cuda")`` from host numpy to host bytes (the copies count);
  "resident": ``encoders.quantize_tensor`` of a tensor already on the GPU; "eager": without the fused kernels;
- mixq CPU 1 core: ``encoders.quantize`` (the numpy encoders) on this thread;
- mixq CPU all cores: the same over row chunks in a pool of worker processes (as ``convert --threads``);
- ggml 1 core / all cores: ``ggml_quantize_chunk`` (libggml-base of llama-cpp-python, or $MIXQ_GGML_BASE_LIB)
  over row chunks in a thread pool (ctypes releases the GIL), as llama-quantize spreads its work.
Each measurement runs on as many rows as fit a time target (timed on a probe first), so slow encoders
are measured on a slice; weights/s are comparable. Tensors: a GLM-5.3-width routed expert (2048 x 4096,
bf16-valued, per-row scales) and, when the fixture is there, the stacked experts of a trained k256 layer.

    python bench/speed/kquant_speed.py --device cuda --ggml-threads 16 --json bench/results/kquant-speed-h200.json
    python bench/speed/kquant_speed.py --types Q4_K --cpu-threads 2          # CPU only, this machine
    python bench/speed/kquant_speed.py --report bench/results/kquant-speed-h200.json   # markdown table

The JSON holds one row per (tensor, type, imatrix) with weights/s of each encoder, the speed-ups of
mixq CUDA over ggml on all cores, and whether every output equals ggml's.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from mixq.formats.atomic import write_json  # noqa: E402
from mixq.quant.ggml import encoders  # noqa: E402
from mixq.quant.ggml.triton_kernels import search as fused_search  # noqa: E402
from mixq.quant.ggml import libggml  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TYPES = ["Q4_K", "IQ2_S", "Q2_K", "Q3_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL", "IQ2_XXS", "IQ2_XS", "IQ3_XXS",
         "IQ3_S", "Q8_0", "Q4_0", "Q5_1"]


def _shared() -> Path:
    return Path(os.environ.get("MIXQ_SHARED") or REPO.parent / "shared")


def k256_experts(model: Path, layer: int = 2, proj: str = "gate_proj") -> np.ndarray:
    """All routed experts' `proj` matrices of one k256 layer stacked into rows (bf16 -> f32); the expert tensors
    are those the architecture table stacks into the layer's GGUF ``*_exps`` tensor."""
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.glm5next import gguf_sources

    ck = open_checkpoint(model)
    n_experts = int(ck.text_config["n_routed_experts"])
    names = gguf_sources(f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight", (n_experts,)).hf_names
    return np.concatenate([ck.get(n).numpy() for n in names])


def glm53_expert(rows: int = 2048, cols: int = 4096, seed: int = 0) -> np.ndarray:
    """A GLM-5.3-width expert matrix: Gaussian, per-row scales, rounded to bf16 values as checkpoints hold them."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * 0.02 * np.exp(0.3 * rng.standard_normal((rows, 1)))
    return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).float().numpy()


# ----------------------------------------------------------------------------- encoders

def _ggml_pool(x: np.ndarray, t: str, im, pool: ThreadPoolExecutor, parts: int) -> np.ndarray:
    bounds = np.linspace(0, x.shape[0], min(parts, x.shape[0]) + 1).astype(int)
    futs = [pool.submit(libggml.ggml_quantize, x[a:b], t, im) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return np.concatenate([f.result() for f in futs])


def _mixq_chunk(args) -> np.ndarray:
    x, t, im = args
    return encoders.quantize(x, t, im)


def _mixq_pool(x: np.ndarray, t: str, im, pool: ProcessPoolExecutor, parts: int) -> np.ndarray:
    bounds = np.linspace(0, x.shape[0], min(parts, x.shape[0]) + 1).astype(int)
    jobs = [(x[a:b], t, im) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return np.concatenate(list(pool.map(_mixq_chunk, jobs)))


def _mixq_cuda(x: np.ndarray, t: str, im, device: str) -> np.ndarray:
    out = encoders.quantize(x, t, im, device=device)
    torch.cuda.synchronize()
    return out


class _OnDevice:
    """mixq CUDA with the tensor already on the device (as the pipeline can hand it over): kernel throughput."""

    def __init__(self, x: np.ndarray, im, device: str):
        self.x = torch.from_numpy(x).to(device)
        self.im = None if im is None else torch.from_numpy(im).to(device)

    def __call__(self, t: str, a: np.ndarray) -> np.ndarray:
        out = encoders.quantize_tensor(self.x[:a.shape[0]], t, self.im)
        torch.cuda.synchronize()
        return out.cpu().numpy()


def _eager(fn):
    """Run fn with the fused kernels switched off (the elementwise torch path)."""
    os.environ["MIXQ_KQUANT_FUSED"] = "0"
    try:
        return fn()
    finally:
        os.environ.pop("MIXQ_KQUANT_FUSED", None)


def measure(fn, x: np.ndarray, target_s: float, probe_rows: int) -> tuple[float, int, np.ndarray]:
    """(weights/s, rows measured, bytes of those rows): time a probe, then as many rows as fit target_s."""
    probe = x[:min(probe_rows, x.shape[0])]
    t0 = time.perf_counter()
    fn(probe)
    dt = max(time.perf_counter() - t0, 1e-4)
    rows = int(min(x.shape[0], max(probe.shape[0], probe.shape[0] * target_s / dt)))
    rows = max(probe.shape[0], rows - rows % probe.shape[0]) if rows < x.shape[0] else rows
    xs = np.ascontiguousarray(x[:rows])
    t0 = time.perf_counter()
    out = fn(xs)
    dt = time.perf_counter() - t0
    return xs.size / dt, rows, out


# ----------------------------------------------------------------------------- driver

def run(args) -> dict:
    tensors: dict[str, np.ndarray] = {}
    model = args.model or _shared() / "models" / "glm5next-k256"
    if (model / "model.safetensors.index.json").is_file():
        tensors["k256 L2 experts gate (48x256 rows, n=256)"] = k256_experts(model)
    tensors["GLM-5.3 expert gate (2048x4096)"] = glm53_expert()
    cuda = args.device.startswith("cuda") and torch.cuda.is_available()
    if args.device.startswith("cuda") and not cuda:
        raise SystemExit("--device cuda: torch sees no CUDA device")
    have_ggml = libggml.available()
    rng = np.random.default_rng(1)
    threads = ThreadPoolExecutor(args.ggml_threads)
    procs = ProcessPoolExecutor(args.cpu_threads) if args.cpu_threads > 1 else None
    if procs is not None:  # start the workers (imports) outside the timings
        list(procs.map(_mixq_chunk, [(np.zeros((1, 256), np.float32), "Q4_K", None)] * args.cpu_threads))
    results = []
    for tname, x in tensors.items():
        im_full = np.exp(rng.standard_normal(x.shape[1])).astype(np.float32)
        for t in args.types.split(","):
            for im in ((None, im_full) if args.imatrix == "both" else (im_full,) if args.imatrix == "yes" else (None,)):
                if x.shape[1] % encoders.block_size(t) or (im is None and t in encoders.REQUIRES_IMATRIX):
                    continue
                row = {"tensor": tname, "type": t, "imatrix": im is not None, "weights": int(x.size)}
                enc: dict[str, object] = {}
                # one-off set-up (codebooks, CUDA context and kernels) outside the timings
                encoders.quantize(x[:1], t, im)
                if cuda:
                    _mixq_cuda(x[:8], t, im, args.device)
                    on_dev = _OnDevice(x, im, args.device)
                    enc["mixq_cuda"] = lambda a: _mixq_cuda(a, t, im, args.device)
                    enc["mixq_cuda_resident"] = lambda a: on_dev(t, a)
                    if args.eager:
                        enc["mixq_cuda_eager"] = lambda a: _eager(lambda: _mixq_cuda(a, t, im, args.device))
                enc["mixq_cpu_1"] = lambda a: encoders.quantize(a, t, im)
                if procs is not None:
                    enc["mixq_cpu_all"] = lambda a: _mixq_pool(a, t, im, procs, 4 * args.cpu_threads)
                if have_ggml:
                    enc["ggml_1"] = lambda a: libggml.ggml_quantize(a, t, im)
                    enc["ggml_all"] = lambda a: _ggml_pool(a, t, im, threads, 4 * args.ggml_threads)
                outs = {}
                for name, fn in enc.items():
                    wps, rows, out = measure(fn, x, args.target_s, args.probe_rows)
                    row[f"{name}_wps"] = round(wps)
                    row[f"{name}_rows"] = rows
                    outs[name] = out
                most = max(o.shape[0] for o in outs.values())
                if have_ggml:
                    ref = _ggml_pool(x[:most], t, im, threads, 4 * args.ggml_threads)
                else:  # the numpy encoders (proven equal to ggml by the tests)
                    ref = _mixq_pool(x[:most], t, im, procs, 4 * args.cpu_threads) if procs else outs["mixq_cpu_1"]
                row["equal"] = all(np.array_equal(o, ref[:o.shape[0]]) for o in outs.values())
                if cuda:
                    row["fused_variants_ok"] = all(fused_search.checked_variants().values())
                for name in ("mixq_cuda", "mixq_cuda_resident", "mixq_cuda_eager", "mixq_cpu_all", "mixq_cpu_1"):
                    if f"{name}_wps" in row and "ggml_all_wps" in row:
                        row[f"{name}_vs_ggml_all"] = round(row[f"{name}_wps"] / row["ggml_all_wps"], 3)
                results.append(row)
                print("  ".join(f"{k}={v}" for k, v in row.items() if k != "weights"), flush=True)
    threads.shutdown()
    if procs is not None:
        procs.shutdown()
    return {"device": torch.cuda.get_device_name() if cuda else "cpu", "host_cpus": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(), "ggml_threads": args.ggml_threads,
            "cpu_workers": args.cpu_threads, "ggml_available": have_ggml, "target_s": args.target_s,
            "torch": torch.__version__, "results": results}


def report(data: dict) -> str:
    """Markdown table (M weights/s per encoder, speed-up of mixq CUDA over ggml on all cores) of a results JSON."""
    cols = [("mixq_cuda", "mixq CUDA"), ("mixq_cuda_resident", "CUDA resident"), ("mixq_cuda_eager", "CUDA eager"),
            ("mixq_cpu_1", "mixq 1 core"), ("mixq_cpu_all", f"mixq {data['cpu_workers']} procs"),
            ("ggml_1", "ggml 1 thread"), ("ggml_all", f"ggml {data['ggml_threads']} threads")]
    rows = data["results"]
    cols = [(k, name) for k, name in cols if any(f"{k}_wps" in r for r in rows)]
    head = ["tensor", "type", "imatrix"] + [name for _, name in cols] + ["CUDA / ggml all", "bytes = ggml"]
    out = [f"{data['device']}, host {data['cpu']} ({data['host_cpus']} CPUs); M weights/s", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["tensor"], r["type"], "yes" if r["imatrix"] else "no"]
        cells += [f"{r[k + '_wps'] / 1e6:.2f}" if f"{k}_wps" in r else "" for k, _ in cols]
        ratio = r.get("mixq_cuda_vs_ggml_all")
        cells += [f"{ratio:.1f}x" if ratio is not None else "", "yes" if r["equal"] else "NO"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cuda: also time mixq's torch encoders there")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--imatrix", choices=("both", "yes", "no"), default="both")
    ap.add_argument("--ggml-threads", type=int, default=os.cpu_count() or 1, help="threads for ggml (all cores)")
    ap.add_argument("--cpu-threads", type=int, default=os.cpu_count() or 1, help="worker processes for mixq CPU")
    ap.add_argument("--target-s", type=float, default=1.0, help="seconds per measurement (rows are cut to fit)")
    ap.add_argument("--probe-rows", type=int, default=32)
    ap.add_argument("--model", type=Path, default=None, help="k256 fixture (default: $MIXQ_SHARED/models/...)")
    ap.add_argument("--eager", action="store_true", help="also time mixq CUDA without the fused kernels")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--report", type=Path, default=None, help="print a results JSON as a markdown table and exit")
    args = ap.parse_args()
    if args.report:
        print(report(json.loads(args.report.read_text())))
        return
    t0 = time.perf_counter()
    data = run(args)
    data["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.json, data, indent=1)
    print(f"done in {data['wall_s']} s")


if __name__ == "__main__":
    main()
