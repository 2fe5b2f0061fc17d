"""`--text generated[:N]`: score on the reference's own replies, a token source like any text.

The reference continues N held-out prompts (`--prompts FILE`): each prompt is `--gen-prompt-tokens` tokens of
that file, wrapped in the reference's chat template when its tokenizer has one (template prefix + the prompt's
tokens + the template's generation prompt, so every prompt has one length). Even-numbered continuations are greedy,
odd-numbered ones sampled at `--gen-temperature` with seed `--gen-seed` + i (temperature 0: all greedy); each has
`--gen-tokens` tokens (runtime/generate.py). Each sequence is one window: prompt + continuation, and only the
continuation's tokens are scored (the window's first scored position is the prompt's last token, which predicts
the first continuation token).

The token file (`--save-generated FILE`; by default `<--json stem>.tokens.json` beside the report) is JSON:
the prompt and continuation ids of every sequence with its mode and seed, the reference's identity (config,
tokenizer and weight-file headers, each by sha256) and the generation settings. `--text FILE` of that kind
scores exactly those ids again without generating; a file from another tokenizer or vocabulary is refused.
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from mixq.errors import FormatError, InputError, escape
from mixq.formats.chat_template import model_template, render
from mixq.formats.glm5next import classify
from mixq.formats.model_files import read_json
from mixq.formats.safetensors_io import sha256_file
from mixq.runtime import reference as refm
from mixq.runtime.generate import generate

SPEC_WORD = "generated"
DEFAULT_COUNT = 16
MAX_COUNT = 100_000
FORMAT_TAG = "mixq-generated-tokens-1"
TOKEN_FILE_SUFFIX = ".tokens.json"
_TAG_RE = re.compile(rb'^\s*\{\s*"format"\s*:\s*"mixq-generated-tokens-')
_SENTINEL = "\u2063MIXQ-PROMPT\u2063"  # an invisible separator no template writes: where the user text goes
SPEC_HELP = "--text generated or generated:N (N continuations, N >= 1)"


@dataclass(frozen=True)
class GeneratedSpec:
    """`--text generated[:N]`: N continuations to generate."""

    count: int

    def __str__(self) -> str:
        return f"{SPEC_WORD}:{self.count}"


def parse_text(text: str | Path | None) -> str | Path | GeneratedSpec | None:
    """--text as given: a GeneratedSpec for `generated` / `generated:N`, else the text (a path) unchanged.
    A file literally named `generated` is reached as ./generated."""
    if text is None or isinstance(text, Path) or not str(text).startswith(SPEC_WORD):
        return text
    s = str(text)
    if s == SPEC_WORD:
        return GeneratedSpec(DEFAULT_COUNT)
    head, sep, count = s.partition(":")
    if head != SPEC_WORD or not sep:
        return text  # e.g. generated_text.txt: a file name
    if not count.isdigit() or not 1 <= int(count) <= MAX_COUNT:
        raise InputError(f"--text {escape(s)}: expected {SPEC_HELP.removeprefix('--text ')} "
                         f"(N from 1 to {MAX_COUNT:,}); length and sampling by --gen-tokens, --gen-temperature")
    return GeneratedSpec(int(count))


def is_token_file(path: str | Path | None) -> bool:
    """Whether `path` is a token file this module wrote (its first bytes carry the format tag); no `--text` is
    not one (the caller names what is missing)."""
    if path is None:
        return False
    p = Path(path)
    try:
        with open(p, "rb") as f:
            return bool(_TAG_RE.match(f.read(256)))
    except OSError:
        return False


def default_token_file(json_out: str | Path | None) -> Path | None:
    """The token file beside a --json report (`report.json` -> `report.tokens.json`); None without one."""
    if json_out is None or str(json_out) == "-":
        return None
    p = Path(json_out)
    return p.with_name(p.stem + TOKEN_FILE_SUFFIX)


def reference_identity(ref_dir: Path) -> dict:
    """What names the reference without hashing its weights' bytes: config.json, tokenizer.json and every
    safetensors file's header (tensor names, dtypes, shapes, offsets) with its size, each by sha256."""
    d = Path(ref_dir)
    h = hashlib.sha256()
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            raw = fh.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else 0
            h.update(f.name.encode() + b"\0" + str(f.stat().st_size).encode() + b"\0" + fh.read(min(n, 1 << 28)))
    ident = {"name": d.name,
             "config_sha256": sha256_file(d / "config.json"),
             "tokenizer_sha256": sha256_file(d / "tokenizer.json") if (d / "tokenizer.json").is_file() else None,
             "weight_headers_sha256": h.hexdigest()}
    ident["digest"] = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
    return ident


