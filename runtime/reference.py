"""The reference forward: transformers' glm5_next model, the model's tokenizer, and llama-perplexity windows.

The model is never re-implemented: every forward (reference and dequantized candidates) is
transformers' `Glm5NextForConditionalGeneration` in float32, built from a checkpoint-named state dict so
that transformers' own key conversion (stacked experts, renamed mHC tensors, ...) applies.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from mixq.errors import FormatError, InputError
from mixq.formats.checkpoint import load_tokenizer  # noqa: F401 - re-exported for callers
from mixq.formats.glm5next import classify, global_hf_name
from mixq.quant.device import pick_device  # noqa: F401 - re-exported for callers
from mixq.runtime.calibration import calibration_rows
from mixq.runtime.kl_stats import log_probs, token_quantities
from mixq.formats.model_files import read_json

DEFAULT_ARCH = "Glm5NextForConditionalGeneration"


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' load report and progress bars while building models from state dicts."""
    from transformers.utils import logging as tlog

    old = tlog.get_verbosity()
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        tlog.set_verbosity(old)
        tlog.enable_progress_bar()


def read_config(model_dir: Path) -> dict:
    """config.json of an HF checkpoint directory."""
    cfg = Path(model_dir) / "config.json"
    if not cfg.is_file():
        raise InputError(f"{model_dir}: no config.json (not an HF checkpoint directory)")
    config = read_json(cfg, "config.json", FormatError)
    if not isinstance(config, dict):
        raise FormatError(f"{cfg}: config.json is not a JSON object")
    return config


def num_hidden_layers(config: dict) -> int:
    return int(config.get("text_config", config)["num_hidden_layers"])


def drop_mtp(weights: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """Remove NextN/MTP block tensors (the architecture table's `mtp`): the causal-LM forward never uses them."""
    return {name: t for name, t in weights.items() if not classify(name, n_layers).mtp}


def build_model(model_dir: Path, weights: dict[str, torch.Tensor], device: torch.device) -> torch.nn.Module:
    """The reference architecture of `model_dir` (its config.json) holding `weights` (checkpoint names), fp32, eval mode."""
    import transformers

    cfg_dict = read_config(model_dir)
    arch = (cfg_dict.get("architectures") or [DEFAULT_ARCH])[0]
    cls = getattr(transformers, arch, None)
    if cls is None:
        raise InputError(f"{model_dir}: architecture {arch!r} is not in transformers {transformers.__version__}")
    # the weights arrive dequantized (e.g. an FP8 release as REF): build the plain float model, without the
    # quantization_config that real FP8 configs carry at the top level and in text_config
    plain = {k: v for k, v in cfg_dict.items() if k != "quantization_config"}
    if isinstance(plain.get("text_config"), dict):
        plain["text_config"] = {k: v for k, v in plain["text_config"].items() if k != "quantization_config"}
    config = cls.config_class.from_dict(plain)
    sd = {k: v.to(torch.float32) for k, v in drop_mtp(weights, num_hidden_layers(cfg_dict)).items()}
    with _quiet_transformers():
        model = cls.from_pretrained(None, config=config, state_dict=sd, dtype=torch.float32)
    return model.to(device).eval()


def tokenize_text(tokenizer, text_path: Path, need_tokens: int | None = None) -> list[int]:
    """Token ids of the text file (no special tokens added).

    With `need_tokens`, only a prefix cut at a line end is tokenized when it already yields enough tokens
    (with a margin, so the cut never touches the tokens used); otherwise the whole file.
    """
    try:
        text = Path(text_path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{text_path}: cannot read text ({e})") from e
    if not text.strip():
        raise InputError(f"{text_path}: the text file is empty")
    if need_tokens is not None:
        cut = text.rfind("\n", 0, need_tokens * 8 + 4096)
        if 0 < cut < len(text) - 1:
            ids = tokenizer(text[: cut + 1], add_special_tokens=False)["input_ids"]
            if len(ids) >= need_tokens + 256:
                return ids
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass(frozen=True)
class Windows:
    """llama-perplexity chunking: `count` windows of `ctx` tokens; positions first..ctx-2 are scored."""

    tokens: torch.Tensor  # int64 (count, ctx)
    first: int

    @property
    def ctx(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def count(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def scored_per_window(self) -> int:
        return self.ctx - 1 - self.first

    def targets(self, w: int) -> torch.Tensor:
        """The true next tokens of the scored positions of window w."""
        return self.tokens[w, self.first + 1 :]


def first_scored(ctx: int, score: str) -> int:
    """First scored position: ctx/2 ('half', llama-perplexity) or 0 ('all')."""
    if score == "half":
        return ctx // 2
    if score == "all":
        return 0
    raise InputError(f"--score must be 'half' or 'all', not {score!r}")


def make_windows(ids: list[int], ctx: int, windows: int | None, score: str, source: str | Path = "the text") -> Windows:
    """Cut ⌊len/ctx⌋ windows (capped by `windows`); `source` names the text in errors."""
    if ctx < 4:
        raise InputError(f"--ctx {ctx} is too small (need at least 4 tokens)")
    n = len(ids) // ctx
    if windows is not None:
        if windows < 1:
            raise InputError(f"--windows must be at least 1, not {windows}")
        n = min(n, windows)
    if n < 1:
        raise InputError(f"{source}: {len(ids)} tokens, fewer than one window of --ctx {ctx}")
    t = torch.tensor(ids[: n * ctx], dtype=torch.int64).view(n, ctx)
    return Windows(tokens=t, first=first_scored(ctx, score))


@torch.inference_mode()
def scored_logits(model: torch.nn.Module, window: torch.Tensor, first: int) -> torch.Tensor:
    """Logits (float32, on the model's device) of positions first..ctx-2 of one window."""
    ctx = window.shape[-1]
    device = next(model.parameters()).device
    out = model(input_ids=window.view(1, ctx).to(device), use_cache=False, logits_to_keep=ctx - first)
    return out.logits[0, :-1].float()


# the scorer's calibration when a measurement does not say: every unit is scored on its own, so a few short rows
KLD_ROWS = 8
KLD_SEQ_LEN = 256


class PerturbedKLD:
    """The source model's log-probs on calibration rows, computed once; then, for any other set of weights, the mean
    KLD (source || the same architecture holding those weights) over the same tokens, `mixq eval`'s KLD. This is
    the end-to-end cost `plan --measure` gives each unit. Holds the whole model in memory (`base`: every tensor,
    float32): for models that fit."""

    def __init__(self, ckpt, calibration=None, *, rows: int, seq_len: int, seed: int, device: str | None) -> None:
        self.path = ckpt.path
        self.device = pick_device(device)
        self.ids = calibration_rows(load_tokenizer(ckpt.path), calibration, rows=rows, seq_len=seq_len,
                                    vocab_size=ckpt.shape(global_hf_name("embed"))[0], seed=seed)
        self.targets = self.ids.reshape(-1)
        self.base = {n: ckpt.get(n, dtype=torch.float32) for n in ckpt.names()}
        self.ref = log_probs(self._logits(self.base))

    def _logits(self, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        model = build_model(self.path, weights, self.device)
        with torch.no_grad():
            out = torch.cat([model(r.view(1, -1).to(self.device), use_cache=False).logits[0].float().cpu()
                             for r in self.ids])
        del model
        return out

    def kld(self, weights: dict[str, torch.Tensor]) -> float:
        """Mean KLD of the model holding `weights` against the source model."""
        return float(token_quantities(self.ref, self._logits(weights), self.targets)["kld"].mean())
