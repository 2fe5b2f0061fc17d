"""Train a fixture's NextN (MTP) block with the trunk frozen, so that its draft agreement means something.

The shared fixtures' NextN blocks are untrained copies of their last layer. This trains the block (eh_proj, enorm,
hnorm, the DSA + MoE body and shared_head.norm; the trunk, its embedding and lm_head frozen) to predict token t+2
from the trunk's final hidden state at t and token t+1's embedding, with cross-entropy on the calibration text,
Adam, a fixed seed, on the CPU. The trunk's hidden states come once from transformers' own model
(runtime/reference.build_model); the block is runtime/nextn.py's. Writes OUT: the trunk's files hard-linked or
copied, and
`model-mtp.safetensors` (the trained block, bfloat16 as the source stores it), plus a result JSON: the loss curve
and the reference NextN head's draft agreement (top-1 of the head at t against the trunk's own argmax at t+1) on
held-out text, before and after.

    PYTHONPATH=.. python bench/quality/train_nextn.py --model k256 --out ../bench-work/k256-nextn-trained \
        --result bench/results/train_nextn_k256.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from paths import SHARED, repo_relative  # noqa: E402

from mixq.formats.checkpoint import load_tokenizer, open_checkpoint  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from mixq.runtime.calibration import calibration_rows  # noqa: E402
from mixq.runtime.layer_stream import HEAD_NAME, DecoderStream  # noqa: E402
from mixq.runtime.nextn import build_nextn, nextn_inputs, nextn_sources  # noqa: E402
from mixq.runtime.reference import build_model  # noqa: E402

MTP_FILE = "model-mtp.safetensors"


@torch.no_grad()
def trunk_states(model, ids: torch.Tensor, batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden states (rows, seq, D), embeddings (rows, seq, D)) of token rows, from the frozen trunk."""
    text = model.model.language_model
    dev = next(text.parameters()).device
    hs, es = [], []
    for r in range(0, ids.shape[0], batch):
        x = ids[r:r + batch].to(dev)
        hs.append(text(input_ids=x).last_hidden_state)
        es.append(text.embed_tokens(x))
    return torch.cat(hs), torch.cat(es)


def draft_agreement(block, h: torch.Tensor, e: torch.Tensor, lm_head: torch.Tensor) -> float:
    """The share of positions t where the head's draft of token t+2 equals the trunk's argmax at t+1."""
    with torch.no_grad():
        target = F.linear(h[:, 1:], lm_head).argmax(-1)
        drafts = F.linear(_forward(block, nextn_inputs(h, e)), lm_head).argmax(-1)
    return float((drafts == target).float().mean())


def _forward(block, x: torch.Tensor) -> torch.Tensor:
    b, s = x.shape[:2]
    out, _ = block(x, attention_mask=torch.ones(b, s, dtype=torch.bool, device=x.device),
                   position_ids=torch.arange(s, device=x.device).unsqueeze(0))
    return out