def _template(ref_dir: Path) -> tuple[str | None, str | None]:
    """The reference's chat template (a named set: its "default", else the first) and the file it comes from."""
    template, where = model_template(ref_dir)
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return (template, where) if template else (None, None)


def prompt_ids(tokenizer, ref_dir: Path, prompts_path: Path, count: int, prompt_tokens: int) -> tuple[torch.Tensor, str | None]:
    """`count` prompts of equal length: consecutive `prompt_tokens`-token pieces of the prompts file, each inside
    the chat template (prefix + piece + generation prompt) when the reference has one. Returns (ids (count, len),
    the template's file or None)."""
    ids = refm.tokenize_text(tokenizer, prompts_path, need_tokens=count * prompt_tokens)
    if len(ids) < count * prompt_tokens:
        raise InputError(f"{prompts_path}: {len(ids):,} tokens, fewer than {count} prompts of --gen-prompt-tokens "
                         f"{prompt_tokens}")
    pieces = torch.tensor(ids[: count * prompt_tokens], dtype=torch.int64).view(count, prompt_tokens)
    template, where = _template(ref_dir)
    if template is None:
        return pieces, None
    special = {k: getattr(tokenizer, k, None) or "" for k in ("bos_token", "eos_token")}
    text = render(template, {"messages": [{"role": "user", "content": _SENTINEL}], "add_generation_prompt": True},
                  **special)
    if text.count(_SENTINEL) != 1:
        raise FormatError(f"{where}: the chat template does not write the user message once")
    before, after = text.split(_SENTINEL)
    enc = lambda s: torch.tensor(tokenizer(s, add_special_tokens=False)["input_ids"], dtype=torch.int64)  # noqa: E731
    pre, post = enc(before), enc(after)
    return torch.cat([pre.expand(count, -1), pieces, post.expand(count, -1)], dim=1), where


def modes(count: int, temperature: float, seed: int) -> tuple[list[bool], list[int | None]]:
    """(greedy flags, seeds): even rows greedy, odd rows sampled with seed + row; temperature 0: all greedy."""
    greedy = [temperature == 0 or i % 2 == 0 for i in range(count)]
    return greedy, [None if g else seed + i for i, g in enumerate(greedy)]


def generate_set(ref_dir: Path, ref_ckpt, prompts: torch.Tensor, template: str | None, prompts_path: Path, *,
                 prompt_tokens: int, tokens: int, temperature: float, seed: int, device: torch.device,
                 progress: bool) -> dict:
    """Generate the token set (the token file's document): the reference built whole from `ref_ckpt` (float32,
    NextN left out) continues `prompts` (`prompt_ids` of `prompts_path`; `template`: the chat template's file)."""
    n_layers = refm.num_hidden_layers(ref_ckpt.config)
    weights = {n: ref_ckpt.get(n, dtype=torch.float32) for n in ref_ckpt.names() if not classify(n, n_layers).mtp}
    model = refm.build_model(ref_dir, weights, device)
    del weights
    count = int(prompts.shape[0])
    greedy, seeds = modes(count, temperature, seed)
    with tqdm(total=tokens, desc=f"generating {count} replies", unit="tok", disable=not progress) as bar:
        cont = generate(model, prompts, tokens, greedy=greedy, seeds=seeds, temperature=temperature,
                        progress=lambda _: bar.update(1))
    del model
    vocab = int(ref_ckpt.config.get("text_config", ref_ckpt.config)["vocab_size"])
    return {
        "format": FORMAT_TAG,
        "reference": reference_identity(ref_dir),
        "vocab": vocab,
        "generation": {"prompts": Path(prompts_path).name, "prompts_sha256": sha256_file(prompts_path),
                       "prompt_text_tokens": prompt_tokens, "prompt_tokens": int(prompts.shape[1]),
                       "chat_template": Path(template).name if template else None, "tokens": tokens,
                       "temperature": temperature, "seed": seed, "greedy": sum(greedy),
                       "sampled": count - sum(greedy), "sampler": "torch.multinomial, CPU generator per row",
                       "stop": "none: every continuation has `tokens` tokens", "kv_cache": True,
                       "dtype": "float32"},
        "sequences": [{"mode": "greedy" if g else "sampled", "seed": s, "prompt": p.tolist(), "continuation": c.tolist()}
                      for g, s, p, c in zip(greedy, seeds, cont.prompts, cont.continuations)],
    }


