"""Dequantization speed of a GGUF: gguf-py's numpy decoders vs mixq's torch decoders (quant/ggml/torch_decode).

    python bench/gguf_dequant_speed.py                        # glm5next-k256 Q4_K_M, made under WORK if absent
    python bench/gguf_dequant_speed.py --gguf F.gguf --rounds 5 --json bench/results/gguf_dequant_speed_cpu.json

Every tensor of the file is decoded from its memory-mapped bytes by each path: gguf-py (`gguf.quants.dequantize`,
numpy, one thread), torch on the CPU with torch's threads and with one, and torch on CUDA when there is one (the
bytes copied to the GPU, decoded, synchronised; and once more with the values copied back to the host, as
runtime/dequant's GGUFSource hands them out). A type torch_decode does not know is left out of every path. Each
path's time is the best of --rounds passes over the whole file; printed per path: M weights/s overall and per type,
and the ratio to gguf-py. Every tensor of every path must be bit-identical to gguf-py's (the run fails otherwise).
On cores shared with other jobs torch's multi-threaded row can lose most of its speed (its threads wait on each
other at every op), so the JSON keeps the load average; the one-thread row is the steadier figure. glm5next-k256's
rows are short (256 weights), where gguf-py pays most for its per-16-rows Python loop: wider rows narrow the gap.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paths import SHARED, WORK, repo_relative  # noqa: E402

from mixq.formats.atomic import write_json  # noqa: E402
from mixq.formats.gguf_reader import GGUFTensorEntry, read_gguf  # noqa: E402
from mixq.quant.ggml import torch_decode  # noqa: E402

MODEL = SHARED / "models" / "glm5next-k256"
DEFAULT_GGUF = WORK / "gguf_dequant_speed" / "k256-Q4_K_M.gguf"

Decode = Callable[[GGUFTensorEntry], torch.Tensor]


def log(msg: str) -> None:
    print(f"[gguf_dequant_speed {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ensure_gguf(path: Path) -> Path:
    """The k256 Q4_K_M GGUF (`mixq convert ... --type Q4_K_M --threads 1`), made once."""
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    log(f"converting {MODEL} -> {path}")
    subprocess.run([sys.executable, "-m", "mixq", "convert", str(MODEL), str(path), "--format", "gguf",
                    "--type", "Q4_K_M", "--threads", "1"], check=True)
    return path


def gguf_py(e: GGUFTensorEntry) -> torch.Tensor:
    # a copy, as GGUFSource makes: F32 comes back as a view of the read-only map
    out = np.array(gguf_quants.dequantize(e.raw(), GGMLQuantizationType[e.qtype]), dtype=np.float32)
    return torch.from_numpy(out.reshape(e.shape))


def torch_on(device: str, to_host: bool = False) -> Decode:
    def decode(e: GGUFTensorEntry) -> torch.Tensor:
        t = torch_decode.dequantize(torch_decode.stored_bytes(e.raw()).to(device), e.qtype, e.shape)
        return t.cpu() if to_host else t
    return decode


def one_pass(entries: list[GGUFTensorEntry], decode: Decode, device: str) -> tuple[dict[str, float], list]:
    """Seconds per type of decoding every entry once (the device synchronised per tensor), and the outputs."""
    secs: dict[str, float] = {}
    outs = []
    for e in entries:
        t0 = time.perf_counter()
        out = decode(e)
        if device == "cuda":
            torch.cuda.synchronize()
        secs[e.qtype] = secs.get(e.qtype, 0.0) + time.perf_counter() - t0
        outs.append(out)
    return secs, outs


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu().contiguous(), b.contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=None, help=f"GGUF file [default: {DEFAULT_GGUF}, made from glm5next-k256]")
    ap.add_argument("--rounds", type=int, default=7, help="passes per path, alternating; the best counts")
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args(argv)

    path = Path(a.gguf) if a.gguf else ensure_gguf(DEFAULT_GGUF)
    g = read_gguf(path)
    entries = [e for e in g.tensors.values() if torch_decode.can_decode(e.qtype)]
    skipped = sorted({e.qtype for e in g.tensors.values()} - {e.qtype for e in entries})
    weights: dict[str, int] = {}
    for e in entries:
        weights[e.qtype] = weights.get(e.qtype, 0) + int(np.prod(e.shape))
    total = sum(weights.values())
    row = int(np.median([e.shape[-1] for e in entries]))  # gguf-py pays per 16 rows: narrow rows cost it more
    log(f"{path.name}: {len(entries)} tensors, {total / 1e6:.2f} M weights "
        f"({', '.join(f'{t} {n / 1e6:.2f} M' for t, n in sorted(weights.items()))}), median row {row}"
        + (f"; left out: {skipped}" if skipped else ""))

    threads = torch.get_num_threads()
    paths: list[tuple[str, str, Decode, int]] = [
        ("gguf-py", "cpu", gguf_py, 1),  # numpy: one thread
        (f"torch-cpu-{threads}t", "cpu", torch_on("cpu"), threads),
        ("torch-cpu-1t", "cpu", torch_on("cpu"), 1),
    ]
    if torch.cuda.is_available():
        paths += [("torch-cuda", "cuda", torch_on("cuda"), threads),
                  ("torch-cuda-to-host", "cuda", torch_on("cuda", to_host=True), threads)]

    # rounds alternate over the paths, so that load from others on shared cores falls on every path alike
    best: dict[str, dict[str, float]] = {}
    for r in range(a.rounds):
        ref: list[torch.Tensor] = []
        for name, device, decode, n_threads in paths:
            torch.set_num_threads(n_threads)
            if r == 0:
                one_pass(entries[:8], decode, device)  # warm-up: grids, allocator, CUDA context
            secs, outs = one_pass(entries, decode, device)
            torch.set_num_threads(threads)
            if r == 0 and not ref:
                ref = outs
            elif r == 0:
                bad = [e.name for e, x, y in zip(entries, outs, ref) if not same_bits(x, y)]
                assert not bad, f"{name}: {len(bad)} tensors differ from gguf-py's, e.g. {bad[:3]}"
            del outs
            if name not in best or sum(secs.values()) < sum(best[name].values()):
                best[name] = secs
        del ref
    res: dict[str, dict] = {}
    for name, device, _, n_threads in paths:
        sec = sum(best[name].values())
        res[name] = {"device": device, "threads": n_threads, "seconds": round(sec, 5),
                     "mweights_per_s": round(total / sec / 1e6, 1),
                     "by_type": {t: round(weights[t] / s / 1e6, 1) for t, s in sorted(best[name].items())}}

    base = res["gguf-py"]["mweights_per_s"]
    print(f"\n{'path':<20}{'M weights/s':>12}{'x gguf-py':>11}   per type (M weights/s)")
    for name, fig in res.items():
        fig["ratio_to_gguf_py"] = round(fig["mweights_per_s"] / base, 2)
        per = "  ".join(f"{t} {v:g}" for t, v in fig["by_type"].items())
        print(f"{name:<20}{fig['mweights_per_s']:>12.1f}{fig['ratio_to_gguf_py']:>11.2f}   {per}")
    print(f"every tensor of every path is bit-identical to gguf-py's ({len(entries)} tensors)")

    if a.json:
        out = {"gguf": str(path.resolve()), "model": str(MODEL), "tensors": len(entries), "weights": total,
               "weights_by_type": weights, "median_row_weights": row, "left_out_types": skipped,
               "rounds": a.rounds, "identical": True, "paths": res, "torch": torch.__version__,
               "numpy": np.__version__, "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
               "machine": platform.machine(),
               "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
        write_json(a.json, repo_relative(out))
        log(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
