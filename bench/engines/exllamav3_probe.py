"""Where does exllamav3 turn a model's activations non-finite? A diagnostic for the real client.

Wraps the forward of every exllamav3 module (recursively) of each given directory, runs one held-out window,
and prints the execution-ordered trace around the first module whose output is not finite:
  #index [module key, class, output finite, output absmax, shape, dtype, input finite]
Directories may be EXL3 (mixq's or exllamav3's own conversion) or the unquantized HF source, which exllamav3
also loads: when the source itself goes non-finite at the same module, the fault is the engine's, not the file's.
Pairs of finite results are compared (KL, top-1).

  python bench/engines/exllamav3_probe.py SOURCE_DIR DIR [DIR ...] [--tokens 256]
Needs a CUDA GPU with exllamav3 1.6.5 (and its JIT-built extension) importable.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("MIXQ_SHARED") or REPO.parent / "shared")


def trace_forward(model_dir: Path, ids: torch.Tensor) -> tuple[torch.Tensor, list[list]]:
    """exllamav3 logits of one window and the per-module trace."""
    from exllamav3 import Config, Model

    model = Model.from_config(Config.from_directory(str(model_dir)))
    model.load()
    trace: list[list] = []

    def wrap(m) -> None:
        orig = m.forward

        def forward(*a, **k):
            x = a[0] if a and torch.is_tensor(a[0]) else None
            y = orig(*a, **k)
            t = y[0] if isinstance(y, tuple) else y
            rec = [m.key, type(m).__name__]
            if torch.is_tensor(t):
                rec += [bool(torch.isfinite(t).all()), float(t.float().abs().nan_to_num(0, 0, 0).max()),
                        tuple(t.shape), str(t.dtype)]
            else:
                rec += [None, None, None, None]
            rec.append(None if x is None else bool(torch.isfinite(x).all()))
            trace.append(rec)
            return y

        m.forward = forward

    for m in model:
        if m is not model:
            wrap(m)
    with torch.inference_mode():
        out = model.forward(ids, {"attn_mode": "flash_attn_nc"}).float().cpu()
    model.unload()
    del model
    torch.cuda.empty_cache()
    return out, trace


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path, help="source model dir (tokenizer)")
    ap.add_argument("dirs", type=Path, nargs="+", help="directories to run in exllamav3")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--text", type=Path, default=SHARED / "data" / "heldout.txt")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("exllamav3_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(args.source))
    ids = tok(args.text.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"][: args.tokens]
    ids = torch.tensor(ids).view(1, -1)
    outs = {}
    for d in args.dirs:
        out, trace = trace_forward(d, ids)
        first = next((i for i, r in enumerate(trace) if r[2] is False), None)
        print(f"== {d}: logits finite {bool(torch.isfinite(out).all())}, NaN share "
              f"{float(torch.isnan(out).float().mean()):.3f}; {len(trace)} module calls; first non-finite output "
              f"at #{first}")
        if first is not None:
            for i in range(max(0, first - 10), min(len(trace), first + 3)):
                print(f"   #{i} {trace[i]}")
        outs[str(d)] = out[0]
    keys = list(outs)
    for i, a_key in enumerate(keys):
        for b_key in keys[i + 1:]:
            a, b = outs[a_key], outs[b_key]
            if torch.isfinite(a).all() and torch.isfinite(b).all():
                la, lb = a.double().log_softmax(-1), b.double().log_softmax(-1)
                kl = float((la.exp() * (la - lb)).sum(-1).mean())
                top1 = float((a.argmax(-1) == b.argmax(-1)).float().mean())
                print(f"KL({a_key} ‖ {b_key}) = {kl:.4e}, top-1 {top1:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
