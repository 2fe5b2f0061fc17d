"""The NextN (MTP) head's draft agreement across NextN types and bits, on k256 with a trained NextN block.

The reference is the model written by train_nextn.py (k256's trunk, its NextN block trained). Every candidate keeps
the trunk at one fixed type (GGUF: Q8_0; EXL3: --bpw 6, head 6 bits) and varies the NextN block alone: GGUF by
`--tensor-type` rules on the block's matmuls (Q4_K with and without an imatrix, Q6_K, IQ3_S and IQ2_XS with one,
BF16), EXL3 by `--mtp-bits` 3 / 4 / 6. `mixq eval --mtp` scores them all in one forward against the reference,
whose own NextN head gives the figure they are compared with, on the same positions (the paired difference and
its standard error: eval/mtp.py). Writes bench/results/nextn_types_k256.json.

    PYTHONPATH=.. python bench/quality/nextn_types.py --model ../bench-work/k256-nextn-trained --device cuda
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from paths import REPO, SHARED, WORK, repo_relative  # noqa: E402

import mixq  # noqa: E402
from mixq.formats.checkpoint import open_checkpoint  # noqa: E402

# the NextN block's matmuls (its norms stay F32, its embedding and head are the trunk's)
NEXTN_MATMULS = (r"blk\.{i}\.(attn_(q_a|q_b|kv_a_mqa|k_b|v_b|output)|ffn_(gate|up|down)_(exps|shexp)|ffn_gate_inp|"
                 r"indexer\.(attn_k|attn_q_b|proj)|nextn\.eh_proj)\.weight")
GGUF_TRUNK = "Q8_0"
GGUF_ROWS = (("BF16", False), ("Q6_K", False), ("Q4_K", False), ("Q4_K", True), ("IQ3_S", True), ("IQ2_XS", True))
EXL3_TRUNK_BPW = 6.0
EXL3_MTP_BITS = (3, 4, 6)


def summarise(result: dict) -> dict:
    """`result` with each row's binomial standard error of its agreement (`agreement_se`) and, at the top, the
    smallest difference from the reference the run can resolve without paired counts: two standard errors of the
    difference of two independent rates at the reference's agreement (`unpaired_resolution`). Rows that carry
    the paired counts (`mtp_delta_se`) resolve far smaller differences."""
    n = result["positions"]
    for r in result["rows"]:
        p = r.get("mtp_agreement")
        if p is not None and n:
            r["agreement_se"] = math.sqrt(p * (1 - p) / n)
    p = result["reference_agreement"]
    result["unpaired_resolution"] = 2 * math.sqrt(2 * p * (1 - p) / n) if n else None
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=WORK / "k256-nextn-trained")
    ap.add_argument("--work", type=Path, default=WORK / "nextn-types")
    ap.add_argument("--result", type=Path, default=REPO / "bench" / "results" / "nextn_types_k256.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--formats", default="gguf,exl3", help="the candidate formats: gguf, exl3 or both")
    ap.add_argument("--summarise", type=Path, help="only add the standard errors to this stored result")
    a = ap.parse_args()
    if a.summarise:
        a.summarise.write_text(json.dumps(summarise(json.loads(a.summarise.read_text())), indent=1) + "\n")
        return
    a.work.mkdir(parents=True, exist_ok=True)
    layer = open_checkpoint(a.model).nextn_layers[0]
    rule_rx = NEXTN_MATMULS.format(i=layer)
    t0 = time.time()
    imx = a.work / "imatrix.gguf"
    mixq.imatrix(a.model, imx, [str(SHARED / "data" / "calibration.txt")], rows=64, seq_len=512, device=a.device,
                 overwrite=True, progress=False)
    rows: list[dict] = []
    cands: list[Path] = [a.model]
    rows.append({"kind": "bf16", "label": "BF16 (the reference itself)", "path": str(a.model)})
    formats = set(a.formats.split(","))
    for qtype, with_imx in GGUF_ROWS if "gguf" in formats else ():
        out = a.work / f"nextn-{qtype}{'-imatrix' if with_imx else ''}.gguf"
        mixq.convert(a.model, out, qtype=GGUF_TRUNK, tensor_type=[f"{rule_rx}={qtype}"],
                     imatrix=str(imx) if with_imx else None, overwrite=True, progress=False, device=a.device)
        cands.append(out)
        rows.append({"kind": "gguf", "label": f"GGUF NextN {qtype}{' + imatrix' if with_imx else ''}",
                     "nextn_type": qtype, "imatrix": with_imx, "trunk": GGUF_TRUNK, "path": str(out)})
    for bits in EXL3_MTP_BITS if "exl3" in formats else ():
        out = a.work / f"nextn-exl3-mtp{bits}"
        mixq.convert(a.model, out, "exl3", bpw=EXL3_TRUNK_BPW, head_bits=6, mtp_bits=bits,
                     progress=False, device=a.device)
        cands.append(out)
        rows.append({"kind": "exl3", "label": f"EXL3 --mtp-bits {bits}", "mtp_bits": bits,
                     "trunk_bpw": EXL3_TRUNK_BPW, "path": str(out)})
    rep = mixq.evaluate(a.model, [str(c) for c in cands], str(SHARED / "data" / "heldout.txt"), ctx=a.ctx,
                        windows=a.windows, mtp=True, device=a.device, progress=False,
                        markdown_out=str(a.work / "eval.md"), overwrite=True)
    by_path = {c["path"]: c for c in rep["candidates"]}
    for r in rows:
        c = by_path[str(Path(r["path"]))]
        r.update({k: c.get(k) for k in ("bpw", "bytes", "kld_mean", "top1", "mtp_agreement", "mtp_relative",
                                        "mtp_gained", "mtp_lost", "mtp_delta", "mtp_delta_se", "mtp_note")})
    result = {"model": str(a.model), "reference_agreement": rep["mtp"].get("agreement"),
              "positions": rep["mtp"].get("positions"), "ctx": a.ctx, "windows": a.windows,
              "text": "shared/data/heldout.txt", "device": a.device, "seconds": round(time.time() - t0, 1),
              "rows": rows}
    a.result.parent.mkdir(parents=True, exist_ok=True)
    a.result.write_text(json.dumps(repo_relative(summarise(result)), indent=1) + "\n")
    print((a.work / "eval.md").read_text())


if __name__ == "__main__":
    main()
