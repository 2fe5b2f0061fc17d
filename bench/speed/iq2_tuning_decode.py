"""The IQ2 codes' decode in block-output tuning (quant/ggml/rounding/block_tuning.IQ2Codes): per step of a descent at the
tuner's rate, the share of groups whose rounded positions form no codebook tuple (the decode searches the codebook
for those at every step); then, side by side, the decode's forward + backward and the codebook search alone with
the neighbour search (`neighbour_entries`, the tuner's on the CPU for the types of IQ2_NEIGHBOUR_TYPES), with every
entry scored (`scored_entries`) and, where the Triton kernels run, with the fused search (`fused_entries`), each
in the eager decode, then the one-kernel decode (the tuner's there, `triton_iq2_decode`); how many groups the
neighbour search left to the full one, and how many groups each search answers differently from the full one
(ties within float32 rounding: the lower exact score is counted), on a random stack of expert-shaped matrices
encoded by ggml's encoder.

    python bench/speed/iq2_tuning_decode.py [--types IQ2_S,IQ2_XS] [--experts 2] [--rows 256] [--cols 4096] [--iters 25]
        [--device cpu] [--json OUT.json]

The loss is a least-squares fit of the stack's outputs on random inputs (the descent's direction only matters for
which codes move, not for the timings).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from mixq.conversion.gguf.tuning import GROUP_ITERS_SHARE, TUNE_LR, stored_blocks
from mixq.conversion.options import DEFAULT_TUNE_ITERS
from mixq.quant.ggml.rounding import block_tuning as bt
from mixq.quant.ggml.rounding import levels as gl


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _best_of(fn, dev: torch.device, repeat: int) -> float:
    fn()
    _sync(dev)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return min(times)


def _profile(decode, dev: torch.device, title: str, path: Path) -> None:
    """torch's profiler table (by device time where there is one) of one decode, appended to `path`."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    decode()
    _sync(dev)
    with profile(activities=acts) as prof:
        decode()
        _sync(dev)
    key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    with path.open("a") as f:
        f.write(f"== {title}\n{prof.key_averages().table(sort_by=key, row_limit=25)}\n")


def measure(qtype: str, experts: int, rows: int, cols: int, iters: int, dev: torch.device, repeat: int,
            profile_to: Path | None = None) -> dict:
    """Miss shares along a descent of `iters` steps, then the decode's and the search's seconds at its end."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(experts, rows, cols, generator=g) * 0.02
    blocks = np.stack([np.asarray(stored_blocks(qtype, w[e], np.ones(cols, np.float32), dev))
                       for e in range(experts)])
    codes = bt.tunable_codes(blocks, qtype, w, dev)
    x = torch.randn(experts, 512, cols, generator=g).to(dev)
    target = x @ w.to(dev).transpose(1, 2)

    def loss() -> torch.Tensor:
        return (x @ codes.dequantized().reshape(experts, rows, cols).transpose(1, 2) - target).pow(2).mean()

    shares = []
    for it in range(iters):
        codes.u.grad = None
        loss().backward()
        with torch.no_grad():
            codes.u.sub_(TUNE_LR / iters * (1.0 - it / iters) * torch.sign(codes.u.grad))
        shares.append(round(float(codes.missing().float().mean()), 4))
    codes.u.grad = None

    def decode() -> None:
        codes.dequantized().sum().backward()
        codes.u.grad = None

    with torch.no_grad():
        miss = codes.missing()
        soft = gl.table_values(codes.u.detach().view(*miss.shape, 8), codes.levels)[miss]
    res = {"type": qtype, "weights": experts * rows * cols, "groups": int(miss.numel()),
           "missing_share_per_step": shares}
    neighbour, full = codes.neighbour_entries, codes.scored_entries
    searches = [("scored", full), ("neighbour", neighbour)]
    if bt.use_fused(soft):
        searches.append(("fused", codes.fused_entries))
    one_kernel = bt.use_fused(soft) and codes.fused_decode_ok()
    key = (qtype, str(codes.u.device))
    if one_kernel:  # the eager decode with each search first; the one-kernel decode (the tuner's there) after
        bt.FUSED_DECODE[key] = False
    for name, search in searches:
        codes.nearest_entries = search  # the decode's search, for this row
        res[name] = {"decode_forward_backward_s": round(_best_of(decode, dev, repeat), 4),
                     "search_s": round(_best_of(lambda: search(soft), dev, repeat), 4)}
    del codes.nearest_entries
    if one_kernel:
        bt.FUSED_DECODE[key] = True
        res["one_kernel"] = {"decode_forward_backward_s": round(_best_of(decode, dev, repeat), 4)}
    if profile_to is not None:
        _profile(decode, dev, f"{qtype} decode forward + backward ({experts} x {rows} x {cols}), the tuner's decode",
                 profile_to)
    res.update(searched=int(soft.shape[0]), left_to_full_search=_count_open(codes, soft))
    with torch.no_grad():
        a = full(soft)
        mag = codes.grid.double()
        for name, search in searches[1:]:
            b = search(soft)
            differ = a != b
            t = soft[differ].abs().double()
            gap = [(mag[i] ** 2).sum(-1) - 2 * (t * mag[i]).sum(-1) for i in (b[differ], a[differ])]
            gap = gap[0] - gap[1]
            res[name].update(differ=int(differ.sum()), lower_where_differ=int((gap < 0).sum()),
                             largest_gap_where_differ=float(gap.abs().max()) if gap.numel() else 0.0)
    return res


def _count_open(codes, soft: torch.Tensor) -> int:
    """How many of the groups `soft` the neighbour search leaves to the full one."""
    full, seen = codes.scored_entries, []
    codes.scored_entries = lambda t: (seen.append(t.shape[0]), full(t))[1]
    try:
        codes.neighbour_entries(soft)
    finally:
        del codes.scored_entries
    return sum(seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="IQ2_S,IQ2_XS")
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=max(1, DEFAULT_TUNE_ITERS // GROUP_ITERS_SHARE),
                    help="descent steps (default: an expert group's)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--profile", type=Path, default=None,
                    help="append torch's profiler table of each type's decode (the tuner's own search) here")
    a = ap.parse_args()
    dev = torch.device(a.device)
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "threads": torch.get_num_threads(), "experts": a.experts, "rows": a.rows, "cols": a.cols, "iters": a.iters,
           "types": [measure(t, a.experts, a.rows, a.cols, a.iters, dev, a.repeat, a.profile)
                     for t in a.types.split(",")]}
    for r in res["types"]:
        s = r["missing_share_per_step"]
        print(f"{r['type']}: {r['groups']:,} groups; no codebook tuple after step 1 / {len(s)}: {s[0]:.2f} / "
              f"{s[-1]:.2f}; {r['left_to_full_search']:,} of {r['searched']:,} searched groups left to the full "
              f"search by the neighbour search")
        for name in ("scored", "neighbour", "fused", "one_kernel"):
            if name not in r:
                continue
            x = r[name]
            same = "" if "differ" not in x else (f"; {x['differ']} answered differently from the full search "
                                                 f"({x['lower_where_differ']} lower, gap <= "
                                                 f"{x['largest_gap_where_differ']:.2g})")
            alone = f", the search alone {x['search_s']:.3f} s" if "search_s" in x else " (one kernel)"
            print(f"  {name:10s}: decode forward+backward {x['decode_forward_backward_s']:.3f} s{alone}{same}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
