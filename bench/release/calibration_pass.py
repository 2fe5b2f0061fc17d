"""The calibration forward of an EXL3 conversion, with and without the routed experts' output in its statistics pass
(`LayerCalibrator(advance_with_weights=...)`), side by side on one model: seconds of the statistics pass and of the
advance pass per layer, and whether the Hessians and the advanced hidden streams are the same.

    python bench/release/calibration_pass.py [--model DIR | --experts 64 --hidden 512] [--rows 32] [--seq-len 512]
        [--device cpu] [--json OUT.json]

The statistics pass puts every calibration token through every routed expert; the conversion advances each layer
with its quantized weights afterwards, so the pass's own output is never read. Default model: the k256 fixture;
`--experts N` writes a random two-layer checkpoint (one dense layer, one MoE layer of N experts, width `--hidden`)
where, as in GLM-5.3-Flash's MoE layers, the routed experts are most of the pass's work.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from mixq.formats.checkpoint import open_checkpoint
from mixq.formats.tiny import write_tiny_checkpoint
from mixq.runtime.calibration import LayerCalibrator

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from paths import SHARED, repo_relative  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def walk(ck, ids: torch.Tensor, dev: torch.device, lean: bool) -> tuple[list[dict], dict, torch.Tensor]:
    """Per layer: statistics-pass and advance seconds; the Hessians; the final hidden streams."""
    cal = LayerCalibrator(ck, ids, device=dev, batch_rows=4, advance_with_weights=lean)
    names = set(ck.names())
    rows, hessians = [], {}
    it = cal.stages()
    while True:
        _sync(dev)
        t0 = time.perf_counter()
        st = next(it)
        _sync(dev)
        t1 = time.perf_counter()
        if st.layer is None:
            break
        hessians.update({n: a.hessian() for n, a in st.stats.items()})
        st.advance({n: ck.get(n) for n in st.stats if n in names})
        _sync(dev)
        rows.append({"layer": st.layer, "stats_s": round(t1 - t0, 3), "advance_s": round(time.perf_counter() - t1, 3)})
    return rows, hessians, cal.hidden


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHARED / "models" / "glm5next-k256"))
    ap.add_argument("--experts", type=int, default=None, help="a random checkpoint with this many routed experts")
    ap.add_argument("--hidden", type=int, default=512, help="its width (with --experts)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=2, help="walks per setting, alternating; the best is kept")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    tmp = tempfile.TemporaryDirectory()
    if a.experts:
        a.model = f"random: {a.experts} experts, hidden {a.hidden}, layers linear_attention x2 (one dense)"
        ck = open_checkpoint(write_tiny_checkpoint(Path(tmp.name) / "m", hidden=a.hidden, n_experts=a.experts,
                                                   top_k=8, layer_types=("linear_attention",) * 2,
                                                   dense_layers=1, nextn=False, vision=False))
    else:
        ck = open_checkpoint(a.model)
    vocab = ck.config.get("text_config", ck.config)["vocab_size"]
    ids = torch.randint(0, vocab, (a.rows, a.seq_len), generator=torch.Generator().manual_seed(0))
    best: dict[bool, list[dict]] = {}
    out: dict[bool, tuple] = {}
    for _ in range(a.repeat):
        for lean in (False, True):
            rows, hs, hidden = walk(ck, ids, dev, lean)
            out[lean] = (hs, hidden)
            if lean not in best:
                best[lean] = rows
            else:
                best[lean] = [{k: (min(r[k], q[k]) if k != "layer" else r[k]) for k in r}
                              for r, q in zip(best[lean], rows)]
    same_h = all(torch.equal(out[False][0][n], out[True][0][n]) for n in out[False][0] if out[False][0][n] is not None)
    same_hidden = torch.equal(out[False][1], out[True][1])
    total = {lean: round(sum(r["stats_s"] for r in best[lean]), 3) for lean in best}
    print("| layer | statistics pass, with routed output (s) | without (s) | advance (s) |")
    print("|---|---:|---:|---:|")
    for r, q in zip(best[False], best[True]):
        print(f"| {r['layer']} | {r['stats_s']:.3f} | {q['stats_s']:.3f} | {r['advance_s']:.3f} |")
    print(f"statistics passes: {total[False]:.3f} s -> {total[True]:.3f} s "
          f"(x{total[False] / max(total[True], 1e-9):.2f}); same Hessians: {same_h}; same streams: {same_hidden}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(repo_relative({"model": a.model, "rows": a.rows, "seq_len": a.seq_len, "device": str(dev),
                                     "with_routed_output": best[False], "without": best[True],
                                     "stats_seconds": {"with": total[False], "without": total[True]},
                                     "same_hessians": same_h, "same_streams": same_hidden}), f, indent=1)
    return 0 if same_h and same_hidden else 1


if __name__ == "__main__":
    raise SystemExit(main())
