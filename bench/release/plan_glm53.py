"""Plans for the GLM-5.3-Flash shape: 108 GB EXL3 and GGUF, q8_0 cache bytes, --fit 121GB at 262K.

    python bench/release/plan_glm53.py [--config PATH] [--json OUT]

Shapes only (no weights): runs in about half a minute on one core.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mixq.planning.fit import fit_plan
from mixq.planning.display import format_plan, pattern_table
from mixq.planning.planner import plan_model
from mixq.errors import PlanError
from mixq.formats.checkpoint import checkpoint_from_config
from mixq.planning.memory import CacheGeometry, exllamav3_cache, llama_cpp_cache

DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "shared" / "models" / "glm-5.3-flash-shape" / "config.json"
UD_Q2_K_XL = 108.72e9  # the Unsloth quant known to run 262K on a 121 GB machine with ~12 GB to spare


def _budget_rows(plan) -> list[str]:
    out = []
    for r in pattern_table(plan):
        if r["role"] in ("routed_expert", "attn", "shared_expert", "dense_mlp", "lm_head") and (
                plan.format == "gguf" or any(k[0].isdigit() for k in r["levels"])):
            lv = ", ".join(f"{k}x{v}" for k, v in sorted(r["levels"].items()))
            out.append(f"    {r['pattern'][:60]:<60} {lv}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--json", help="write every number printed here as JSON")
    a = ap.parse_args()
    t0 = time.time()
    ck = checkpoint_from_config(a.config)
    print(f"GLM-5.3-Flash shape: {ck.params / 1e9:.2f}B params, {len(ck.names())} tensors "
          f"(built from the config in {time.time() - t0:.1f}s)\n")
    report: dict = {}
    for fmt, kw in (("exl3", {}), ("gguf", {"gguf_ladder": "iq"})):
        t = time.time()
        p = plan_model(ck, fmt, size="108GB", **kw)
        print(f"=== {fmt.upper()} --size 108GB {kw or ''} ({time.time() - t:.1f}s): total {p.total_bytes:,} bytes "
              f"({p.total_bytes / 108e9 - 1:+.4%} of 108e9), bpw {p.bpw:.3f}, whole file {p.file_bpw:.3f}")
        print(format_plan(p, per_tensor=False))
        print("  budgeted tensors (layers collapsed):")
        print("\n".join(_budget_rows(p)))
        print()
        report[f"{fmt}_108GB"] = {"total_bytes": p.total_bytes, "bpw": p.bpw, "file_bpw": p.file_bpw,
                                  "roles": p.roles}
    try:
        plan_model(ck, "gguf", size="108GB")
    except PlanError as e:
        print(f"GGUF 108GB with K-quants only: {e}\n")
    q4 = plan_model(ck, "gguf", qtype="Q4_K_M")
    print(f"reference: llama-quantize Q4_K_M of this shape = {q4.total_bytes / 1e9:.3f} GB (bpw {q4.bpw:.3f})\n")

    geo = CacheGeometry.from_config(ck.text_config)
    print("cache bytes (one sequence):")
    report["cache"] = {}
    for n in (32768, 262144, 1048576):
        c = llama_cpp_cache(geo, n, cache_type="q8_0")
        e = exllamav3_cache(geo, n, cache="q8")
        print(f"  {n:>8} tokens  llama.cpp q8_0 {c.total:>15,} B = {c.total / 1e9:7.3f} GB "
              f"(MLA {c.mla / 1e9:.3f}, indexer {c.indexer / 1e9:.3f}, KDA state {c.fixed / 1e9:.3f})   "
              f"exllamav3 q8 {e.total / 1e9:7.3f} GB")
        report["cache"][n] = {"llama_cpp_q8_0": c.to_dict(), "exllamav3_q8": e.to_dict()}
    print()
    for fmt, kw in (("gguf", {"cache": "q8_0", "gguf_ladder": "k"}), ("gguf", {"cache": "q8_0", "gguf_ladder": "iq"}),
                    ("exl3", {"cache": "q8"})):
        f = fit_plan(ck, fmt, fit="121GB", context=262144, devices="64GB,64GB", **kw)
        print(f"=== {fmt.upper()} --fit 121GB --context 262144 {' '.join(f'--{k} {v}' for k, v in kw.items())}")
        print(f.format(per_tensor=False))
        print("  budgeted tensors (layers collapsed):")
        print("\n".join(_budget_rows(f.plan)))
        print()
        report[f"{fmt}_{kw.get('gguf_ladder', '')}_fit_121GB_262K"] = {k: v for k, v in f.to_dict().items() if k != "plan"} | {
            "plan_bpw": f.plan.bpw, "roles": f.plan.roles}
    c = llama_cpp_cache(geo, 262144, cache_type="q8_0")
    print(f"UD-Q2_K_XL ({UD_Q2_K_XL / 1e9:.2f} GB) on 121 GB at 262K/q8_0: 121 - weights = "
          f"{(121e9 - UD_Q2_K_XL) / 1e9:.2f} GB, minus cache {c.total / 1e9:.2f} GB = "
          f"{(121e9 - UD_Q2_K_XL - c.total) / 1e9:.2f} GB for compute buffers and slack")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1, default=str))
    print(f"\ndone in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
