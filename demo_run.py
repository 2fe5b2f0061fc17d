"""`mixq demo`: write a tiny random glm5_next checkpoint and run every step on it, then say what the numbers mean.

Each step is a function ``(ctx) -> dict`` in ``STEPS``; it reads what earlier steps put in ``ctx`` and returns a
small JSON-able summary. The model is small enough for the EXL3 trellis on two CPU cores (about 0.35M trellis
weights: two decoder layers, the head left unquantized, the NextN block left out of the EXL3 file), and it
brings its own byte-level BPE tokenizer, trained on the built-in calibration text, so the demo needs nothing
but the package.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mixq.errors import InputError
from mixq.formats.model_summary import inspect_model
from mixq.formats.tiny import write_tiny_checkpoint
from mixq.planning.planner import plan_model
from mixq.planning.types import save_plan
from mixq.runtime.calibration import BUILTIN_TEXT
from mixq.conversion.api import convert, verify
from mixq.conversion.options import Exl3Options, GGUFOptions
from mixq.eval.api import evaluate

# KDA linear attention + DSA sparse attention, the dense first layer and a MoE layer; the NextN block copies
# the DSA + MoE layer; no vision tower (GGUF leaves it to an --mmproj file, EXL3 keeps it unquantized, and in a
# model this small it would be most of the bytes). 1024 embedding rows: the demo tokenizer's vocabulary.
DEMO_MODEL = {"layer_types": ("linear_attention", "deepseek_sparse_attention"), "n_experts": 2, "vocab": 1024,
              "vision": False}
DEMO_GGUF_TYPE = "Q8_0"
DEMO_EXL3_BPW = 3.05
# head unquantized and no NextN block: the EXL3 step stays at ~0.35M trellis weights
DEMO_EXL3 = {"bpw": DEMO_EXL3_BPW, "head_bits": 16, "include_mtp": False, "rows": 8, "seq_len": 128}
EVAL_CTX, EVAL_WINDOWS = 128, 4
DEMO_MARK = ".mixq-demo"  # marks a directory the demo made, so a later demo may replace its files
SPECIAL_TOKENS = ("<|endoftext|>", "[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|observation|>",
                  "<|system|>")
DEMO_DIR = "mixq-demo"  # where `mixq demo` writes when not told


def write_demo_tokenizer(out_dir: Path, vocab: int) -> Path:
    """A byte-level BPE tokenizer (GPT-2 pre-tokenizer, GLM's special tokens) trained on the built-in text:
    tokenizer.json + tokenizer_config.json in ``out_dir``. Deterministic."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([BUILTIN_TEXT], trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
         "model_max_length": 4096}, indent=2) + "\n")
    return out_dir


def _step_model(ctx: dict) -> dict:
    model = ctx["out"] / "tiny-glm5next"
    if not (model / "config.json").is_file():  # reused from an earlier run
        tok = write_demo_tokenizer(ctx["out"] / "tokenizer", DEMO_MODEL["vocab"])
        write_tiny_checkpoint(model, seed=ctx["seed"], tokenizer_dir=tok, **DEMO_MODEL)
    ctx["model"] = model
    return {"path": str(model)}


def _step_inspect(ctx: dict) -> dict:
    d = inspect_model(ctx["model"])
    (ctx["out"] / "inspect.json").write_text(json.dumps(d, indent=2) + "\n")
    return {"tensors": len(d["tensors"]), "params": d["params"], "layers": d["num_hidden_layers"],
            "layer_types": d["layer_types"], "nextn_layers": d["nextn_layers"],
            "routed_experts": d["experts"]["routed"], "roles": {r: v["tensors"] for r, v in d["roles"].items()},
            "file": str(ctx["out"] / "inspect.json")}


def _step_plan(ctx: dict) -> dict:
    gguf = plan_model(ctx["model"], "gguf", qtype=DEMO_GGUF_TYPE)
    o = DEMO_EXL3
    exl3 = plan_model(ctx["model"], "exl3", bpw=o["bpw"], head_bits=o["head_bits"], include_mtp=o["include_mtp"])
    save_plan(gguf, ctx["out"] / "plan-gguf.json")
    save_plan(exl3, ctx["out"] / "plan-exl3.json")
    return {"gguf_bytes": gguf.total_bytes, "gguf_file_bpw": round(gguf.file_bpw, 3),
            "exl3_bytes": exl3.total_bytes, "exl3_file_bpw": round(exl3.file_bpw, 3),
            "exl3_bits": round(exl3.bpw, 3), "ref_params": exl3.ref_params}


