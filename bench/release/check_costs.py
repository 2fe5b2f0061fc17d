"""What the reliability checks cost: measured rates, and the estimate for GLM-5.3-Flash (320B parameters).

    python bench/release/check_costs.py --json bench/results/check_costs.json [--gb 1]

Measures, on this machine:
- validate_checkpoint's config side on the GLM-5.3-Flash config (meta-device skeleton, ~38.8k tensor names
  compared with a shapes-only checkpoint of the same config: names, shapes, dtypes, key sizes);
- scan_finite's rate over a BF16 and an FP8 safetensors file of `--gb` GB each (warm page cache: the
  check's own cost; a cold read adds the disk's rate);
- the per-read check inside Checkpoint.get (fused min/max) on a BF16 tensor;
- sha256 (the GGUF seal and GGUF verify) on `--gb` GB in memory.
Then scales them to the 320B model: 640 GB of BF16 or ~330 GB of FP8 weights, a ~108 GB GGUF.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
FLASH_PARAMS = 320e9
GGUF_BYTES = 108e9


def shared_dir() -> Path:
    env = os.environ.get("MIXQ_SHARED")
    return Path(env) if env else REPO.parent / "shared"


def _timed(fn, repeat: int = 2) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat


def config_side_seconds(config: Path) -> dict:
    """validate_checkpoint minus the file opens, on a shapes-only checkpoint of the config."""
    from mixq.formats import checkpoint_check as cc
    from mixq.formats.checkpoint import checkpoint_from_config

    ck = checkpoint_from_config(config)
    t = time.perf_counter()
    expected = cc.expected_shapes(ck)
    t_skeleton = time.perf_counter() - t
    t = time.perf_counter()
    problems = cc._dtype_problems(ck) + cc._config_value_problems(ck, expected) + cc._tensor_set_problems(ck, expected)
    t_compare = time.perf_counter() - t
    return {"tensors": len(ck.names()), "skeleton_s": round(t_skeleton, 2), "compare_s": round(t_compare, 2),
            "problems": len(problems)}


def scan_rate(dtype: torch.dtype, gb: float, tmp: Path) -> float:
    """MB/s of scan_finite over one safetensors file of `gb` GB of (6144, 2048) tensors of `dtype`."""
    from safetensors.torch import save_file

    from mixq.formats import checkpoint_check as cc

    rows, cols = 6144, 2048
    per = rows * cols * torch.empty((), dtype=dtype).element_size()
    n = max(1, int(gb * 1e9 // per))
    f = tmp / f"scan-{str(dtype).split('.')[-1]}.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file({f"t{i}": (torch.randn(rows, cols, generator=g) * 0.02).to(dtype) for i in range(n)}, str(f))

    class _Files:  # the two things scan_finite asks of a checkpoint, for a file that is not a glm5_next model
        def names(self):
            return [f"t{i}" for i in range(n)]

        def is_fp8(self, name):
            return False

        def nbytes(self, name):
            return per

    orig = cc._source_files
    cc._source_files = lambda ck: [f]
    try:
        secs = _timed(lambda: cc.scan_finite(_Files(), progress=False), repeat=1)
    finally:
        cc._source_files = orig
    f.unlink()
    return n * per / secs / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--gb", type=float, default=1.0)
    a = ap.parse_args()
    from mixq.formats.finite import check_finite

    res: dict = {"threads": torch.get_num_threads()}
    res["validate_config_side"] = config_side_seconds(shared_dir() / "models" / "glm-5.3-flash-shape" / "config.json")
    with tempfile.TemporaryDirectory() as d:
        res["scan_bf16_MBps"] = round(scan_rate(torch.bfloat16, a.gb, Path(d)))
        res["scan_fp8_MBps"] = round(scan_rate(torch.float8_e4m3fn, a.gb, Path(d)))
    x = torch.randn(int(a.gb * 1e9 // 2)).to(torch.bfloat16)
    res["get_check_bf16_MBps"] = round(x.numel() * 2 / _timed(lambda: check_finite(x, "x", None)) / 1e6)
    buf = x.view(torch.uint8).numpy()
    res["sha256_MBps"] = round(buf.nbytes / _timed(lambda: hashlib.sha256(buf).hexdigest(), repeat=1) / 1e6)
    est = {
        "scan_bf16_640GB_min": round(2 * FLASH_PARAMS / (res["scan_bf16_MBps"] * 1e6) / 60, 1),
        "scan_fp8_330GB_min": round(1.03 * FLASH_PARAMS / (res["scan_fp8_MBps"] * 1e6) / 60, 1),
        "get_check_640GB_s": round(2 * FLASH_PARAMS / (res["get_check_bf16_MBps"] * 1e6)),
        "seal_or_verify_sha256_108GB_s": round(GGUF_BYTES / (res["sha256_MBps"] * 1e6)),
    }
    res["glm53_flash_estimate"] = est
    text = json.dumps(res, indent=2)
    print(text)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
