"""Typed options of `mixq eval`: one frozen dataclass, every value parsed and checked once when it is built.

`EvalOptions` holds every setting of an evaluation; the device is a torch.device and `devices` normalised device
names by the time it exists, `windows` a count or None (every window). Checks that need the reference or the
candidates (their formats, the --ref-logits file) run in `eval/api.evaluate`'s resolve step.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Union

import torch

from mixq.errors import InputError
from mixq.eval.llamacpp import CACHE_TYPES
from mixq.eval.reflogits import REF_DTYPES
from mixq.eval.streamed import STATE_DTYPES
from mixq.planning.option_fields import check_choice, check_int, flag_of, opt, set_field
from mixq.planning.sizes import parse_size_option
from mixq.quant.device import parse_device
from mixq.runtime.distributed import parse_devices

ENGINES = ("torch", "llamacpp", "exllamav3")
SCORES = ("half", "all")
DEFAULT_CTX = 512
DEFAULT_WINDOWS = 32  # `mixq eval`'s default: a bounded run (like llama-perplexity --chunks), not the whole text
SAVE_REF_ONE_DEVICE = "--save-ref writes every window from one process: give one device"
MIN_CTX = 4
PROFILE_HELP = ("Write where the run's time goes to FILE as JSON: seconds, bytes read and written, peak host and "
                "GPU memory, per stage and per layer; a per-stage table ends the run on stderr.")


def window_count(value: int | str | None) -> int | None:
    """--windows as given: a whole number >= 1, or None / "all" for every window."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "all"):
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise InputError(f"--windows {value!r}: expected a whole number or 'all'") from None
    if isinstance(value, float) and value != n:
        raise InputError(f"--windows {value!r}: expected a whole number or 'all'")
    if n < 1:
        raise InputError(f"--windows must be at least 1, not {n}")
    return n


