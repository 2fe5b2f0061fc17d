"""The DFlash2 drafter in the real engine: build a drafter for glm5next-k256, convert it with `mixq convert --format
exl3 --bpw 6`, load the BF16 drafter and the 6 bpw one in exllamav3 1.6.5 beside the k256 target, and compare.

Steps (one CUDA machine with exllamav3 importable and its extension built; about 3 minutes on an H200):
  1. target  k256 (BF16 safetensors) in exllamav3; greedy continuations of calibration prompts (its own text);
  2. drafter the layout of formats/dflash2.py at k256's width and vocabulary, random init, then distilled for
             --train-seconds on those continuations: the target's hidden states at the tap layers come from
             exllamav3 itself (the states it hands a drafter), the drafter runs in bench/engines/drafter_distill.py's torch
             forward (--random skips this; a random drafter's drafts are almost never accepted);
  3. convert `python -m mixq convert DRAFTER OUT --format exl3 --bpw 6 --device cuda`;
  4. logits  the same drafting rounds (held-out windows, several anchors per window) through both drafters in
             exllamav3: mutual KLD(BF16 ‖ 6 bpw) and top-1 agreement of the draft logits (rows 1..b−1), agreement
             of the selector's drafted tokens; also each engine drafter against the torch forward on the same
             weights (6 bpw: mixq's dequantized weights), the drafter analogue of bench/engines/exllamav3_check.py;
  5. accept  exllamav3's speculative generation with k256 as the target: no drafter, the BF16 drafter, the 6 bpw
             drafter, greedy, held-out prompts; acceptance = accepted / drafted tokens as the generator reports them,
             and whether each run's text equals the no-drafter text (greedy speculative decoding is lossless).
PASS (bench/engines/exllamav3_check.py's criteria, applied to the drafter): exllamav3's 6 bpw drafter agrees with mixq's
dequantized drafter (KLD < max(1e-3, quant KLD / 10), top-1 >= 0.99; quant KLD = KL(BF16 ‖ 6 bpw)) and its acceptance
is within 2 points of the BF16 drafter's. Strict limits, reported beside: the BF16 and 6 bpw drafters themselves
within KLD 1e-3 and top-1 0.99 of each other.

  python bench/engines/drafter_check.py --out OUT_DIR [--target DIR] [--train-seconds 75] [--random]
                                [--target-build DIR [--target-train-seconds 90]]
OUT_DIR receives drafter_check.json, log.txt, results.md (the docs/results.md rows), drafter-bf16/, drafter-6.0bpw/.

The Generator runs a target only when its KDA heads are 128 wide (k256's are 64; steps 1 and 5 then fall back to
the cache-less forward and drafting rounds). --target-build DIR first builds such a target from --target's config
and tokenizer with bench/engines/kda128_target.py (trained --target-train-seconds on the calibration text; a DIR that
already holds one is reused) and checks against it; `kda128_target.py --out DIR` then `--target DIR` does the same
in two processes (the device command in kda128_target.py's docstring). For a 128-wide target a generator failure
is an error of the check, not a reason to fall back silently.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import kda128_target  # noqa: E402
from drafter_distill import TorchDrafter, distill  # noqa: E402
from drafter_engine import (engine_rounds, generate, greedy_without_cache, load_drafter, load_target,  # noqa: E402
                            prompts_from, target_states)
from paths import SHARED, repo_relative  # noqa: E402

KLD_LIMIT, TOP1_MIN, ACCEPT_POINTS = 1e-3, 0.99, 0.02


class Run:
    """The JSON report and the log of one check."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.report: dict = {"errors": {}}
        self.t0 = time.time()

    def log(self, msg: str) -> None:
        line = f"[{time.time() - self.t0:6.1f}s] {msg}"
        print(line, flush=True)
        with open(self.out / "log.txt", "a") as f:
            f.write(line + "\n")

    def phase(self, name: str, fn, *args, **kwargs):
        """Run one phase; a failure is recorded (with its traceback in the log) and the check goes on. The report
        is saved after every phase, so a run cut short by a time limit still leaves what it measured."""
        t = time.time()
        try:
            res = fn(*args, **kwargs)
            self.report.setdefault("seconds", {})[name] = round(time.time() - t, 1)
            return res
        except Exception as e:  # noqa: BLE001 - every phase's failure is reported, not raised
            self.report["errors"][name] = f"{type(e).__name__}: {e}"
            self.log(f"{name} FAILED: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            return None
        finally:
            self.save()

    def save(self) -> None:
        (self.out / "drafter_check.json").write_text(json.dumps(repo_relative(self.report), indent=2, default=str)
                                                     + "\n")


# ------------------------------------------------------------------------------------------------ torch side

def target_io_weights(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and lm_head (names from the architecture table)."""
    from mixq.formats.checkpoint import open_checkpoint

    ck = open_checkpoint(model_dir)
    pick = {ck.info(n).role: n for n in ck.names() if ck.info(n).role in ("embed", "lm_head") and not ck.info(n).mtp}
    return ck.get(pick["embed"]), ck.get(pick["lm_head"])


def reference_rounds(model: TorchDrafter, states: list[torch.Tensor], ids: torch.Tensor, anchors: list[int]):
    """The same rounds through the torch forward: draft logits (rows·anchors, b−1, V) float32 on the CPU."""
    dev = model.lm_head.device
    out = []
    with torch.no_grad():
        ctx = model.context([s.to(dev) for s in states])
        for p in anchors:
            pos = torch.full((ids.shape[0],), p, device=dev)
            h = model(ctx[:, :p], pos, ids[:, p].to(dev))
            out.append(model.logits(h[:, 1:]).float().cpu())
    return torch.stack(out, 1).flatten(0, 1)


def compare(p_logits: torch.Tensor, q_logits: torch.Tensor) -> dict:
    """mutual KLD = mean KL(p ‖ q) over draft positions (and the reverse), top-1 agreement."""
    lp = F.log_softmax(p_logits.double(), -1)
    lq = F.log_softmax(q_logits.double(), -1)
    return {"kld": (lp.exp() * (lp - lq)).sum(-1).mean().item(),
            "kld_rev": (lq.exp() * (lq - lp)).sum(-1).mean().item(),
            "top1": (p_logits.argmax(-1) == q_logits.argmax(-1)).float().mean().item(),
            "positions": int(p_logits.shape[0] * p_logits.shape[1])}


def verdict(report: dict) -> dict:
    """The two verdicts and the reasons against each.

    pass: the criteria of bench/engines/exllamav3_check.py applied to the drafter (exllamav3's 6 bpw drafter against
    mixq's dequantized drafter in torch: KL(torch ‖ engine) < max(1e-3, quant KLD / 10), top-1 >= 0.99, where
    quant KLD = KL(BF16 ‖ 6 bpw) in exllamav3), and the 6 bpw acceptance within 2 points of the BF16 acceptance.
    pass_strict: in addition the BF16 and 6 bpw drafters' own draft logits within those limits of each other
    (KLD < 1e-3, top-1 >= 0.99): a bound on the quantization error itself, which a sharp drafter at 6 bpw may
    exceed while drafting the same tokens."""
    why = [f"{k} failed" for k in report.get("errors", {})]
    q = report.get("quant_logits")
    e = (report.get("engine_vs_torch") or {}).get("6bpw")
    if not q or not e:
        why.append("no logit comparison")
    else:
        limit = max(KLD_LIMIT, q["kld"] / 10)
        if not e["kld"] < limit:
            why.append(f"engine vs mixq's dequantized drafter: KLD {e['kld']:.3e} >= {limit:.3e}")
        if not e["top1"] >= TOP1_MIN:
            why.append(f"engine vs mixq's dequantized drafter: top-1 {e['top1']:.4f} < {TOP1_MIN}")
    acc = report.get("acceptance") or {}
    a16, a6 = acc.get("bf16"), acc.get("6bpw")
    if a16 is None or a6 is None:
        why.append("no acceptance for both drafters")
    elif abs(a6 - a16) > ACCEPT_POINTS:
        why.append(f"acceptance 6 bpw {a6:.4f} vs BF16 {a16:.4f}: more than {100 * ACCEPT_POINTS:.0f} points apart")
    strict = list(why)
    if q:
        if not q["kld"] < KLD_LIMIT:
            strict.append(f"BF16 vs 6 bpw: KLD {q['kld']:.3e} >= {KLD_LIMIT}")
        if not q["top1"] >= TOP1_MIN:
            strict.append(f"BF16 vs 6 bpw: top-1 {q['top1']:.4f} < {TOP1_MIN}")
    return {"pass": not why, "why_not": why, "pass_strict": not strict, "why_not_strict": strict}


# ------------------------------------------------------------------------------------------------ the check

def build_drafter(run: Run, args, target_cfg: dict, data) -> tuple[Path, dict]:
    """Random drafter for the target, distilled on (ids, states) when given. Writes OUT/drafter-bf16."""
    from mixq.formats.dflash2 import drafter_config, random_weights, write_drafter

    config = drafter_config(target_cfg, layers=args.layers, block_size=args.block_size)
    weights = random_weights(config, seed=args.seed)
    kind = "random"
    if data is not None and not args.random:
        ids, states = data
        emb, head = target_io_weights(args.target)
        model = TorchDrafter(config, weights, emb, head).to(args.torch_device)
        stats = run.phase("distill", distill, model, ids, states, steps=args.train_steps, seconds=args.train_seconds,
                          batch=args.train_batch, seed=args.seed, log=run.log)
        if stats is not None:
            weights, kind = model.weights(), "distilled"
            run.report["distill"] = stats
            run.log(f"distilled: {stats}")
        del model
    run.report["drafter"] = {"kind": kind, "config": config}
    path = write_drafter(args.out / "drafter-bf16", config, weights)
    run.log(f"drafter ({kind}) written to {path}")
    return path, config


def convert_drafter_cli(src: Path, out: Path, device: str) -> dict:
    """`mixq convert SRC OUT --format exl3 --bpw 6`, as a user runs it; its --json summary."""
    cmd = [sys.executable, "-m", "mixq", "convert", str(src), str(out), "--format", "exl3", "--bpw", "6",
           "--device", device, "--json"]
    # the child imports mixq exactly as this process does (an installed copy or a path set up by the caller)
    path = os.pathsep.join([p for p in sys.path if p] + [os.environ.get("PYTHONPATH", "")])
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=out.parent, timeout=900,
                       env=dict(os.environ, TQDM_DISABLE="1", PYTHONPATH=path))
    if r.returncode != 0:
        raise RuntimeError(f"mixq convert exited {r.returncode}: {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout)


def build_target(run: Run, args) -> Path:
    """--target-build DIR: a target with 128-wide KDA heads (bench/engines/kda128_target.py) from --target's config and
    tokenizer, trained on --calibration; reused when DIR already holds one."""
    out = args.target_build
    if kda128_target.is_built(out):
        run.log(f"target: reusing {out}")
        return out
    _, model = kda128_target.build(out, source=args.target, calibration=args.calibration, heldout=args.heldout,
                                   train_seconds=args.target_train_seconds, device=args.torch_device, seed=args.seed,
                                   log=run.log)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the training's memory, before exllamav3 loads the target
    return out


def describe_target(run: Run, target: Path, target_cfg: dict) -> None:
    """The target's KDA geometry and whether exllamav3's Generator is expected to run it (128 x 128 heads); for a
    bench/engines/kda128_target.py build also its training summary and its name for the report."""
    heads, width = kda128_target.kda_heads(target_cfg)
    run.report["target"] = {"kda_heads": heads, "kda_head_dim": width,
                            "generator_expected": width == kda128_target.KDA_HEAD_DIM}
    if kda128_target.is_built(target):
        summary = json.loads((target / "training_run.json").read_text())
        if "kda_heads" in summary:
            run.report["target_build"] = summary
            run.report["target_label"] = target.name


def check(args) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "log.txt").write_text("")
    run = Run(args.out)
    run.report["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    if args.target_build is not None:
        built = run.phase("target_build", build_target, run, args)
        if built is None:
            return finish(run)  # checking the source model instead would answer another question
        args.target = built
    target_cfg = json.loads((args.target / "config.json").read_text())
    describe_target(run, args.target, target_cfg)
    from mixq.formats.dflash2 import drafter_config

    taps = drafter_config(target_cfg, layers=args.layers)["dflash_config"]["target_layer_ids"]
    tokens = 1 << 17  # cache size (target and drafters alike): every job of the largest batch, two pages each
    # a recurrent (KDA) target rolls speculative passes of up to block_size - 1 tokens back
    target, cache, tok = run.phase("load_target", load_target, args.target, cache_tokens=tokens,
                                   max_batch=max(args.train_prompts, args.eval_prompts),
                                   history=args.block_size) or (None,) * 3
    data = None
    if target is not None and not args.random:
        data = run.phase("training_data", training_data, run, args, target, cache, tok, taps)
    src, config = build_drafter(run, args, target_cfg, data)
    exl3 = args.out / "drafter-6.0bpw"
    conv = run.phase("convert", convert_drafter_cli, src, exl3, args.convert_device)
    if conv:
        run.report["convert"] = {k: conv.get(k) for k in ("bits", "bytes", "seconds", "quantized", "tensors", "device")}
        run.log(f"converted: {run.report['convert']}")
    if target is not None:
        drafters = {"bf16": run.phase("load_bf16", load_drafter, src, target, cache_tokens=tokens)}
        if conv:
            drafters["6bpw"] = run.phase("load_6bpw", load_drafter, exl3, target, cache_tokens=tokens)
        logits_phase(run, args, target, tok, taps, drafters, config, src, exl3)
        acceptance_phase(run, args, target, cache, tok, drafters, taps)
    return finish(run)


def training_data(run: Run, args, target, cache, tok, taps: list[int]):
    """The target's greedy continuations of calibration prompts and its exported states on them."""
    prompts = prompts_from(args.calibration, tok, args.train_prompts, args.prompt_tokens)
    try:
        g = generate(target, cache, tok, prompts, args.train_new_tokens)
        how = f"engine generator, {g['tokens_per_second']} tok/s"
    except RuntimeError as e:  # e.g. exllamav3's recurrent KDA kernel: 128 x 128 heads only
        if run.report["target"]["generator_expected"]:
            run.log(f"engine generation failed on a 128-wide KDA target: {e}\n{traceback.format_exc()}")
        run.log(f"engine generation failed ({e}); greedy continuations through the cache-less forward instead")
        t0 = time.time()
        g = {"tokens": greedy_without_cache(target, prompts, args.train_new_tokens)}
        how = f"cache-less forward, {time.time() - t0:.1f} s (engine generation failed: {e})"
    run.report["training_generation"] = how
    n = min(map(len, g["tokens"]))  # every job runs to max_new_tokens; cut to the shortest if not
    ids = torch.cat([torch.cat([p.flatten(), torch.tensor(t[:n], dtype=torch.long)])[None]
                     for p, t in zip(prompts, g["tokens"])])
    states, _ = target_states(target, ids, taps)
    run.log(f"training data: {tuple(ids.shape)} tokens ({how})")
    return ids, [s.to(args.torch_device) for s in states]


def logits_phase(run: Run, args, target, tok, taps, drafters: dict, config: dict, src: Path, exl3: Path) -> None:
    """The same drafting rounds through every loaded drafter: BF16 vs 6 bpw, each against the torch forward."""
    rep, block = run.report, args.block_size
    ids = torch.cat(prompts_from(args.heldout, tok, args.eval_windows, args.window))
    anchors = list(range(args.window // 8, args.window - block, max(1, (args.window - block) // 8)))[:8]
    states, guesses = run.phase("eval_states", target_states, target, ids, taps) or (None, None)
    if states is None:
        return
    engine = {name: run.phase(f"rounds_{name}", engine_rounds, d[0], d[1], target, states, taps, ids, anchors, block)
              for name, d in drafters.items() if d is not None}
    if engine.get("bf16") and engine.get("6bpw"):
        q = compare(engine["bf16"][0], engine["6bpw"][0])
        q["selector_tokens_agree"] = (engine["bf16"][1] == engine["6bpw"][1]).float().mean().item()
        rep["quant_logits"] = q
        run.log(f"BF16 vs 6 bpw drafter in exllamav3: {q}")
    want = guesses[:, torch.tensor(anchors)].flatten()  # the target's greedy token after each anchor
    rep["row1_guess_is_target_greedy"] = {name: (res[0][:, 0].argmax(-1) == want).float().mean().item()
                                          for name, res in engine.items() if res}
    rep["engine_vs_torch"] = run.phase("engine_vs_torch", engine_vs_torch, args, config, src, exl3, states, ids,
                                       anchors, engine)
    run.log(f"engine vs torch forward: {rep['engine_vs_torch']}")


def acceptance_phase(run: Run, args, target, cache, tok, drafters: dict, taps: list[int]) -> None:
    """exllamav3's speculative generation with each drafter, against plain greedy generation. A target its
    generator cannot run (the recurrent KDA kernel wants 128 x 128 heads) is measured by drafting rounds on the
    target's own greedy continuations instead (:func:`rounds_acceptance`)."""
    rep = run.report
    prompts = prompts_from(args.heldout, tok, args.eval_prompts, args.prompt_tokens)
    try:
        base = generate(target, cache, tok, prompts, args.eval_new_tokens)
    except Exception as e:  # noqa: BLE001 - any generator failure: the round-by-round measure still applies
        if rep["target"]["generator_expected"]:  # this target is the one the Generator should run: a failure
            rep["errors"]["generate_plain"] = f"{type(e).__name__}: {e}"
            run.log(f"generate_plain FAILED: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        run.log(f"engine generation failed ({e}); acceptance from drafting rounds on greedy continuations")
        rep["acceptance_method"] = f"drafting rounds on the target's greedy continuations (engine generation: {e})"
        run.phase("acceptance_rounds", rounds_acceptance, run, args, target, prompts, taps, drafters)
        return
    rep["acceptance_method"] = "exllamav3 Generator, speculative greedy decoding"
    rep["acceptance"], rep["generation"] = {}, {}
    for name, loaded in drafters.items():
        if loaded is None:
            continue
        g = run.phase(f"generate_{name}", generate, target, cache, tok, prompts, args.eval_new_tokens,
                      drafter=loaded[0], draft_cache=loaded[1])
        if not g:
            continue
        rep["acceptance"][name] = g["acceptance"]
        rep["generation"][name] = {k: g[k] for k in ("accepted", "drafted", "seconds", "tokens_per_second")}
        if base:
            same = sum(a == b for a, b in zip(g["tokens"], base["tokens"])) / len(prompts)
            rep["generation"][name]["same_text_as_plain"] = same
        run.log(f"speculative generation with the {name} drafter: {rep['generation'][name]}, "
                f"acceptance {g['acceptance']}")
    if base:
        rep["generation"]["plain"] = {k: base[k] for k in ("seconds", "tokens_per_second")}


def rounds_acceptance(run: Run, args, target, prompts: list[torch.Tensor], taps: list[int], drafters: dict) -> None:
    """Acceptance of greedy speculative decoding, measured round by round: the target's greedy continuation of each
    prompt (cache-less forward) is what lossless greedy decoding emits, so a drafting round at position p (the
    target's states of positions < p, the block [ids[p], mask...]) has its drafted tokens accepted up to the first
    one that differs from ids[p+1:p+b]. Rounds start at every `stride`-th position of the continuation;
    acceptance = accepted / drafted tokens, as the generator counts them."""
    rep, block = run.report, args.block_size
    t0 = time.time()
    cont = greedy_without_cache(target, prompts, args.eval_new_tokens)
    ids = torch.cat([torch.cat([p.flatten(), torch.tensor(c, dtype=torch.long)])[None] for p, c in zip(prompts, cont)])
    states, _ = target_states(target, ids, taps)
    p0 = prompts[0].numel()
    anchors = list(range(p0, ids.shape[1] - block + 1, args.round_stride))
    rep["acceptance"], rep["generation"] = {}, {"plain": {"seconds": round(time.time() - t0, 2),
                                                          "rows": ids.shape[0], "rounds_per_row": len(anchors)}}
    truth = torch.stack([ids[:, p + 1:p + block] for p in anchors], 1).flatten(0, 1)  # (rows·anchors, b−1)
    for name, loaded in drafters.items():
        if loaded is None:
            continue
        t = time.time()
        _, paths = engine_rounds(loaded[0], loaded[1], target, states, taps, ids, anchors, block)
        ok = (paths == truth).long().cumprod(-1)
        accepted, drafted = int(ok.sum()), int(truth.numel())
        rep["acceptance"][name] = accepted / drafted
        rep["generation"][name] = {"accepted": accepted, "drafted": drafted, "seconds": round(time.time() - t, 2),
                                   "rounds": int(truth.shape[0]),
                                   "mean_accepted_per_round": ok.sum(-1).float().mean().item()}
        run.log(f"drafting rounds with the {name} drafter: {rep['generation'][name]}, acceptance "
                f"{rep['acceptance'][name]:.4f}")


def engine_vs_torch(args, config, src, exl3, states, ids, anchors, engine) -> dict:
    """Each engine drafter against the torch forward on the same weights (6 bpw: mixq's dequantized weights)."""
    from safetensors.torch import load_file

    from mixq.runtime.dequant import read_exl3

    emb, head = target_io_weights(args.target)
    out = {}
    sources = {"bf16": lambda: {n: t.float() for n, t in load_file(str(src / "model.safetensors")).items()},
               "6bpw": lambda: read_exl3(exl3)}
    for name, res in engine.items():
        if not res:
            continue
        model = TorchDrafter(config, sources[name](), emb, head).to(args.torch_device)
        out[name] = compare(reference_rounds(model, states, ids, anchors), res[0])
        del model
    return out


def finish(run: Run) -> dict:
    run.report.update(verdict(run.report))
    run.save()
    (run.out / "results.md").write_text(results_md(run.report))
    return run.report


def results_md(rep: dict) -> str:
    """The docs/results.md lines of this run."""
    q, acc, g = rep.get("quant_logits") or {}, rep.get("acceptance") or {}, rep.get("generation") or {}
    d, c = rep.get("drafter") or {}, rep.get("convert") or {}
    lines = [target_line(rep)] if rep.get("target_build") else []
    lines += [f"- drafter: {d.get('kind')} ({(rep.get('distill') or {}).get('steps', 0)} distillation steps, "
             f"{(rep.get('distill') or {}).get('seconds', 0)} s), 6 bpw EXL3 {c.get('bytes', 0) / 2**20:.2f} MiB, "
             f"converted in {c.get('seconds', 0):.1f} s on {c.get('device')}"]
    if q:
        lines.append(f"- draft logits, BF16 vs 6 bpw drafter in exllamav3: mutual KLD {q['kld']:.3e} "
                     f"(rev {q['kld_rev']:.3e}), top-1 {100 * q['top1']:.2f}%, selector tokens "
                     f"{100 * q['selector_tokens_agree']:.2f}% equal, {q['positions']} positions")
    for name in ("bf16", "6bpw"):
        if acc.get(name) is not None:
            gg = g.get(name, {})
            if "rounds" in gg:
                lines.append(f"- acceptance with the {name} drafter: {100 * acc[name]:.2f}% ({gg['accepted']}/"
                             f"{gg['drafted']} drafted tokens, {gg['rounds']} drafting rounds on "
                             f"{rep.get('target_label', 'k256')}'s greedy continuations, "
                             f"{gg['mean_accepted_per_round']:.2f} accepted per round)")
                continue
            lines.append(f"- acceptance with the {name} drafter: {100 * acc[name]:.2f}% ({gg.get('accepted')}/"
                         f"{gg.get('drafted')} drafted tokens), {gg.get('tokens_per_second')} tok/s, "
                         f"text equal to plain greedy in {100 * gg.get('same_text_as_plain', 0):.0f}% of prompts")
    e = (rep.get("engine_vs_torch") or {}).get("6bpw")
    if e:
        lines.append(f"- 6 bpw drafter, exllamav3 vs mixq's dequantized weights in torch: KLD {e['kld']:.3e}, "
                     f"top-1 {100 * e['top1']:.2f}%")
    lines.append(f"- {verdict_line(rep)}")
    return "\n".join(lines) + "\n"


def target_line(rep: dict) -> str:
    """The built target's row: its KDA heads and its training."""
    b, t = rep["target_build"], rep.get("target") or {}
    return (f"- target: {rep.get('target_label')}, KDA {t.get('kda_heads')} x {t.get('kda_head_dim')} heads, "
            f"{b.get('params', 0) / 1e6:.2f} M parameters, trained {b.get('steps')} steps ({b.get('seconds')} s, "
            f"{b.get('batch')} x {b.get('seq')} tokens): train loss {b.get('train_loss_first', 0):.3f} -> "
            f"{b.get('train_loss_last', 0):.3f}, held-out {b.get('heldout_loss_init', 0):.3f} -> "
            f"{b.get('heldout_loss', 0):.3f} (ln vocab {b.get('uniform_loss', 0):.3f})")


def verdict_line(rep: dict) -> str:
    line = "PASS" if rep.get("pass") else "FAIL: " + "; ".join(rep.get("why_not", []))
    extra = [w for w in rep.get("why_not_strict", []) if w not in rep.get("why_not", [])]
    return line + (" (strict limits: PASS)" if rep.get("pass_strict") else
                   f" (strict limits: FAIL: {'; '.join(extra)})" if extra else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="directory for drafter_check.json, log.txt, drafters")
    ap.add_argument("--target", type=Path, default=SHARED / "models" / "glm5next-k256")
    ap.add_argument("--target-build", type=Path, default=None,
                    help="build a 128-wide-KDA target from --target's config into this directory (or reuse it) "
                         "and check against it")
    ap.add_argument("--target-train-seconds", type=float, default=90.0)
    ap.add_argument("--calibration", type=Path, default=SHARED / "data" / "calibration.txt")
    ap.add_argument("--heldout", type=Path, default=SHARED / "data" / "heldout.txt")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--random", action="store_true", help="keep the drafter random (no distillation)")
    ap.add_argument("--train-seconds", type=float, default=75.0)
    ap.add_argument("--train-steps", type=int, default=4000)
    ap.add_argument("--train-batch", type=int, default=256)
    ap.add_argument("--train-prompts", type=int, default=192)
    ap.add_argument("--train-new-tokens", type=int, default=224)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--eval-new-tokens", type=int, default=128)
    ap.add_argument("--round-stride", type=int, default=2,
                    help="positions between drafting rounds when acceptance is measured round by round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch-device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--convert-device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    rep = check(args)
    print(results_md(rep), end="")
    print(verdict_line(rep))
    return 0 if rep["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