def train(model_dir: Path, *, steps: int, rows: int, seq_len: int, batch: int, lr: float, seed: int,
          eval_rows: int = 16, log_every: int = 10, device: str = "cpu") -> dict:
    """Train the NextN block of `model_dir`; returns {"block", "losses", "before", "after", ...}."""
    torch.manual_seed(seed)
    ck = open_checkpoint(model_dir)
    layer = ck.nextn_layers[0]
    tok = load_tokenizer(ck.path)
    vocab = int(ck.text_config["vocab_size"])
    train_ids = calibration_rows(tok, [SHARED / "data" / "calibration.txt"], rows=rows, seq_len=seq_len,
                                 vocab_size=vocab, seed=seed)
    eval_ids = calibration_rows(tok, [SHARED / "data" / "heldout.txt"], rows=eval_rows, seq_len=seq_len,
                                vocab_size=vocab, seed=seed + 1)
    trunk_names = [n for n in ck.names() if not ck.info(n).mtp and ck.info(n).role != "vision"]
    dev = torch.device(device)
    model = build_model(ck.path, {n: ck.get(n) for n in trunk_names}, dev)
    h, e = trunk_states(model, train_ids)
    hv, ev = trunk_states(model, eval_ids)
    lm_head = ck.get(HEAD_NAME).to(dev)
    del model
    block = build_nextn(DecoderStream(ck.config).text_config, layer, lambda n: ck.get(n), device=dev)
    block.train()
    before = draft_agreement(block.eval(), hv, ev, lm_head)
    block.train()
    x_all, y_all = nextn_inputs(h, e), train_ids[:, 2:].to(dev)
    opt = torch.optim.Adam(block.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    losses: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        pick = torch.randint(0, x_all.shape[0], (batch,), generator=gen).to(dev)
        out = _forward(block, x_all[pick])[:, :-1]  # position t predicts token t+2: the last has no target
        loss = F.cross_entropy(F.linear(out, lm_head).flatten(0, 1), y_all[pick].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 1 or step % log_every == 0 or step == steps:
            losses.append((step, round(float(loss.detach()), 4)))
    seconds = time.perf_counter() - t0
    block.eval()
    after = draft_agreement(block, hv, ev, lm_head)
    return {"block": block, "layer": layer, "losses": losses, "before": before, "after": after,
            "train_seconds": seconds, "ckpt": ck}


def write_model(res: dict, model_dir: Path, out: Path) -> list[str]:
    """OUT: every file of `model_dir` (hard-linked, else copied) but the NextN file, which holds the trained block
    (bfloat16)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.name == MTP_FILE:
            continue
        dst = out / f.name
        if dst.is_symlink() or dst.exists():
            dst.unlink()
        try:  # a hard link where the file system allows it (mixq refuses links out of a model directory)
            os.link(f.resolve(), dst)
        except OSError:
            shutil.copyfile(f, dst)
    block, layer, ck = res["block"], res["layer"], res["ckpt"]
    tensors: dict[str, torch.Tensor] = {}
    for key, t in block.state_dict().items():
        src = nextn_sources(layer, key, t.shape[0] if t.dim() else 0)
        rows = [t[r] for r in range(len(src))] if len(src) > 1 else [t]
        for row, parts in zip(rows, src):
            off = 0
            for n in parts:
                k = int(ck.shape(n)[0])
                tensors[n] = row[off:off + k].reshape(ck.shape(n)).to("cpu", torch.bfloat16).contiguous()
                off += k
    missing = {n for n in ck.names() if ck.info(n).mtp} - set(tensors)
    if missing:
        raise SystemExit(f"the trained block lacks {sorted(missing)[:3]}")
    save_file(tensors, str(out / MTP_FILE), metadata={"format": "pt"})
    return sorted(tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="k256", help="fixture name under shared/models/glm5next-NAME, or a path")
    ap.add_argument("--out", type=Path, required=True, help="the model directory to write (not under shared/)")
    ap.add_argument("--result", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu (the default; deterministic) or cuda")
    a = ap.parse_args()
    model_dir = Path(a.model) if Path(a.model).is_dir() else SHARED / "models" / f"glm5next-{a.model}"
    if SHARED.resolve() in a.out.resolve().parents:
        raise SystemExit("--out must not be inside the shared fixtures")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    res = train(model_dir, steps=a.steps, rows=a.rows, seq_len=a.seq_len, batch=a.batch, lr=a.lr, seed=a.seed,
                device=a.device)
    names = write_model(res, model_dir, a.out)
    out = {"model": str(model_dir), "out": str(a.out), "nextn_layer": res["layer"], "tensors": len(names),
           "settings": {"steps": a.steps, "rows": a.rows, "seq_len": a.seq_len, "batch": a.batch, "lr": a.lr,
                        "seed": a.seed, "optimizer": "Adam", "device": a.device,
                        "train_text": "shared/data/calibration.txt", "eval_text": "shared/data/heldout.txt"},
           "loss_curve": res["losses"], "agreement_before": res["before"], "agreement_after": res["after"],
           "train_seconds": round(res["train_seconds"], 1)}
    a.result.parent.mkdir(parents=True, exist_ok=True)
    a.result.write_text(json.dumps(repo_relative(out), indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("agreement_before", "agreement_after", "train_seconds")}))


if __name__ == "__main__":
    main()
