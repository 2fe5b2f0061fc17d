r"""A small trained glm5_next target whose KDA heads are 128 wide, for bench/engines/drafter_check.py.

exllamav3 1.6.5's recurrent KDA kernel (the one its Generator decodes and verifies drafts with) takes 128 x 128
heads only ("channelwise decay (KDA) requires 128x128 head dims"); glm5next-k256 has 64-wide ones, so the
Generator cannot run k256 as a speculative-decoding target. This script builds one it can run: k256's config.json
with the KDA heads 128 wide, everything else as k256 has it (hidden 256, KDA x3 + DSA, mHC, 16 routed experts,
NextN block, vision tower, 8k vocabulary, tokenizer), random init through transformers, then trained as a causal
LM on the calibration text for --train-seconds.

What changes against k256 and why:
  text_config.linear_head_dim, linear_attn_config.head_dim   64 -> 128  the kernel's only KDA head width;
  text_config.linear_num_heads, linear_attn_config.num_heads  4 -> 2    keeps the KDA q/k/v width at k256's 256
                                                                          (= hidden), so the model stays k256's
                                                                          size (--heads to change it);
  nothing else: the MLA/DSA layer (NoPE, qk 64, kv_lora 256), the experts and the vision tower keep k256's shapes,
  which exllamav3 already loads. transformers' KDA low-rank gates follow the head width (f_a/g_a: hidden -> 128).
The NextN block is not part of transformers' model: its body is copied from the trained last layer (DSA + MoE,
as in the fixtures), its own projections random; no drafter_check step reads it.

Output DIR: config.json, model.safetensors (BF16, checkpoint names, NextN block included), generation_config.json,
the tokenizer/processor files, training_run.json (losses, steps, what changed). Weights are written with
safetensors only.

  python bench/engines/kda128_target.py --out DIR [--train-seconds 90] [--steps N] [--seq-len 512] [--batch 32]
                                [--device cuda|cpu] [--seed 0]

Device run: one command on one H200, from the repo copy holding .whl/ and shared/ (exllamav3's extension built by
an earlier call). k256's weights are not read, only its config and tokenizer, so its .xz files are decompressed
only when its config.json is missing. bench/engines/drafter_check.py --target-build runs this script first (same
process, so one CUDA start), then the check against the built target; $OUT receives drafter_check.json,
log.txt, results.md, stdout.txt, target_config.json, target_training_run.json (no weights; stdout capped at 4 MB).
Estimated wall time, about 6.3 minutes (the timeout stops the check at 6.5 and keeps the report so far):
  install 15 s | target: tokenize + build 10 s, train 90 s, evals + save + reload check 10 s | load the target in
  exllamav3 75 s | training continuations through the Generator, with the first KDA-128 Triton compiles, and
  the states 50 s | distill 45 s | convert to 6 bpw 15 s | logits phase 10 s | Generator: plain, BF16 drafter,
  6 bpw drafter 30 s.

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
  mkdir -p /tmp/pp && ln -sfn "$PWD" /tmp/pp/mixq &&
  export PYTHONPATH=/tmp/site:/tmp/pp MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 \
    MIXQ_SHARED="$PWD/shared" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 &&
  K=shared/models/glm5next-k256 && { [ -f $K/config.json ] || (cd $K && xz -d -T8 *.xz); } &&
  rm -rf /tmp/dc /tmp/kda128 && T0=$(date +%s) &&
  timeout -s INT -k 20 390 python3 bench/engines/drafter_check.py --out /tmp/dc --target-build /tmp/kda128 \
    --target-train-seconds 90 --train-seconds 45 --train-prompts 160 --train-new-tokens 160 > /tmp/dc.out 2>&1;
  echo "rc=$? wall=$(( $(date +%s) - T0 ))s" >> /tmp/dc.out; tail -c 4000000 /tmp/dc.out > $OUT/stdout.txt;
  cp /tmp/dc/drafter_check.json /tmp/dc/log.txt /tmp/dc/results.md $OUT/ 2>/dev/null;
  cp /tmp/kda128/config.json $OUT/target_config.json 2>/dev/null;
  cp /tmp/kda128/training_run.json $OUT/target_training_run.json 2>/dev/null; tail -n 30 /tmp/dc.out
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from paths import SHARED  # noqa: E402

KDA_HEAD_DIM = 128  # exllamav3 1.6.5: the recurrent KDA kernel's only head width
SOURCE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "chat_template.jinja", "preprocessor_config.json", "processor_config.json")
Log = Callable[[str], None]


def stamp_log(t0: float | None = None) -> Log:
    """print() with the clock time and the seconds since t0."""
    t0 = time.time() if t0 is None else t0

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} {time.time() - t0:7.1f}s] {msg}", flush=True)
    return log


# ------------------------------------------------------------------------------------------------ config

def kda_heads(config: dict) -> tuple[int, int]:
    """(KDA heads, KDA head width) as exllamav3 reads them (linear_attn_config first)."""
    text = config.get("text_config") or config
    la = text.get("linear_attn_config") or {}
    return int(la.get("num_heads") or text["linear_num_heads"]), int(la.get("head_dim") or text["linear_head_dim"])


def target_config(source: dict, heads: int | None = None) -> tuple[dict, dict]:
    """The source config with 128-wide KDA heads; `heads` defaults to keeping the KDA q/k/v width
    (heads x width) of the source. Returns (config, {changed key: [old, new]})."""
    cfg = copy.deepcopy(source)
    text = cfg["text_config"]
    old_heads, old_dim = kda_heads(cfg)
    heads = heads or max(1, old_heads * old_dim // KDA_HEAD_DIM)
    changed = {}
    for key, new in (("linear_head_dim", KDA_HEAD_DIM), ("linear_num_heads", heads)):
        changed[f"text_config.{key}"] = [text.get(key), new]
        text[key] = new
    la = text.setdefault("linear_attn_config", {})
    for key, new in (("head_dim", KDA_HEAD_DIM), ("num_heads", heads)):
        changed[f"text_config.linear_attn_config.{key}"] = [la.get(key), new]
        la[key] = new
    return cfg, {k: v for k, v in changed.items() if v[0] != v[1]}


def transformers_model(config: dict, seed: int) -> torch.nn.Module:
    """Glm5NextForConditionalGeneration of the config, random init (fp32). transformers spells the DSA layer
    kind `indexed_attention`; the saved config keeps the checkpoint's spelling, which exllamav3 requires."""
    import transformers

    tcfg = copy.deepcopy(config)
    tcfg["text_config"]["layer_types"] = ["linear_attention" if t == "linear_attention" else "indexed_attention"
                                          for t in tcfg["text_config"]["layer_types"]]
    torch.manual_seed(seed)
    model = transformers.Glm5NextForConditionalGeneration(transformers.Glm5NextConfig(**tcfg))
    # the loop over experts: grouped_mm has no fp32 CUDA path to rely on under autocast (fp32 master weights)
    model.set_experts_implementation("eager")
    return model


