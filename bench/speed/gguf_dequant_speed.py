"""Dequantization speed of a GGUF: gguf-py's numpy decoders vs mixq's torch decoders (quant/ggml/torch_decode).

    python bench/speed/gguf_dequant_speed.py                        # glm5next-k256 Q4_K_M, made under WORK if absent
    python bench/speed/gguf_dequant_speed.py --gguf F.gguf --rounds 5 --json bench/results/gguf_dequant_speed_cpu.json
    python bench/speed/gguf_dequant_speed.py --device cuda --gguf F.gguf --max-weights 200000000 \
        --synthetic IQ2_S,IQ2_XS,Q4_K --rounds 3 --json OUT.json          # torch on the GPU vs gguf-py

Every tensor of the file is decoded from its memory-mapped bytes by each path: gguf-py (`gguf.quants.dequantize`,
numpy, one thread), torch on the CPU with torch's threads and with one, and torch on CUDA when there is one (the
bytes copied to the GPU, decoded, synchronised; and once more with the values copied back to the host, as
runtime/dequant's GGUFSource hands them out). `--device cpu` runs the CPU rows only, `--device cuda` gguf-py and the
CUDA rows (default: every row this machine has). `--max-weights N` takes, per type, the file's tensors in order
until N weights (a 10 GB slice file would take gguf-py minutes a pass); `--synthetic TYPES` adds one
`--synthetic-shape` tensor per type of valid random blocks (every fp16 scale finite), for types the file lacks. A
type torch_decode does not know is left out of every path. Each path's time is the best of --rounds passes over
every tensor; printed per path: M weights/s and GB/s of stored blocks read, overall and per type, and the ratio to
gguf-py. Every tensor of a CPU path must be bit-identical to gguf-py's, of a CUDA path within 1e-6 relative (the
bound of torch_decode's GPU test; CUDA may contract a multiply-add): the run fails otherwise. On cores shared with
other jobs torch's multi-threaded row can lose most of its speed (its threads wait on each other at every op), so
the JSON keeps the load average; the one-thread row is the steadier figure. glm5next-k256's rows are short (256
weights), where gguf-py pays most for its per-16-rows Python loop: wider rows narrow the gap.
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
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from paths import SHARED, WORK, repo_relative  # noqa: E402

from mixq.formats.atomic import write_json  # noqa: E402
from mixq.formats.gguf_reader import GGUFTensorEntry, read_gguf  # noqa: E402
from mixq.quant.ggml import torch_decode  # noqa: E402

MODEL = SHARED / "models" / "glm5next-k256"
DEFAULT_GGUF = WORK / "gguf_dequant_speed" / "k256-Q4_K_M.gguf"

Decode = Callable[[GGUFTensorEntry], torch.Tensor]
SCALE_FIELDS = ("d", "dmin", "m")  # the fp16 fields of torch_decode.FIELDS
CUDA_REL_TOL = 1e-6                # torch_decode's GPU test: CUDA values within this of gguf-py's


class SyntheticEntry:
    """A tensor of valid random blocks, standing in for a GGUF entry (name, qtype, shape, raw bytes)."""

    def __init__(self, qtype: str, shape: tuple[int, int], seed: int = 0) -> None:
        self.name, self.qtype, self.shape = f"synthetic.{qtype}", qtype, tuple(shape)
        self._raw = valid_random_bytes(qtype, shape[0], shape[1], np.random.default_rng(seed))
        self.n_bytes = int(self._raw.nbytes)

    def raw(self) -> np.ndarray:
        return self._raw


def valid_random_bytes(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of `qtype` with every fp16 scale finite -> (rows, row bytes) uint8: random bytes reach every
    code, sign and grid index, and the decode time does not depend on the values. IQ1_M keeps its fp16 scale in
    the top nibbles of its four 16-bit scale words; float types are random finite values."""
    if qtype in ("F32", "F16", "BF16"):
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        return np.asarray(gguf_quants.quantize(x, GGMLQuantizationType[qtype])).view(np.uint8).reshape(rows, -1)
    per_block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, (rows, cols // per_block * nbytes), dtype=np.uint8)
    blocks = raw.reshape(-1, nbytes)
    at = 0
    for name, size in torch_decode.FIELDS[qtype]:
        halves = rng.uniform(-2.0, 2.0, len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2)
        if name in SCALE_FIELDS:
            blocks[:, at:at + 2] = halves
        elif qtype == "IQ1_M" and name == "scales":
            h = halves.view(np.uint16)[:, 0]
            for j in range(4):
                hi = at + 2 * j + 1
                blocks[:, hi] = (blocks[:, hi] & 0x0F) | (((h >> (4 * j)) & 0xF) << 4).astype(np.uint8)
        at += size
    return raw


def capped(entries: list, max_weights: int | None) -> list:
    """Per type, the entries in order until `max_weights` weights (the first of each type always)."""
    if max_weights is None:
        return entries
    seen: dict[str, int] = {}
    out = []
    for e in entries:
        n = int(np.prod(e.shape))
        if seen.get(e.qtype, 0) and seen[e.qtype] + n > max_weights:
            continue
        seen[e.qtype] = seen.get(e.qtype, 0) + n
        out.append(e)
    return out


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


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max relative difference of `a` from the reference `b` (equal values, zeros and infinities count 0)."""
    a, b = a.cpu().float(), b.float()
    if a.shape != b.shape:
        return float("inf")
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    d = ((a - b).abs() / b.abs().clamp_min(1e-30)).masked_fill(same, 0.0)
    return float(d.max()) if d.numel() else 0.0


def path_list(device: str, threads: int) -> list[tuple[str, str, Decode, int]]:
    """(name, device, decoder, threads) of the rows to time: gguf-py always; torch on the CPU unless --device
    cuda; torch on CUDA (and with the copy back to the host) when asked or present."""
    cuda = torch.cuda.is_available()
    if device == "cuda" and not cuda:
        raise SystemExit("--device cuda: torch sees no CUDA device")
    paths: list[tuple[str, str, Decode, int]] = [("gguf-py", "cpu", gguf_py, 1)]  # numpy: one thread
    if device in ("auto", "cpu"):
        paths += [(f"torch-cpu-{threads}t", "cpu", torch_on("cpu"), threads),
                  ("torch-cpu-1t", "cpu", torch_on("cpu"), 1)]
    if device == "cuda" or (device == "auto" and cuda):
        paths += [("torch-cuda", "cuda", torch_on("cuda"), threads),
                  ("torch-cuda-to-host", "cuda", torch_on("cuda", to_host=True), threads)]
    return paths


def check(name: str, device: str, entries: list, outs: list, ref: list) -> float:
    """A CPU path must give gguf-py's bits, a CUDA path values within CUDA_REL_TOL; returns the max relative
    difference (0 for identical bits)."""
    if device == "cpu":
        bad = [e.name for e, x, y in zip(entries, outs, ref) if not same_bits(x, y)]
        assert not bad, f"{name}: {len(bad)} tensors differ from gguf-py's, e.g. {bad[:3]}"
        return 0.0
    worst = max((rel_diff(x, y) for x, y in zip(outs, ref)), default=0.0)
    assert worst <= CUDA_REL_TOL, f"{name}: values differ from gguf-py's by {worst:.3g} relative (> {CUDA_REL_TOL})"
    return worst


def figures(best: dict[str, float], weights: dict[str, int], nbytes: dict[str, int]) -> dict:
    """M weights/s and GB/s of stored blocks read, overall and per type, from seconds per type."""
    sec = sum(best.values())
    return {"seconds": round(sec, 5), "mweights_per_s": round(sum(weights.values()) / sec / 1e6, 1),
            "gb_per_s": round(sum(nbytes.values()) / sec / 1e9, 3),
            "out_gb_per_s": round(4 * sum(weights.values()) / sec / 1e9, 3),
            "by_type": {t: round(weights[t] / s / 1e6, 1) for t, s in sorted(best.items())},
            "by_type_gb_per_s": {t: round(nbytes[t] / s / 1e9, 3) for t, s in sorted(best.items())}}


def parse_shape(spec: str) -> tuple[int, int]:
    rows, _, cols = spec.lower().partition("x")
    return int(rows), int(cols)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=None, help=f"GGUF file [default: {DEFAULT_GGUF}, made from glm5next-k256, "
                                                  "unless --synthetic is given]")
    ap.add_argument("--rounds", type=int, default=7, help="passes per path, alternating; the best counts")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="rows to time: cpu (gguf-py, torch on the CPU), cuda (gguf-py, torch on CUDA), auto (all "
                         "this machine has)")
    ap.add_argument("--max-weights", type=int, default=None, help="per type, the file's tensors up to this many weights")
    ap.add_argument("--synthetic", default="", help="TYPE,...: one tensor of valid random blocks per type as well")
    ap.add_argument("--synthetic-shape", default="1024x4096", help="ROWSxCOLS of each synthetic tensor")
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args(argv)

    synth = [t.strip().upper() for t in a.synthetic.split(",") if t.strip()]
    path = Path(a.gguf) if a.gguf else (None if synth else ensure_gguf(DEFAULT_GGUF))
    entries: list = []
    skipped: list[str] = []
    if path is not None:
        g = read_gguf(path)
        entries = capped([e for e in g.tensors.values() if torch_decode.can_decode(e.qtype)], a.max_weights)
        skipped = sorted({e.qtype for e in g.tensors.values()} - {e.qtype for e in entries})
    unknown = [t for t in synth if not torch_decode.can_decode(t)]
    if unknown:
        raise SystemExit(f"--synthetic: torch_decode does not decode {unknown}")
    shape = parse_shape(a.synthetic_shape)
    entries += [SyntheticEntry(t, shape, seed=i) for i, t in enumerate(synth)]
    weights: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    for e in entries:
        weights[e.qtype] = weights.get(e.qtype, 0) + int(np.prod(e.shape))
        nbytes[e.qtype] = nbytes.get(e.qtype, 0) + int(e.raw().nbytes)
    total = sum(weights.values())
    row = int(np.median([e.shape[-1] for e in entries]))  # gguf-py pays per 16 rows: narrow rows cost it more
    log(f"{path.name if path else 'synthetic'}: {len(entries)} tensors, {total / 1e6:.2f} M weights "
        f"({', '.join(f'{t} {n / 1e6:.2f} M' for t, n in sorted(weights.items()))}), median row {row}"
        + (f"; left out: {skipped}" if skipped else ""))

    threads = torch.get_num_threads()
    paths = path_list(a.device, threads)

    # rounds alternate over the paths, so that load from others on shared cores falls on every path alike
    best: dict[str, dict[str, float]] = {}
    diffs: dict[str, float] = {}
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
                diffs[name] = check(name, device, entries, outs, ref)
            del outs
            if name not in best or sum(secs.values()) < sum(best[name].values()):
                best[name] = secs
        del ref
    res: dict[str, dict] = {}
    for name, device, _, n_threads in paths:
        res[name] = {"device": device, "threads": n_threads, **figures(best[name], weights, nbytes),
                     "max_rel_diff": diffs.get(name, 0.0)}

    base = res["gguf-py"]["mweights_per_s"]
    print(f"\n{'path':<20}{'M weights/s':>12}{'GB/s':>8}{'x gguf-py':>11}   per type (GB/s of stored blocks)")
    for name, fig in res.items():
        fig["ratio_to_gguf_py"] = round(fig["mweights_per_s"] / base, 2)
        per = "  ".join(f"{t} {v:g}" for t, v in fig["by_type_gb_per_s"].items())
        print(f"{name:<20}{fig['mweights_per_s']:>12.1f}{fig['gb_per_s']:>8.2f}{fig['ratio_to_gguf_py']:>11.2f}   {per}")
    cuda_rows = [n for n, f in res.items() if f["device"] == "cuda"]
    print(f"every tensor of every CPU path is bit-identical to gguf-py's ({len(entries)} tensors)"
          + (f"; CUDA within {max(diffs.get(n, 0.0) for n in cuda_rows):.2g} relative" if cuda_rows else ""))

    if a.json:
        out = {"gguf": str(path.resolve()) if path else None, "model": str(MODEL) if not a.gguf and path else None,
               "tensors": len(entries), "weights": total, "weights_by_type": weights, "bytes_by_type": nbytes,
               "median_row_weights": row, "left_out_types": skipped, "synthetic": synth,
               "synthetic_shape": list(shape) if synth else None, "max_weights": a.max_weights,
               "device": a.device, "rounds": a.rounds, "identical": all(v == 0.0 for v in diffs.values()),
               "cuda_rel_tol": CUDA_REL_TOL, "paths": res, "torch": torch.__version__, "numpy": np.__version__,
               "cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "machine": platform.machine(),
               "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
        write_json(a.json, repo_relative(out))
        log(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
