"""Does an engine load a converted file and generate? llama.cpp for a GGUF, exllamav3 for an EXL3 directory.

Greedy continuation of the first `--prompt-tokens` tokens of held-out text by `--tokens` new tokens. llama.cpp runs
through llama-cpp-python's low-level API, loaded as `mixq eval --engine llamacpp` loads it (gguf-glm5-next.md
§6.4: no CPU extra buffers); exllamav3 through its Generator (bench/engines/drafter_engine.py). Prints (and with
--json writes) the load and generation seconds and the tokens.

    python bench/engines/generate_check.py --gguf MODEL.gguf --tokens 8 [--json OUT.json]
    python bench/engines/generate_check.py --exl3 MODEL-exl3 --tokens 8 [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from paths import SHARED  # noqa: E402

HELDOUT = SHARED / "data" / "heldout.txt"


def llamacpp_generate(path: Path, *, prompt_tokens: int, tokens: int, text: Path = HELDOUT) -> dict:
    """Load `path` in llama.cpp and generate `tokens` greedily after a held-out prompt."""
    import llama_cpp as L
    import numpy as np

    t0 = time.time()
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    if hasattr(mp, "use_extra_bufts"):
        mp.use_extra_bufts = False  # the CPU AMX repacking crashes on this architecture (gguf-glm5-next.md §6.4)
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise SystemExit(f"{path}: llama.cpp could not load the model")
    vocab = L.llama_model_get_vocab(model)
    n_vocab = int(L.llama_vocab_n_tokens(vocab))
    raw = text.read_text(encoding="utf-8")[: 16 * prompt_tokens].encode()
    buf = (L.llama_token * (len(raw) + 8))()  # at most one token per byte
    n = L.llama_tokenize(vocab, raw, len(raw), buf, len(buf), False, False)
    prompt = [int(buf[i]) for i in range(min(max(n, 0), prompt_tokens))]
    if not prompt:
        raise SystemExit(f"{path}: llama.cpp tokenized no prompt tokens")
    cp = L.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = len(prompt) + tokens
    cp.n_seq_max = 1
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise SystemExit(f"{path}: llama.cpp could not create a context")
    load_s = time.time() - t0
    batch = L.llama_batch_init(len(prompt) + tokens, 0, 1)
    out: list[int] = []
    t1 = time.time()
    try:
        todo, pos = prompt, 0
        for _ in range(tokens):
            for i, tok in enumerate(todo):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos + i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1 if i == len(todo) - 1 else 0
            batch.n_tokens = len(todo)
            rc = L.llama_decode(ctx, batch)
            if rc != 0:
                raise SystemExit(f"{path}: llama_decode failed with code {rc}")
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, len(todo) - 1), shape=(n_vocab,))
            pos += len(todo)
            nxt = int(logits.argmax())
            out.append(nxt)
            todo = [nxt]
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    gen_s = time.time() - t1
    return {"engine": "llama.cpp", "load_seconds": round(load_s, 2), "generate_seconds": round(gen_s, 2),
            "prompt_tokens": len(prompt), "tokens": out, "tokens_per_second": round(len(out) / max(gen_s, 1e-9), 2)}


def exllamav3_generate(path: Path, *, prompt_tokens: int, tokens: int, text: Path = HELDOUT) -> dict:
    """Load the EXL3 directory `path` in exllamav3 and generate `tokens` greedily after a held-out prompt."""
    from drafter_engine import generate, load_target, prompts_from

    t0 = time.time()
    model, cache, tok = load_target(path, cache_tokens=max(256, -(-(prompt_tokens + tokens) // 256) * 256),
                                    max_batch=1, history=0)
    load_s = time.time() - t0
    prompts = prompts_from(text, tok, 1, prompt_tokens)
    g = generate(model, cache, tok, prompts, tokens)
    return {"engine": "exllamav3", "load_seconds": round(load_s, 2), "generate_seconds": g["seconds"],
            "prompt_tokens": int(prompts[0].numel()), "tokens": g["tokens"][0],
            "tokens_per_second": g["tokens_per_second"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", type=Path, help="a .gguf file, loaded by llama.cpp")
    src.add_argument("--exl3", type=Path, help="an EXL3 directory, loaded by exllamav3")
    ap.add_argument("--tokens", type=int, default=8, help="tokens to generate")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.gguf:
        res = llamacpp_generate(a.gguf, prompt_tokens=a.prompt_tokens, tokens=a.tokens)
    else:
        res = exllamav3_generate(a.exl3, prompt_tokens=a.prompt_tokens, tokens=a.tokens)
    res["ok"] = len(res["tokens"]) == a.tokens
    text = json.dumps(res, indent=2) + "\n"
    if a.json:
        a.json.write_text(text)
    print(text, end="")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