@dataclass(frozen=True)
class EvalOptions:
    """Settings of `mixq eval` / `mixq.evaluate`: windows of `ctx` tokens (None: DEFAULT_CTX, or the `ref_logits`
    file's), the first `windows` of them (None or "all": every window), the engine and devices, and the files
    written (`json_out`, `markdown_out`, `save_ref`, replaced only with `overwrite`)."""

    ctx: int | None = opt(None, "--ctx", f"Window length in tokens [default: {DEFAULT_CTX}, or the --ref-logits "
                          "file's].", click_type="int")
    windows: int | str | None = opt(DEFAULT_WINDOWS, "--windows", "Score the first N windows, or all of them.",
                                    click_type="text", metavar="N|all", show_default=True)
    score: str = opt("half", "--score", "Score the second half of each window (llama-perplexity) or every "
                     "position.", choices=SCORES, show_default=True)
    save_ref: Union[str, Path, None] = opt(None, "--save-ref", "Write the reference log-probs to FILE for later "
                                           "--ref-logits runs.", click_type="path")
    ref_logits: Union[str, Path, None] = opt(None, "--ref-logits", "Reuse reference log-probs (and tokens) from a "
                                             "--save-ref FILE.", click_type="path")
    ref_dtype: str = opt("float32", "--ref-dtype", "Storage of --save-ref log-probs (uint16: quantized as "
                         "llama.cpp's KL base, half the size; docs/eval.md).", choices=tuple(REF_DTYPES),
                         show_default=True)
    engine: str = opt("torch", "--engine", "llamacpp: GGUF candidates take logits from llama.cpp itself; "
                      "exllamav3: EXL3 candidates from exllamav3's own forward (CUDA).", choices=ENGINES,
                      show_default=True)
    cache_type: str | None = opt(None, "--cache-type", "llama.cpp KV cache type of GGUF candidates under --engine "
                                 "llamacpp.  [default: f32]", choices=tuple(CACHE_TYPES))
    device: torch.device | None = opt(None, "--device", "torch device [default: cuda when present, else cpu].",
                                      click_type="text")
    devices: tuple[str, ...] = opt((), "--devices", "Deal the windows over several devices of one type (0,1 or "
                                   "cpu,cpu; or run under torchrun); the same numbers.", click_type="text")
    gpu_memory: int | str | None = opt(None, "--gpu-memory", "Memory budget of the device (e.g. 24GB, 80GiB; on a "
                                       "CPU device, the host working set): the hidden streams move to the host and "
                                       "the logits are scored in smaller pieces to fit it; a budget one layer and "
                                       "one window cannot meet is refused before any work [default: what the "
                                       "device has free].", click_type="text", metavar="SIZE")
    state_dtype: str = opt("float32", "--state-dtype", "Storage of the hidden states of all windows (bfloat16 "
                           "halves them; float32 gives a whole-model forward's numbers).",
                           choices=tuple(STATE_DTYPES), show_default=True)
    batch_windows: int = opt(1, None, "Windows per layer call (faster on a GPU; the last bits of float rounding "
                             "differ from a one-window forward).", cli=False)
    json_out: Union[str, Path, None] = opt(None, "--json", "Write the JSON report to OUT ('-' prints it).",
                                           click_type="path")
    markdown_out: Union[str, Path, None] = opt(None, "--markdown", "Write a markdown table to OUT.",
                                               click_type="path")
    overwrite: bool = opt(False, "--overwrite", "Replace existing --json / --markdown / --save-ref / "
                          "--save-generated / --profile files.", is_flag=True)
    profile: Union[str, Path, None] = opt(None, "--profile", PROFILE_HELP, click_type="path")
    prompts: Union[str, Path, None] = opt(None, "--prompts", "With --text generated: the text the prompts are cut "
                                          "from (held-out text the model was not trained on).", click_type="path")
    gen_tokens: int = opt(128, "--gen-tokens", "With --text generated: tokens of each continuation (every one "
                          "has this length; only these tokens are scored).", show_default=True)
    gen_prompt_tokens: int = opt(64, "--gen-prompt-tokens", "With --text generated: tokens of the prompts file "
                                 "per prompt (inside the chat template when the reference has one).",
                                 show_default=True)
    gen_temperature: float = opt(1.0, "--gen-temperature", "With --text generated: the temperature of the sampled "
                                 "half (odd-numbered continuations; even ones are greedy). 0: all greedy.",
                                 show_default=True)
    gen_seed: int = opt(0, "--gen-seed", "With --text generated: sampled continuation i draws with seed "
                        "GEN_SEED + i (recorded in the token file).", show_default=True)
    save_generated: Union[str, Path, None] = opt(None, "--save-generated", "With --text generated: write the "
                                                 "token file to FILE [default: beside --json as "
                                                 "<stem>.tokens.json]; --text FILE scores it again.",
                                                 click_type="path")
    mtp: bool = opt(False, "--mtp", "Also score each candidate's NextN (MTP) head: its draft of token t+2 (from its "
                    "own final hidden state at t and token t+1's embedding) against the reference's own argmax at "
                    "t+1, beside the reference's NextN head's agreement.", is_flag=True)
    progress: bool = opt(True, None, "Show the progress bar and the line that says what is scored.", cli=False)

    def __post_init__(self) -> None:
        cls = type(self)
        if self.ctx is not None:
            check_int(cls, "ctx", self.ctx, -2**63)  # a whole number; the size is said below
            if self.ctx < MIN_CTX:
                raise InputError(f"--ctx {self.ctx} is too small (need at least {MIN_CTX} tokens)")
        set_field(self, "windows", window_count(self.windows))
        check_choice(cls, "score", self.score, SCORES)
        check_choice(cls, "ref_dtype", self.ref_dtype, tuple(REF_DTYPES))
        check_choice(cls, "engine", self.engine, ENGINES)
        check_choice(cls, "state_dtype", self.state_dtype, tuple(STATE_DTYPES))
        check_int(cls, "batch_windows", self.batch_windows)
        if self.cache_type is not None:
            check_choice(cls, "cache_type", self.cache_type, tuple(CACHE_TYPES))
            if self.engine != "llamacpp":
                raise InputError(f"--cache-type {self.cache_type} applies to --engine llamacpp only; --engine "
                                 f"{self.engine} keeps no llama.cpp KV cache")
        if self.device is not None:
            set_field(self, "device", parse_device(self.device, flag_of(cls, "device")))
        set_field(self, "devices", parse_devices(self.devices or None))
        check_int(cls, "gen_tokens", self.gen_tokens)
        check_int(cls, "gen_prompt_tokens", self.gen_prompt_tokens)
        check_int(cls, "gen_seed", self.gen_seed, 0)
        if isinstance(self.gen_temperature, bool) or not isinstance(self.gen_temperature, (int, float)) \
                or not 0 <= self.gen_temperature < float("inf"):
            raise InputError(f"--gen-temperature {self.gen_temperature!r}: expected a number >= 0")
        set_field(self, "gen_temperature", float(self.gen_temperature))
        if self.gpu_memory is not None:
            set_field(self, "gpu_memory", parse_size_option(flag_of(cls, "gpu_memory"), self.gpu_memory))
        if self.ref_logits and self.save_ref:
            raise InputError("--save-ref and --ref-logits cannot be combined")
        if len(self.devices) > 1 and self.save_ref:
            raise InputError(SAVE_REF_ONE_DEVICE)
        if self.mtp and (self.ref_logits or len(self.devices) > 1):
            raise InputError("--mtp runs the reference's NextN head in one process: give no --ref-logits and one "
                             "device")
        if len(self.devices) > 1 and self.profile is not None:
            raise InputError("--profile records one process: give one device, not --devices")
