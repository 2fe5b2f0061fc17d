"""`mixq plan --measure` on glm5next-mini: curves, plans and an actual check (docs/planning.md §3).

    python bench/quality/measure_mini.py [--curves bench/results/measure_mini_curves.json] [--bpw 3.05] [--check 6]

Reads the curves written by `mixq plan MODEL --format exl3 --bpw 3.05 --measure --measure-out FILE` (or
measures them when the file is missing), prints every unit's measured slope (log2 loss per bit between K=2 and
K=6), its bits in the role-default and in the measured plan, and the predicted total loss of both plans. With
--check N, the N single-Linear units whose bits differ most between the two plans are quantized exactly (every
tile, public trellis.quantize with the calibration Hessian) at both plans' rates, and the actual losses summed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT.parent))

from mixq.measurement import trellis as cs  # noqa: E402
from mixq.planning.exl3 import allocator_unit  # noqa: E402
from mixq.planning.planner import plan_model
from mixq.formats.glm5next import global_hf_name  # noqa: E402
from mixq.formats.checkpoint import open_checkpoint  # noqa: E402

SHARED = Path(os.environ.get("MIXQ_SHARED", ROOT.parent / "shared"))


def unit_bits(plan, ck) -> dict[str, float]:
    out = {}
    for t in plan.tensors:
        info = ck.info(t.name)
        if t.bits is not None and info.exl3_bits_key == "bits" and not info.mtp:
            out.setdefault(allocator_unit(info, t.name), t.bits)
    return out


def actual_check(ck, keys, rates_by_key, calibration) -> dict[str, dict[float, float]]:
    """Exact proxy losses of single-Linear units at the given rates (calibration as `--measure` runs it)."""
    import torch

    from mixq.runtime.calibration import LayerCalibrator, calibration_rows, load_tokenizer
    from mixq.quant.trellis import loss as qs

    groups = cs.budget_units(ck)
    ids = calibration_rows(load_tokenizer(ck.path), calibration, rows=cs.MEASURE_ROWS, seq_len=cs.MEASURE_SEQ_LEN,
                           vocab_size=ck.shape(global_hf_name("embed"))[0])
    want = {groups[k][0].hf_names[0]: k for k in keys}
    layers = {ck.info(n).layer for n in want}
    res = {}
    for st in LayerCalibrator(ck, ids, full=True).stages():
        if st.layer is None or st.layer > max(layers):
            break
        for n, k in want.items():
            if ck.info(n).layer == st.layer:
                u = groups[k][0]
                w = u.assemble(lambda x: ck.get(x, dtype=torch.float32))
                rates = sorted(rates_by_key[k])
                loss = qs.measure(w, st.stats[n].hessian(), rates)[:, 0]
                res[k] = dict(zip(rates, loss.tolist()))
        st.advance()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(SHARED / "models" / "glm5next-mini"))
    ap.add_argument("--curves", default=str(ROOT / "bench" / "results" / "measure_mini_curves.json"))
    ap.add_argument("--bpw", type=float, default=3.05)
    ap.add_argument("--check", type=int, default=0, help="exact check on this many single-Linear units")
    ap.add_argument("--json", help="write the summary here")
    a = ap.parse_args()
    calib = [str(SHARED / "data" / "calibration.txt")]
    ck = open_checkpoint(a.model)
    if not Path(a.curves).is_file():
        t0 = time.time()
        curves = cs.measure_curves(ck, calib)
        cs.save_curves(curves, a.curves, meta={"model": a.model, "seconds": round(time.time() - t0, 1)})
    curves = cs.load_curves(a.curves)
    meta = json.loads(Path(a.curves).read_text()).get("_meta", {})
    ref = plan_model(ck, "exl3", bpw=a.bpw)
    got = plan_model(ck, "exl3", bpw=a.bpw, measure=curves)
    rb, gb = unit_bits(ref, ck), unit_bits(got, ck)
    print(f"curves: {a.curves} ({meta.get('seconds', '?')} s to measure)")
    print(f"{'unit':66} {'role':14} {'slope':>6} {'L(4)':>10} {'default':>7} {'measured':>8}")
    rows = []
    for k in curves:
        c = curves[k]
        role = ck.info(cs.budget_units(ck)[k][0].hf_names[0]).role
        slope = math.log2(c[2.0] / c[6.0]) / 4
        rows.append(dict(unit=k, role=role, slope=round(slope, 3), loss4=c[4.0], default=rb[k], measured=gb[k]))
        print(f"{k:66} {role:14} {slope:6.2f} {c[4.0]:10.3g} {rb[k]:7g} {gb[k]:8g}")
    e_ref, e_got = cs.predicted_loss(ref, curves, ck), cs.predicted_loss(got, curves, ck)
    print(f"--bpw {a.bpw}: role-default plan {ref.bpw:.4f} bpw {ref.total_bytes:,} B, predicted loss {e_ref:.5g}")
    print(f"             measured plan     {got.bpw:.4f} bpw {got.total_bytes:,} B, predicted loss {e_got:.5g} "
          f"({e_got / e_ref:.3f}x)")
    summary = dict(bpw=a.bpw, default=dict(bpw=ref.bpw, bytes=ref.total_bytes, predicted=e_ref),
                   measured=dict(bpw=got.bpw, bytes=got.total_bytes, predicted=e_got), units=rows)
    if a.check:
        single = [k for k in curves if not k.endswith(".experts") and rb[k] != gb[k]]
        single.sort(key=lambda k: -abs(rb[k] - gb[k]) * curves[k][4.0])
        keys = single[: a.check]
        t0 = time.time()
        act = actual_check(ck, keys, {k: {rb[k], gb[k]} for k in keys}, calib)
        s_ref = sum(act[k][rb[k]] for k in keys)
        s_got = sum(act[k][gb[k]] for k in keys)
        p_ref = sum(curves[k][rb[k]] for k in keys)
        p_got = sum(curves[k][gb[k]] for k in keys)
        print(f"actual check on {len(keys)} units ({time.time() - t0:.0f} s, exact encodes):")
        for k in keys:
            print(f"  {k:66} {rb[k]:g}->{gb[k]:g} bits: actual {act[k][rb[k]]:.4g} -> {act[k][gb[k]]:.4g}, "
                  f"measured {curves[k][rb[k]]:.4g} -> {curves[k][gb[k]]:.4g}")
        print(f"  sum actual: default {s_ref:.5g}, measured plan {s_got:.5g}; sum predicted: {p_ref:.5g}, {p_got:.5g}")
        summary["check"] = dict(units=keys, actual=act, actual_default=s_ref, actual_measured=s_got,
                                predicted_default=p_ref, predicted_measured=p_got)
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