def token_file_text(doc: dict) -> str:
    """The token file's text: JSON, the format tag first, one sequence's ids per line."""
    head = {k: v for k, v in doc.items() if k != "sequences"}
    body = ",\n".join("  " + json.dumps(s, separators=(",", ":")) for s in doc["sequences"])
    return json.dumps(head, indent=1)[:-2] + ',\n "sequences": [\n' + body + "\n ]\n}\n"


def read_token_file(path: Path, vocab: int, ref_dir: Path) -> dict:
    """A token file, checked: its format, one length for every prompt and every continuation, ids inside the
    vocabulary, and the reference's tokenizer (vocab size and tokenizer.json) the one it was generated with."""
    doc = read_json(path, "token file", FormatError)
    p = escape(str(path))
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_TAG:
        raise FormatError(f"{p}: not a mixq token file (format {doc.get('format') if isinstance(doc, dict) else None!r})")
    seqs, gen = doc.get("sequences"), doc.get("generation")
    if not isinstance(seqs, list) or not seqs or not isinstance(gen, dict):
        raise FormatError(f"{p}: no sequences")
    if doc.get("vocab") != vocab:
        raise InputError(f"{p}: generated for a vocabulary of {doc.get('vocab')!r} tokens; the reference has {vocab}")
    mine = reference_identity(ref_dir)["tokenizer_sha256"]
    theirs = (doc.get("reference") or {}).get("tokenizer_sha256")
    if mine != theirs:
        raise InputError(f"{p}: generated with another tokenizer (tokenizer.json sha256 {str(theirs)[:12]}, the "
                         f"reference's {str(mine)[:12]})")
    lens = set()
    for i, s in enumerate(seqs):
        ok = isinstance(s, dict) and all(isinstance(s.get(k), list) and s[k] and
                                         all(isinstance(t, int) and not isinstance(t, bool) for t in s[k])
                                         for k in ("prompt", "continuation"))
        if not ok:
            raise FormatError(f"{p}: sequence {i} lacks whole-number prompt / continuation ids")
        bad = [t for t in s["prompt"] + s["continuation"] if not 0 <= t < vocab]
        if bad:
            raise FormatError(f"{p}: sequence {i} holds token id {bad[0]}, outside the vocabulary of {vocab}")
        lens.add((len(s["prompt"]), len(s["continuation"])))
    if len(lens) != 1:
        raise FormatError(f"{p}: the sequences' prompt / continuation lengths differ ({sorted(lens)[:3]})")
    return doc


def windows_of(doc: dict, windows: int | None) -> refm.Windows:
    """The token file's sequences as windows (the first `windows` of them): prompt + continuation, the
    continuation's tokens scored."""
    seqs = doc["sequences"][:windows] if windows is not None else doc["sequences"]
    tokens = torch.tensor([s["prompt"] + s["continuation"] for s in seqs], dtype=torch.int64)
    return refm.Windows(tokens=tokens, first=len(seqs[0]["prompt"]) - 1)


def summary(doc: dict, file: Path | None, data: bytes) -> dict:
    """What the report says of a generated set: its token file (`data`: the file's bytes, for its sha256), the
    settings, the reference that generated it."""
    seqs = doc["sequences"]
    return {"file": str(file) if file else None, "sha256": hashlib.sha256(data).hexdigest(),
            "sequences": len(seqs), "prompt_tokens": len(seqs[0]["prompt"]),
            "continuation_tokens": len(seqs[0]["continuation"]),
            "greedy": sum(s.get("mode") == "greedy" for s in seqs),
            "sampled": sum(s.get("mode") == "sampled" for s in seqs),
            "seeds": [s.get("seed") for s in seqs if s.get("mode") == "sampled"],
            "settings": doc["generation"], "generated_by": doc.get("reference")}
