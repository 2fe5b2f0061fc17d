"""One KDA (linear-attention) decoder layer through transformers' reference PyTorch path and through
flash-linear-attention's kernels (which transformers picks when the `fla` package imports), side by side: seconds of
a forward, and of a forward + backward to the layer's weights (what a tuning step runs), and how far the outputs
differ. Each path runs in its own process, since transformers chooses the kernel when its model module is imported.

    python bench/speed/kda_kernels.py --model SLICE/bf16 --fla-path SITE_WITH_FLA --json OUT.json [--layer 0]

`--fla-path`: a directory holding the `fla` package (pip install --target ... flash-linear-attention); the reference
run is kept from importing `fla` whatever the environment holds.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def child(a: argparse.Namespace) -> dict:
    """Time layer `a.layer` of `a.model` on this process's KDA implementation; its first row's output to `a.out`."""
    if a.child == "reference":
        sys.modules["fla"] = None  # an import of fla now fails: transformers keeps its reference path
    import torch
    from safetensors.torch import save_file

    from mixq.formats.checkpoint import open_checkpoint
    from mixq.runtime.layer_stream import DecoderStream

    dev = torch.device(a.device)
    ck = open_checkpoint(a.model)
    stream = DecoderStream(ck.config, device=dev, batch_rows=a.rows)
    mod = stream.materialize(a.layer, lambda n: ck.get(n, dtype=torch.float32))
    hidden_size = int(stream.text_config.hidden_size)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(a.rows, a.seq, stream.hc_mult, hidden_size, generator=g).to(dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return stream.call_layer(mod, x, None)[0]

    def step() -> None:
        mod.requires_grad_(True)
        out = stream.call_layer(mod, x, None)[0]
        out.float().pow(2).mean().backward()
        mod.zero_grad(set_to_none=True)
        mod.requires_grad_(False)

    def best_of(fn) -> float:
        fn()  # warm-up: kernel builds, workspaces
        sync()
        times = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return min(times)

    out = forward()
    save_file({"out": out[0].float().cpu().contiguous()}, a.out)
    fla = sys.modules.get("fla")
    return {"impl": a.child, "fla_imported": fla is not None, "fla_version": getattr(fla, "__version__", None),
            "forward_s": round(best_of(forward), 4), "forward_backward_s": round(best_of(step), 4),
            "layer_type": str(stream.text_config.layer_types[a.layer])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="a glm5_next checkpoint directory")
    ap.add_argument("--layer", type=int, default=0, help="a linear-attention decoder layer")
    ap.add_argument("--rows", type=int, default=4, help="rows per call (the tuner's batch)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--fla-path", type=Path, default=None, help="a directory holding the fla package")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", choices=("reference", "fla"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a)), flush=True)
        return
    from safetensors.torch import load_file

    res: dict = {"model": a.model.name, "layer": a.layer, "rows": a.rows, "seq": a.seq, "device": a.device}
    outs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for impl in ("reference", "fla"):
            env = dict(os.environ)
            if impl == "fla" and a.fla_path is not None:
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(a.fla_path), env.get("PYTHONPATH")]))
            out = Path(tmp) / f"{impl}.safetensors"
            cmd = [sys.executable, __file__, "--model", str(a.model), "--layer", str(a.layer), "--rows", str(a.rows),
                   "--seq", str(a.seq), "--repeat", str(a.repeat), "--device", a.device, "--child", impl,
                   "--out", str(out)]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                res[impl] = {"error": f"exit {p.returncode}", "tail": p.stderr[-2000:]}
                continue
            res[impl] = json.loads(line[len("RESULT "):])
            outs[impl] = load_file(str(out))["out"]
    if len(outs) == 2:
        ref, fla = outs["reference"], outs["fla"]
        res["max_abs_diff"] = float((ref - fla).abs().max())
        res["rel_rms_diff"] = float((ref - fla).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
        res["forward_ratio"] = round(res["reference"]["forward_s"] / res["fla"]["forward_s"], 2)
        res["forward_backward_ratio"] = round(res["reference"]["forward_backward_s"] / res["fla"]["forward_backward_s"],
                                              2)
    print(json.dumps(res, indent=1))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