# ------------------------------------------------------------------------------------------------ data

def token_stream(source_dir: Path, text: Path, need: int | None = None) -> torch.Tensor:
    """Token ids of a text file with the source model's tokenizer (no special tokens), 1-D int64."""
    from mixq.runtime.reference import tokenize_text
    from mixq.formats.checkpoint import load_tokenizer

    return torch.tensor(tokenize_text(load_tokenizer(source_dir), text, need), dtype=torch.long)


def heldout_windows(ids: torch.Tensor, seq_len: int, n: int) -> torch.Tensor:
    """n consecutive windows of seq_len tokens from the start of the stream, (n, seq_len)."""
    n = min(n, ids.numel() // seq_len)
    return ids[: n * seq_len].view(n, seq_len)


def sample_windows(ids: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    """batch windows of seq_len tokens at random offsets, (batch, seq_len)."""
    start = torch.randint(0, ids.numel() - seq_len + 1, (batch,), generator=gen)
    return ids[start[:, None] + torch.arange(seq_len)]


# ------------------------------------------------------------------------------------------------ training

def lm_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over a batch of windows."""
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())


def autocast(device: torch.device):
    """bf16 autocast on CUDA; plain fp32 elsewhere."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch: int, device: torch.device) -> float:
    """Mean next-token loss over the windows."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        x = windows[i:i + batch].to(device)
        with autocast(device):
            total += lm_loss(model, x).item() * x.shape[0]
        count += x.shape[0]
    model.train()
    return total / max(count, 1)


def lr_factor(step: int, elapsed: float, steps: int, seconds: float, warmup: int) -> float:
    """Linear warmup, then cosine to a tenth over whichever budget (steps or seconds) runs out first."""
    progress = min(1.0, max(step / max(steps, 1), elapsed / max(seconds, 1e-9)))
    return min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(model: torch.nn.Module, ids: torch.Tensor, *, seconds: float, steps: int, seq_len: int, batch: int,
          lr: float, device: torch.device, seed: int, log: Log) -> dict:
    """AdamW on random calibration windows until `steps` or `seconds` run out."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, min(50, steps // 10))
    model.train()
    losses: list[float] = []
    t0 = last_log = time.time()
    step = 0
    while step < steps and (step == 0 or time.time() - t0 < seconds):
        for group in opt.param_groups:
            group["lr"] = lr * lr_factor(step, time.time() - t0, steps, seconds, warmup)
        x = sample_windows(ids, seq_len, batch, gen).to(device)
        with autocast(device):
            loss = lm_loss(model, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step == 1 or time.time() - last_log > 10 or step == steps:
            last_log = time.time()
            log(f"step {step}: loss {losses[-1]:.3f}, lr {opt.param_groups[0]['lr']:.2e}, "
                f"{step * batch * seq_len / (last_log - t0):.0f} tok/s")
    tail = losses[-10:]
    return {"steps": step, "seconds": round(time.time() - t0, 1), "train_loss_first": losses[0],
            "train_loss_last": sum(tail) / len(tail), "tokens_seen": step * batch * seq_len}


# ------------------------------------------------------------------------------------------------ checkpoint

def checkpoint_tensors(model: torch.nn.Module, config: dict, seed: int) -> dict[str, torch.Tensor]:
    """BF16 tensors under the checkpoint's names (transformers' reverse weight conversion), plus the NextN block:
    the body copied from the last trunk layer where shapes agree, norms ones, the rest random."""
    from transformers.core_model_loading import revert_weight_conversion

    from mixq.formats.checkpoint import nextn_shapes

    with torch.no_grad():
        sd = {k: v.detach().to("cpu", torch.bfloat16).contiguous()
              for k, v in revert_weight_conversion(model, model.state_dict()).items()}
    text = config["text_config"]
    n = int(text["num_hidden_layers"])
    gen = torch.Generator().manual_seed(seed + 1)
    for name, shape in nextn_shapes(config, text, text["layer_types"]).items():
        twin = name.replace(f"layers.{n}.", f"layers.{n - 1}.")
        if twin in sd and tuple(sd[twin].shape) == shape:
            sd[name] = sd[twin].clone()
        elif len(shape) == 1 and name.endswith("norm.weight"):
            sd[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            sd[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    return sd


def write_files(tmp: Path, config: dict, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """config.json, model.safetensors and the source's generation/tokenizer/processor files."""
    from safetensors.torch import save_file

    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in SOURCE_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, tmp / name)


@torch.no_grad()
def reload_difference(model_dir: Path, model: torch.nn.Module, probe: torch.Tensor) -> float:
    """Max |logit difference| between `model` (weights already BF16-rounded) and the directory loaded back
    through transformers' from_pretrained, fp32 on the CPU, on a probe batch."""
    import transformers
    from transformers.utils import logging as tlog

    old = tlog.get_verbosity()
    tlog.set_verbosity_error()  # its load report lists the NextN tensors, which the model has no place for
    tlog.disable_progress_bar()
    try:
        loaded = transformers.Glm5NextForConditionalGeneration.from_pretrained(
            str(model_dir), dtype=torch.float32, experts_implementation="eager").eval()
    finally:
        tlog.set_verbosity(old)
        tlog.enable_progress_bar()
    ref = copy.deepcopy(model).to("cpu", torch.float32).eval()
    diff = (loaded(input_ids=probe).logits - ref(input_ids=probe).logits).abs().max().item()
    del loaded, ref
    return diff


def is_built(out: Path) -> bool:
    return all((out / f).is_file() for f in ("config.json", "model.safetensors", "training_run.json"))


# ------------------------------------------------------------------------------------------------ the build

def load_data(source: Path, calibration: Path, heldout: Path, seq_len: int,
              eval_windows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The calibration token stream and the held-out windows, checked to be long enough for seq_len."""
    train_ids = token_stream(source, calibration)
    held = heldout_windows(token_stream(source, heldout, eval_windows * seq_len), seq_len, eval_windows)
    if train_ids.numel() <= seq_len or held.shape[0] == 0:
        raise ValueError(f"{calibration.name} ({train_ids.numel()} tokens) and {heldout.name} need more than "
                         f"--seq-len {seq_len} tokens each")
    return train_ids, held


def write_target(out: Path, config: dict, model: torch.nn.Module, source: Path, probe: torch.Tensor,
                 summary: dict, seed: int, t0: float) -> None:
    """The target directory, through a temporary one renamed at the end; the reload check runs on the files
    before the rename and goes into training_run.json with the rest of the summary (and the seconds since t0)."""
    from mixq.formats.atomic import atomic_dir

    with atomic_dir(out) as tmp:
        write_files(tmp, config, checkpoint_tensors(model, config, seed), source)
        summary["reload_max_abs_diff"] = reload_difference(tmp, model, probe)
        summary["build_seconds"] = round(time.time() - t0, 1)
        (tmp / "training_run.json").write_text(json.dumps(summary, indent=2) + "\n")


def build(out: Path, *, source: Path, calibration: Path, heldout: Path, train_seconds: float = 90.0,
          steps: int = 100_000, seq_len: int = 512, batch: int = 32, lr: float = 2e-3, eval_windows: int = 32,
          heads: int | None = None, device: str | None = None, seed: int = 0,
          log: Log | None = None) -> tuple[dict, torch.nn.Module]:
    """Build, train and write the target to `out` (created; must be absent or empty). Returns the summary
    (also written as training_run.json) and the trained model (BF16-rounded weights, fp32, eval mode)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: exists and is not an empty directory")  # before the training, not after
    log = log or stamp_log()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.time()
    config, changed = target_config(json.loads((source / "config.json").read_text()), heads)
    log(f"config from {source.name}: {changed}")
    train_ids, held = load_data(source, calibration, heldout, seq_len, eval_windows)
    log(f"tokens: {train_ids.numel()} for training, {held.numel()} held out ({held.shape[0]} x {seq_len})")
    model = transformers_model(config, seed).to(dev)
    params = sum(p.numel() for p in model.parameters())
    init_loss = evaluate(model, held, batch, dev)
    vocab = int(config["text_config"]["vocab_size"])
    log(f"model: {params} parameters on {dev}; held-out loss at init {init_loss:.3f} (ln vocab {math.log(vocab):.3f})")
    stats = train(model, train_ids, seconds=train_seconds, steps=steps, seq_len=seq_len, batch=batch, lr=lr,
                  device=dev, seed=seed, log=log)
    with torch.no_grad():  # the numbers below are those of the weights as saved
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    final_loss = evaluate(model, held, batch, dev)
    model.eval()
    log(f"trained: {stats}; held-out loss {final_loss:.3f}")
    summary = {"params": params, "steps": stats["steps"], "seq": seq_len, "batch": batch,
               "heldout_loss": final_loss, "heldout_loss_init": init_loss, "uniform_loss": math.log(vocab),
               **stats, "lr": lr, "seed": seed, "device": str(dev), "heldout_tokens": int(held.numel()),
               "source": source.name, "changed": changed, "kda_heads": list(kda_heads(config))}
    write_target(out, config, model, source, held[:1, :64], summary, seed, t0)
    log(f"written to {out} (transformers reload: max |logit diff| {summary['reload_max_abs_diff']:.2e})")
    return summary, model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="directory to create (absent or empty)")
    ap.add_argument("--source", type=Path, default=SHARED / "models" / "glm5next-k256",
                    help="model whose config.json and tokenizer the target takes")
    ap.add_argument("--calibration", type=Path, default=SHARED / "data" / "calibration.txt")
    ap.add_argument("--heldout", type=Path, default=SHARED / "data" / "heldout.txt")
    ap.add_argument("--train-seconds", type=float, default=90.0)
    ap.add_argument("--steps", type=int, default=100_000, help="most training steps (--train-seconds caps too)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-windows", type=int, default=32, help="held-out windows of --seq-len tokens")
    ap.add_argument("--heads", type=int, default=None, help="KDA heads (default: keep the source's KDA width)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    summary, _ = build(a.out, source=a.source, calibration=a.calibration, heldout=a.heldout,
                       train_seconds=a.train_seconds, steps=a.steps, seq_len=a.seq_len, batch=a.batch, lr=a.lr,
                       eval_windows=a.eval_windows, heads=a.heads, device=a.device, seed=a.seed)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