def _converted(res) -> dict:
    return {"out": res.out, "file_bytes": res.file_bytes, "file_bpw": round(res.file_bpw, 3),
            "tensors": res.tensors, "device": res.device}


def _step_convert_gguf(ctx: dict) -> dict:
    out = ctx["out"] / f"tiny-{DEMO_GGUF_TYPE}.gguf"
    # overwrite: a demo directory is reused from run to run
    res = convert(ctx["model"], out, GGUFOptions(qtype=DEMO_GGUF_TYPE, overwrite=True, progress=False))
    ctx["gguf"] = out
    return _converted(res)


def _step_convert_exl3(ctx: dict) -> dict:
    out = ctx["out"] / f"tiny-exl3-{DEMO_EXL3_BPW}"
    if out.exists():  # a finished EXL3 directory is never overwritten by convert: the demo's own, replaced
        shutil.rmtree(out)
    # the CPU on purpose where there is no GPU: this model is small enough for it
    device = None if torch.cuda.is_available() else "cpu"
    res = convert(ctx["model"], out, Exl3Options(**DEMO_EXL3, device=device, progress=ctx["progress"]))
    ctx["exl3"] = out
    return {**_converted(res), "bits": res.bits, "quantized": res.quantized}


def _step_verify(ctx: dict) -> dict:
    problems = {}
    for key in ("gguf", "exl3"):
        if key in ctx:
            problems[key] = len(verify(ctx[key]).get("problems", []))
    return {"problems": problems}


def _step_eval(ctx: dict) -> dict:
    text = ctx["out"] / "demo-text.txt"
    text.write_text(BUILTIN_TEXT * 4)
    cands = [ctx[k] for k in ("gguf", "exl3") if k in ctx]
    rep = evaluate(ctx["model"], cands, text, ctx=EVAL_CTX, windows=EVAL_WINDOWS, progress=False,
                   json_out=ctx["out"] / "eval.json", overwrite=True)  # the demo directory's own report
    return {"windows": rep["windows"], "ctx": rep["ctx"], "file": str(ctx["out"] / "eval.json"),
            "candidates": [{"name": Path(c["path"]).name, "file_bpw": round(c["file_bpw"], 3),
                            "kld_mean": c["kld_mean"], "top1": c["top1"], "positions": c["positions"]}
                           for c in rep["candidates"]]}


STEPS: list[tuple[str, Callable[[dict], dict]]] = [
    ("model", _step_model),
    ("inspect", _step_inspect),
    ("plan", _step_plan),
    ("convert_gguf", _step_convert_gguf),
    ("convert_exl3", _step_convert_exl3),
    ("verify", _step_verify),
    ("eval", _step_eval),
]


def demo_dir(out_dir: str | os.PathLike) -> Path:
    """The demo's directory: new, empty, or marked by an earlier demo (whose files it replaces). A directory
    holding anything else is refused: the demo writes fixed names there and would replace a user's files."""
    out = Path(out_dir)
    mark = out / DEMO_MARK
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} exists and is not a directory")
    if out.is_dir() and not mark.is_file() and any(out.iterdir()):
        raise InputError(f"--out {out} is not empty and holds no earlier demo ({DEMO_MARK} missing); give a new "
                         "or empty directory")
    out.mkdir(parents=True, exist_ok=True)
    mark.write_text("a mixq demo directory: `mixq demo` replaces its files\n", encoding="utf-8")
    return out


