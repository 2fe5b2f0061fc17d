"""Candidates for `mixq eval`: format detection, size on disk, their weights, and the checks against the reference.

Every candidate (HF checkpoint, EXL3 directory, GGUF file) is read as HF-named dequantized tensors one decoder
layer at a time (`runtime.dequant`) and run in the reference's architecture. Before that, `check_candidate`
refuses a candidate whose score would mean nothing: a GGUF whose mixq seal fails, a vocabulary that is not the
reference's token id by token id, a GGUF trained for a shorter context than the windows.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from mixq.runtime.dequant import DequantSource, in_text_forward, open_dequant
from mixq.errors import FormatError, InputError
from mixq.formats.checkpoint import load_tokenizer
from mixq.formats.gguf_integrity import integrity_problems
from mixq.formats.gguf_reader import read_gguf
from mixq.formats.gguf_tokenizer import first_token_difference, gguf_token_strings
from mixq.formats.model_files import check_model_dir, read_json

_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


@dataclass(frozen=True)
class Candidate:
    path: Path
    format: str  # "hf" | "exl3" | "gguf"
    bytes: int   # weight files on disk (see `weight_bytes`)


def detect_format(path: Path) -> str:
    """'gguf' for a file starting with the GGUF magic, 'exl3' for a directory whose config.json has
    quantization_config.quant_method == 'exl3', 'hf' for another directory with safetensors files."""
    path = Path(path)
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return "gguf"
        raise InputError(f"{path}: not a GGUF file (magic {magic!r}) and not a checkpoint directory")
    if path.is_dir():
        check_model_dir(path)  # a candidate directory is untrusted: no link may lead out of it
        cfg = path / "config.json"
        if cfg.is_file():
            config = read_json(cfg, "config.json", FormatError)
            qc = (config.get("quantization_config") if isinstance(config, dict) else None) or {}
            if isinstance(qc, dict) and qc.get("quant_method") == "exl3":
                return "exl3"
        if any(path.glob("*.safetensors")):
            return "hf"
        raise InputError(f"{path}: directory holds no *.safetensors files (pass a GGUF file itself)")
    raise InputError(f"{path}: no such file or directory")


def gguf_split_paths(path: Path) -> list[Path]:
    """All shards of a gguf-split set given any shard (or the single file)."""
    m = _SPLIT_RE.match(path.name)
    if not m:
        return [path]
    n = int(m["n"])
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def weight_bytes(path: Path, fmt: str) -> int:
    """Bytes on disk of the weights: every shard of a GGUF; the *.safetensors files of a directory."""
    if fmt == "gguf":
        files = gguf_split_paths(Path(path))
        missing = [p for p in files if not p.is_file()]
        if missing:
            raise InputError(f"{path}: GGUF split shard missing: {missing[0]}")
    else:
        files = sorted(Path(path).glob("*.safetensors"))
    return int(sum(p.stat().st_size for p in files))


def open_candidate(path: str | Path) -> Candidate:
    p = Path(path)
    fmt = detect_format(p)
    return Candidate(path=p, format=fmt, bytes=weight_bytes(p, fmt))


def open_weights(cand: Candidate, num_hidden_layers: int, device: str | torch.device = "cpu") -> DequantSource:
    """The candidate's dequantized weights, read one decoder layer at a time (`runtime.dequant`)."""
    return open_dequant(cand.path, cand.format, num_hidden_layers=num_hidden_layers, device=device)


def check_against_reference(cand: dict[str, tuple[int, ...]], ref: dict[str, tuple[int, ...]], n_layers: int,
                            where: Path | str) -> None:
    """A candidate's tensors (name -> shape) must be reference tensors of the reference's shape, and every
    tensor of the text forward must be there; NextN and vision tensors may be left out (the evaluated forward
    does not use them). Raises FormatError naming the candidate."""
    unknown = sorted(set(cand) - set(ref))
    if unknown:
        raise FormatError(f"{where}: {len(unknown)} tensors not in the reference, e.g. {unknown[0]}")
    missing = sorted(n for n in ref if n not in cand and in_text_forward(n, n_layers))
    if missing:
        raise FormatError(f"{where}: {len(missing)} reference tensors missing, e.g. {missing[0]}")
    for name, shape in cand.items():
        if tuple(shape) != tuple(ref[name]):
            raise FormatError(f"{where}: tensor {name} has shape {tuple(shape)}, reference {tuple(ref[name])}")


def reference_tokens(ref_dir: Path, vocab: int, tokenizer=None) -> list[str] | None:
    """The reference's vocabulary as GGUF token strings (ids 0..vocab-1); None when it has no tokenizer.json
    (then there is nothing to compare a candidate's vocabulary with)."""
    if tokenizer is None:
        if not (Path(ref_dir) / "tokenizer.json").is_file():
            return None
        tokenizer = load_tokenizer(ref_dir)
    return gguf_token_strings(tokenizer, vocab)[0]


def check_candidate(cand: Candidate, ref_tokens: list[str] | None, ref_dir: Path, ctx: int) -> None:
    """Refuse a candidate whose score would mean nothing, before any forward: a GGUF whose mixq seal fails (the
    check `mixq verify` runs) or whose context_length is shorter than `ctx`; a vocabulary (a GGUF's
    tokenizer.ggml.tokens, a directory's tokenizer.json) that differs from the reference's at any token id.
    A directory without tokenizer.json is scored on the reference's token ids as it stands."""
    if cand.format == "gguf":
        problems, _ = integrity_problems(gguf_split_paths(cand.path))
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise FormatError(f"{cand.path}: fails its integrity seal: {problems[0]}{more}; `mixq verify` lists "
                              "every problem")
        kv = read_gguf(cand.path).kv
        n_ctx = kv.get(f"{kv.get('general.architecture')}.context_length")
        if isinstance(n_ctx, int) and ctx > n_ctx:
            raise InputError(f"--ctx {ctx} is longer than {cand.path}'s context_length {n_ctx}")
        tokens, where = kv.get("tokenizer.ggml.tokens"), f"{cand.path} (tokenizer.ggml.tokens)"
        if not isinstance(tokens, list):
            raise FormatError(f"{cand.path}: carries no tokenizer.ggml.tokens, so its vocabulary cannot be "
                              "checked against the reference's (llama.cpp needs it too)")
    elif (cand.path / "tokenizer.json").is_file():
        tok = load_tokenizer(cand.path)
        tokens = gguf_token_strings(tok, max(len(ref_tokens or []), max(tok.get_vocab().values()) + 1))[0]
        where = f"{cand.path / 'tokenizer.json'}"
    else:
        return
    if ref_tokens is None:
        return
    i = first_token_difference(tokens, ref_tokens)
    if i is not None:
        ours = repr(tokens[i]) if i < len(tokens) else "no token"
        theirs = repr(ref_tokens[i]) if i < len(ref_tokens) else "no token"
        raise InputError(f"{where}: not the reference's vocabulary: token id {i} is {ours} here, {theirs} in "
                         f"{ref_dir}/tokenizer.json ({len(tokens)} and {len(ref_tokens)} tokens); scores over the "
                         "reference's token ids would compare different tokens")
