"""GLM-5.3-Flash on 2x24 GB cards + 128 GB host RAM at 204,800 tokens: llama.cpp's expert offload planned.

    python bench/release/plan_glm53_offload.py     # -> bench/results/plan_glm53_offload.json

Shapes only (no weights). Three plans: every layer's routed experts in host RAM (-ot), the same with the i-quant
ladder, and --n-cpu-moe auto (the layer count with the least predicted error); each with its per-device bytes
and the llama.cpp flags that realise it.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from paths import REPO, SHARED, repo_relative  # noqa: E402

from mixq.formats.checkpoint import checkpoint_from_config  # noqa: E402
from mixq.planning.offload import offload_plan  # noqa: E402

MACHINE = dict(gpu="2x24GB", cpu="128GB", context=204800)
CASES = {"all_experts_k": {}, "all_experts_iq": {"gguf_ladder": "iq"}, "n_cpu_moe_auto": {"n_cpu_moe": "auto"}}


def summary(res) -> dict:
    """What the docs quote of one plan: its size, the experts' types, each device and the flags."""
    experts: dict[str, int] = {}
    for t in res.plan.tensors:
        if t.role == "routed_expert":
            experts[t.type] = experts.get(t.type, 0) + 1
    return {"weights_bytes": sum(t.bytes for t in res.plan.tensors), "file_bytes": res.plan.total_bytes,
            "file_gib": res.plan.total_bytes / 2**30, "expert_tensor_types": experts,
            "devices": [d.to_dict() for d in res.devices], "flags": res.flags(), "command": res.command(),
            "cache_bytes": res.cache.total, "notes": res.notes}


def main() -> None:
    ck = checkpoint_from_config(SHARED / "models" / "glm-5.3-flash-shape" / "config.json")
    out = {"machine": MACHINE, "config": SHARED / "models" / "glm-5.3-flash-shape" / "config.json"}
    for name, kw in CASES.items():
        t = time.time()
        res = offload_plan(ck, **MACHINE, **kw)
        out[name] = summary(res)
        print(f"=== {name} ({time.time() - t:.0f}s)\n{res.format().split(chr(10) + chr(10))[-1]}\n")
    path = REPO / "bench" / "results" / "plan_glm53_offload.json"
    path.write_text(json.dumps(repo_relative(out), indent=1, default=str) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