def run_demo(out_dir: str | os.PathLike = DEMO_DIR, *, seed: int = 0, progress: bool = False,
             skip: tuple[str, ...] = ()) -> dict:
    """Write ``out_dir/tiny-glm5next`` (reused when already there) and run every step of ``STEPS`` on it but
    those in ``skip``; returns {"out", "seconds", "steps": {name: summary with "seconds"}}. ``progress``: one
    line per step on stderr as it starts (and the EXL3 step's progress bars)."""
    unknown = [s for s in skip if s not in dict(STEPS) or s == "model"]
    if unknown:
        raise InputError(f"demo step {unknown[0]!r} cannot be skipped (steps: {', '.join(n for n, _ in STEPS[1:])})")
    out = demo_dir(out_dir)
    ctx: dict = {"out": out, "seed": seed, "progress": progress}
    report: dict = {"out": str(out), "steps": {}}
    t_all = time.perf_counter()
    todo = [(n, f) for n, f in STEPS if n not in skip]
    for i, (name, step) in enumerate(todo, 1):
        if progress:
            print(f"mixq demo [{i}/{len(todo)}] {name.replace('_', ' ')} ...", file=sys.stderr, flush=True)
        t = time.perf_counter()
        res = step(ctx)
        res["seconds"] = round(time.perf_counter() - t, 2)
        report["steps"][name] = res
    report["seconds"] = round(time.perf_counter() - t_all, 1)
    return report


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def format_demo(report: dict) -> str:
    """The readable summary of a demo run: one block per step, what the numbers mean, the commands to try next."""
    st = report["steps"]
    lines = [f"mixq demo: a tiny random glm5_next model through every step ({report['seconds']:.0f} s, "
             f"files in {report['out']})", ""]

    def row(name: str, text: str) -> None:
        secs = st[name]["seconds"]
        lines.append(f"  {name.split('_')[0]:<9} {text}" + f"  ({secs:.1f} s)")

    if "inspect" in st:
        i = st["inspect"]
        kinds = " + ".join("KDA" if t == "linear_attention" else "DSA" for t in i["layer_types"])
        parts = [f"{i['layers']} decoder layers ({kinds})", f"{i['routed_experts']} routed experts"]
        parts += ["NextN block"] * bool(i["nextn_layers"]) + ["vision tower"] * ("vision" in i["roles"])
        row("inspect", f"{i['params']:,} parameters in {i['tensors']} tensors: {', '.join(parts)}")
    if "plan" in st:
        p = st["plan"]
        row("plan", f"GGUF {DEMO_GGUF_TYPE}: {_mb(p['gguf_bytes'])}, {p['gguf_file_bpw']:.2f} bpw;  EXL3 --bpw "
                    f"{DEMO_EXL3_BPW}: {_mb(p['exl3_bytes'])}, {p['exl3_file_bpw']:.2f} bpw "
                    f"({p['exl3_bits']:.2f} bits on the quantized Linears)")
    for key in ("convert_gguf", "convert_exl3"):
        if key in st:
            c = st[key]
            extra = f" ({c['bits']:.2f} exllamav3 bits, {c['quantized']} trellis Linears)" if "bits" in c else ""
            row(key, f"{Path(c['out']).name}: {_mb(c['file_bytes'])}, {c['file_bpw']:.2f} bpw{extra}, "
                     f"on {c['device']}")
    if "verify" in st:
        probs = st["verify"]["problems"]
        row("verify", "read back: " + ", ".join(f"{k.upper()} {n} problems" for k, n in probs.items()))
    if "eval" in st:
        e = st["eval"]
        row("eval", f"against the model itself on {e['windows']} windows of {e['ctx']} tokens:")
        for c in e["candidates"]:
            lines.append(f"            {c['name']:<22} KLD {c['kld_mean']:.6f}   top-1 {100 * c['top1']:.1f}%   "
                         f"{c['file_bpw']:.2f} bpw")
    lines += [
        "",
        "What the numbers mean:",
        "  bpw    file bytes x 8 / the model's parameters: the same figure in plan, convert and eval. EXL3's",
        "         --bpw counts the quantized Linears only; here the unquantized embedding, head and norms are",
        "         a large part of a tiny model, so its file reads well above 3.05",
        "  KLD    how far the quantized model's next-token probabilities are from the original's (0 = identical;",
        "         a random tiny model has flat distributions, so real models show larger values)",
        "  top-1  how often both models pick the same most likely next token",
        "",
        "Next, on your own checkpoint (a directory or a Hugging Face repo id):",
        "  mixq inspect MODEL",
        "  mixq plan MODEL --format gguf --type Q4_K_M",
        "  mixq convert MODEL model-Q4_K_M.gguf --type Q4_K_M        # EXL3: an OUT directory and --bpw, on a GPU",
        "  mixq eval MODEL model-Q4_K_M.gguf --text held-out.txt",
    ]
    return "\n".join(lines)
