"""The real client: does exllamav3 1.6.5 load mixq's EXL3 directory, and do its logits agree with mixq's own
dequantized model in transformers? (Run on a CUDA machine with exllamav3 installed.)

For each (source model, EXL3 dir) pair: held-out windows from ../shared/data/heldout.txt, tokenized with the model's
own tokenizer; logits from (a) exllamav3 (`Model.forward(ids, {"attn_mode": "flash_attn_nc"})`), (b) transformers
holding `read_exl3(dir)` (the dequantized weights), (c) transformers holding the BF16 source. Prints per model:
  mutual KLD  = mean over scored positions of KL(b ‖ a) (and KL(a ‖ b)),
  top-1       = share of positions where argmax(a) == argmax(b),
  quant KLD   = KL(c ‖ b), the quant's own error against BF16,
  pass        = mutual KLD < max(1e-3, quant KLD / 10) and top-1 ≥ 0.99.

Usage (the EXL3 directory is converted first when it does not exist yet):
  python bench/engines/exllamav3_check.py --model ../shared/models/glm5next-mini --exl3 ../bench-work/mini-4.0 --bpw 4.0
  python bench/engines/exllamav3_check.py --model ../shared/models/glm5next-k256 --exl3 ../bench-work/k256-4.0 --bpw 4.0 --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from paths import SHARED, repo_relative  # noqa: E402


def windows(model_dir: Path, text: Path, ctx: int, n: int) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok(text.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    n = min(n, len(ids) // ctx)
    return torch.tensor(ids[: n * ctx], dtype=torch.long).view(n, ctx)


def exl3_logits(exl3_dir: Path, ids: torch.Tensor) -> list[torch.Tensor]:
    from exllamav3 import Config, Model

    config = Config.from_directory(str(exl3_dir))
    model = Model.from_config(config)
    model.load()
    out = []
    with torch.inference_mode():
        for row in ids:
            out.append(model.forward(row.unsqueeze(0), {"attn_mode": "flash_attn_nc"}).float().cpu()[0])
    model.unload()
    del model
    torch.cuda.empty_cache()
    return out


def hf_logits(model_dir: Path, weights: dict, ids: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    from mixq.runtime.reference import build_model

    model = build_model(model_dir, weights, device)
    out = []
    with torch.inference_mode():
        for row in ids:
            out.append(model(row.unsqueeze(0).to(device)).logits.float().cpu()[0])
    del model
    torch.cuda.empty_cache()
    return out


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) per position (natural log), vocab truncated to the common width."""
    v = min(p_logits.shape[-1], q_logits.shape[-1])
    lp = F.log_softmax(p_logits[..., :v].double(), -1)
    lq = F.log_softmax(q_logits[..., :v].double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def check(model_dir: Path, exl3_dir: Path, *, bpw: float, ctx: int, n_windows: int, text: Path) -> dict:
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.runtime.dequant import read_exl3

    dev = torch.device("cuda")
    if not (exl3_dir / "config.json").exists():
        from mixq.conversion.api import convert

        t = time.time()
        res = convert(model_dir, exl3_dir, "exl3", bpw=bpw, device="cuda",
                      calibration=[SHARED / "data" / "calibration.txt"], rows=64, seq_len=512)
        print(res.summary(), f"\n(converted in {time.time() - t:.0f} s)", file=sys.stderr)
    ids = windows(model_dir, text, ctx, n_windows)
    first = ctx // 2  # score the second half of each window, as llama-perplexity does
    a = exl3_logits(exl3_dir, ids)
    b = hf_logits(exl3_dir, read_exl3(exl3_dir), ids, dev)
    ck = open_checkpoint(model_dir)
    c = hf_logits(model_dir, {n: ck.get(n) for n in ck.names()}, ids, dev)
    kl_ba = torch.cat([kl(x[first:], y[first:]) for x, y in zip(b, a)])
    kl_ab = torch.cat([kl(y[first:], x[first:]) for x, y in zip(b, a)])
    kl_cb = torch.cat([kl(z[first:], x[first:]) for x, z in zip(b, c)])
    top1 = torch.cat([(x[first:].argmax(-1) == y[first:].argmax(-1)).float() for x, y in zip(b, a)])
    quant_kld = kl_cb.mean().item()
    mutual = kl_ba.mean().item()
    res = {"model": repo_relative(str(model_dir)), "exl3": repo_relative(str(exl3_dir)), "windows": len(a), "ctx": ctx,
           "positions": int(top1.numel()), "mutual_kld": mutual, "mutual_kld_rev": kl_ab.mean().item(),
           "top1_agreement": top1.mean().item(), "quant_kld_vs_bf16": quant_kld,
           "kld_limit": max(1e-3, quant_kld / 10),
           "bits": json.loads((exl3_dir / "config.json").read_text())["quantization_config"]["bits"]}
    res["pass"] = mutual < res["kld_limit"] and res["top1_agreement"] >= 0.99
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, type=Path, help="source BF16 model dir (repeatable)")
    ap.add_argument("--exl3", action="append", required=True, type=Path, help="EXL3 dir for each --model")
    ap.add_argument("--bpw", type=float, default=4.0)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--text", type=Path, default=SHARED / "data" / "heldout.txt")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if len(args.model) != len(args.exl3):
        ap.error("give one --exl3 per --model")
    if not torch.cuda.is_available():
        print("exllamav3_check: needs a CUDA GPU", file=sys.stderr)
        return 2
    results = [check(m, e, bpw=args.bpw, ctx=args.ctx, n_windows=args.windows, text=args.text)
               for m, e in zip(args.model, args.exl3)]
    for r in results:
        print(f"{Path(r['model']).name}: bits {r['bits']}  mutual KLD {r['mutual_kld']:.3e} "
              f"(rev {r['mutual_kld_rev']:.3e}, limit {r['kld_limit']:.3e})  top-1 {100 * r['top1_agreement']:.2f}%  "
              f"quant KLD vs BF16 {r['quant_kld_vs_bf16']:.4f}  {'PASS' if r['pass'] else 'FAIL'}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if all(r["pass"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
