"""Tokenizer metadata for a glm5-next GGUF (byte-level BPE, `tokenizer.ggml.model = gpt2`).

Facts: ../shared/reference/gguf-glm5-next.md §1.4. The pre-tokenizer id (`tokenizer.ggml.pre`) is chosen the way
llama.cpp's converter chooses it: sha256 of the token ids of a fixed probe string, looked up in a table of known
tokenizers. An unknown hash whose pre-tokenizer is plain byte-level BPE with the GPT-2 split regex (the fixtures'
case) maps to `gpt-2`; anything else needs `tokenizer_pre=` (CLI `--tokenizer-pre`).
"""
from __future__ import annotations

import difflib
import json
import logging
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path

import gguf
from gguf import TokenType

from mixq.errors import InputError
from mixq.formats.model_files import check_tokenizer_files, read_json
from mixq.formats.checkpoint import load_tokenizer as _load_tokenizer

# llama.cpp's fingerprint of a pre-tokenizer: a probe text and the pre ids of known fingerprints, kept as cited
# data (formats/data/llamacpp_pretokenizer_probe.json names its source)
_PROBE = json.loads((Path(__file__).parent / "data" / "llamacpp_pretokenizer_probe.json").read_text(encoding="utf-8"))
PROBE_TEXT: str = _PROBE["probe_text"]
KNOWN_PRE: dict[str, str] = _PROBE["known_pre"]

# every tokenizer.ggml.pre value the loader of llama.cpp accepts for a BPE vocabulary (llama.cpp as vendored in
# llama-cpp-python 0.3.36, src/llama-vocab.cpp, llama_vocab::impl::load: the `tokenizer_pre == "..."` branches;
# any other value is "unknown pre-tokenizer type" and the model does not load). An absent key means "default".
LLAMACPP_PRE: frozenset[str] = frozenset((
    "a.x-4.0", "afmoe", "bailingmoe", "bailingmoe2", "bloom", "chameleon", "chatglm-bpe", "codeshell", "cohere2moe",
    "command-r", "dbrx", "deepseek-coder", "deepseek-llm", "deepseek-r1-qwen", "deepseek-v3", "default", "exaone",
    "exaone-moe", "exaone4", "f2llmv2", "falcon", "falcon-h1", "falcon3", "gemma4", "gigachat", "glm4", "glm5",
    "gpt-2", "gpt-4o", "gpt3-finnish", "granite-docling", "granite-embed-multi-311m", "granite-embed-multi-97m",
    "grok-2", "hunyuan", "hunyuan-dense", "hy_v4", "jais", "jais-2", "jina-de", "jina-es", "jina-v1-en",
    "jina-v2-code", "jina-v2-de", "jina-v2-es", "jina-v5-nano", "joyai-llm", "kanana2", "kimi-k2", "kormo",
    "laguna", "lfm2", "llada-moe", "llama-bpe", "llama-v3", "llama3", "llama4", "megrez", "mellum", "mellum2",
    "midm-2.0", "minerva-7b", "minicpm5", "minimax-m2", "modern-bert", "mpt", "olmo", "phi-2", "pixtral",
    "poro-chat", "qwen2", "qwen35", "refact", "roberta-bpe", "sarvam-moe", "seed-coder", "smaug-bpe", "smollm",
    "solar-open", "spark2_5", "stablelm2", "starcoder", "superbpe", "talkie", "tekken", "tiny_aya", "trillion",
    "ufakzeka", "viking", "whitespace", "youtu",
))

# tokenizer.ggml.token_type values (gguf-py's TokenType), stored as plain ints
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = (
    int(t) for t in (TokenType.NORMAL, TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNUSED))
_GPT2_SPLIT = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"


@dataclass
class TokenizerMeta:
    """Everything the GGUF carries about the tokenizer."""

    pre: str
    pre_hash: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    special_ids: dict[str, int] = field(default_factory=dict)   # bos/eos/unk/pad/eot/eom
    add_special: dict[str, bool] = field(default_factory=dict)  # add_bos/add_eos
    chat_template: str | None = None


def probe_hash(tokenizer) -> str:
    """The converter's fingerprint of a BPE pre-tokenizer: sha256 of str(encode(PROBE_TEXT))."""
    ids = tokenizer.encode(PROBE_TEXT)
    return sha256(str(ids).encode()).hexdigest()


def _plain_gpt2_pretok(model_dir: Path) -> bool:
    """True when tokenizer.json's pre-tokenizer is byte-level with the GPT-2 split regex and no normalizer."""
    tj = read_json(model_dir / "tokenizer.json", "tokenizer.json")
    if not isinstance(tj, dict):
        return False
    pt = tj.get("pre_tokenizer") or {}
    if tj.get("normalizer") is not None:
        return False
    if pt.get("type") == "ByteLevel":
        return bool(pt.get("use_regex", True)) and not pt.get("add_prefix_space", False)
    if pt.get("type") == "Sequence":
        subs = pt.get("pretokenizers") or []
        regex = [s for s in subs if s.get("type") == "Split"]
        bl = [s for s in subs if s.get("type") == "ByteLevel"]
        return (len(subs) == 2 and len(regex) == 1 and len(bl) == 1 and not bl[0].get("use_regex", True)
                and (regex[0].get("pattern") or {}).get("Regex") == _GPT2_SPLIT)
    return False


def check_pre(name: str, what: str = "--tokenizer-pre") -> str:
    """`name` when llama.cpp's loader knows it as a pre-tokenizer (LLAMACPP_PRE), else InputError naming `what`:
    a file with another value verifies but does not load."""
    if isinstance(name, str) and name in LLAMACPP_PRE:
        return name
    near = difflib.get_close_matches(str(name).lower(), sorted(LLAMACPP_PRE), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(near)}?" if near else " (e.g. gpt-2, glm4)"
    raise InputError(f"{what} {name!r}: not a pre-tokenizer llama.cpp knows, so it would refuse to load the "
                     f"file{hint}")


def choose_pre(tokenizer, model_dir: Path, override: str | None = None) -> tuple[str, str]:
    """(pre id, probe hash). `override` wins (when llama.cpp knows it); known hash next; plain GPT-2 byte-level ->
    `gpt-2`."""
    h = probe_hash(tokenizer)
    if override is not None:
        return check_pre(override), h
    if h in KNOWN_PRE:
        return KNOWN_PRE[h], h
    if _plain_gpt2_pretok(model_dir):
        return "gpt-2", h
    raise InputError(
        f"{model_dir}: unknown BPE pre-tokenizer (probe hash {h}); pass --tokenizer-pre NAME (e.g. glm4, gpt-2)"
    )


def gguf_token_strings(tok, n_vocab: int) -> tuple[list[str], list[int]]:
    """Token string and type of every id 0..n_vocab-1 as a GGUF's tokenizer.ggml.tokens / token_type hold them
    (llama.cpp's converter convention): ids the tokenizer lacks become `[PAD<id>]`, non-normalized added tokens
    are stored in their decoded form."""
    rev = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder  # id -> AddedToken
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n_vocab):
        if i not in rev:
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
            continue
        t = rev[i]
        if i in added:
            at = added[i]
            if not at.normalized:
                # the converter stores the decoded form of non-normalized added tokens
                t = tok.decode(tok.encode(t, add_special_tokens=False))
            is_ctrl = at.special or (t.startswith("<|") and t.endswith("|>"))
            types.append(TOKEN_CONTROL if is_ctrl else TOKEN_USER_DEFINED)
        else:
            types.append(TOKEN_NORMAL)
        tokens.append(t)
    return tokens, types


def first_token_difference(ours: list[str], theirs: list[str]) -> int | None:
    """The first id whose token string differs between two vocabularies (id = the shorter length when one is a
    prefix of the other); None when they are the same, token id by token id."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def tokenizer_metadata(model_dir: str | Path, n_vocab: int, tokenizer_pre: str | None = None) -> TokenizerMeta:
    """Build the GGUF tokenizer metadata from a model directory's tokenizer.json / tokenizer_config.json.

    `n_vocab` is the embedding row count: ids the tokenizer lacks become `[PAD<id>]` (UNUSED)."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        raise InputError(f"{model_dir}: no tokenizer.json (only byte-level BPE tokenizers are supported)")
    tok = _load_tokenizer(model_dir)
    pre, h = choose_pre(tok, model_dir, tokenizer_pre)
    vocab = tok.get_vocab()
    if max(vocab.values()) >= n_vocab:
        raise InputError(f"{model_dir}: tokenizer has id {max(vocab.values())} >= embedding rows {n_vocab}")
    tokens, types = gguf_token_strings(tok, n_vocab)
    if len(set(tokens)) != len(tokens):
        raise InputError(f"{model_dir}: token strings are not unique; llama.cpp would reject the vocabulary")

    logging.getLogger("gguf.vocab").setLevel(logging.ERROR)
    check_tokenizer_files(model_dir)  # SpecialVocab's own reads would end a broken file in a traceback
    sv = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=n_vocab)
    special = dict(sv.special_token_ids)
    # glm conventions (gguf-glm5-next.md §1.4): bos = [gMASK], eot = <|user|>, unk = <|endoftext|>, eom = <|observation|>
    names = {"bos": "[gMASK]", "eot": "<|user|>", "unk": "<|endoftext|>", "eom": "<|observation|>"}
    for key, text in names.items():
        if text in vocab:
            special[key] = vocab[text]
    special = {k: int(v) for k, v in special.items() if v is not None and 0 <= int(v) < n_vocab}
    merges = list(sv.merges)
    if not merges:
        raise InputError(f"{model_dir}: tokenizer.json has no BPE merges (llama.cpp needs them for gpt2 vocabularies)")
    return TokenizerMeta(pre=pre, pre_hash=h, tokens=tokens, token_types=types, merges=merges,
                         special_ids=special, add_special=dict(sv.add_special_token), chat_template=sv.chat_template)


def add_tokenizer(writer, meta: TokenizerMeta, chat_template: str | None = None) -> None:
    """Write `meta` into a gguf-py GGUFWriter (typed adders: ids are UINT32, types INT32)."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(meta.pre)
    writer.add_token_list(meta.tokens)
    writer.add_token_types(meta.token_types)
    writer.add_token_merges(meta.merges)
    for key, tid in sorted(meta.special_ids.items()):
        adder = getattr(writer, f"add_{key}_token_id", None)
        if adder is not None:
            adder(tid)
    for key, val in sorted(meta.add_special.items()):
        adder = getattr(writer, f"add_add_{key}_token", None)
        if adder is not None:
            adder(bool(val))
    tmpl = chat_template if chat_template is not None else meta.chat_template
    if tmpl:
        writer.add_chat_template(tmpl)
