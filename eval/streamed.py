"""The reference and the candidates run layer by layer over every window at once; logits per window at the end.

Each model keeps only its hidden streams for all windows (float32 or bfloat16, on the GPU when they fit, else on
the host). Per decoder layer, each model's layer is dequantized (`runtime.dequant`), materialised in transformers'
glm5_next decoder-layer module (`runtime.layer_stream`), applied to all its windows and released, so peak memory
is one layer of weights plus the streams, whatever the depth. Windows run one at a time through a layer by
default: the same shapes as a whole-model forward of one window, hence the same numbers bit for bit (batching
windows changes float rounding in the last bits). At the end `head(model)` holds that model's final norm and
lm_head while `scored_logits` computes one window's logits at a time.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from tqdm import tqdm

from mixq.runtime import profile
from mixq.runtime.dequant import DequantSource
from mixq.runtime.profile import layer_label
from mixq.runtime.layer_stream import HEAD_NAME, NORM_NAME, DecoderStream
from mixq.errors import FormatError

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class StreamedModel:
    """One model of the run: its weights and its hidden streams over all windows."""

    name: str                      # what errors about this model name (its path)
    source: DequantSource
    hidden: torch.Tensor | None = None
    topk: torch.Tensor | None = None
    seconds: float = 0.0           # forward time (layers and head), decoding excluded
    role: str = "candidate"        # "reference" or "candidate": the profile's stage names
    _head: tuple[torch.Tensor, torch.Tensor] | None = None


def state_bytes(config: dict, windows: int, ctx: int, state_dtype: str = "float32") -> int:
    """Bytes of one model's hidden streams: windows · ctx · hc_mult · hidden."""
    t = config.get("text_config", config)
    return windows * ctx * int(t["hc_mult"]) * int(t["hidden_size"]) * STATE_DTYPES[state_dtype].itemsize


class StreamedModels:
    """Models of one architecture (config.json) run over the same windows (tokens: int64 (windows, ctx))."""

    def __init__(self, config: dict, tokens: torch.Tensor, *, device: torch.device, state_dtype: str = "float32",
                 state_device: torch.device | None = None, batch_windows: int = 1,
                 expert_group: int | None = None) -> None:
        self.stream = DecoderStream(config, device=device, dtype=torch.float32, batch_rows=batch_windows,
                                    expert_group=expert_group)
        self.tokens = tokens
        self.device = self.stream.device
        self.state_dtype = STATE_DTYPES[state_dtype]
        self.state_device = torch.device(state_device) if state_device is not None else torch.device("cpu")
        self.models: list[StreamedModel] = []

    def add(self, name: str, source: DequantSource, role: str = "candidate") -> StreamedModel:
        m = StreamedModel(name, source, role=role)
        self.models.append(m)
        return m

    def run(self, progress: bool = True) -> None:
        """Embed every model's windows, then every decoder layer: per model load, apply to all windows, release."""
        n = self.stream.num_layers
        for m in self.models:
            t0 = time.perf_counter()
            with profile.stage(f"{m.role}_forward", "embed"):
                m.hidden = self.stream.embed(self.tokens, m.source.get, out_device=self.state_device,
                                             out_dtype=self.state_dtype)
            m.seconds += time.perf_counter() - t0
        # a context: the bar's line ends before an error (a NaN weight met mid-run) is reported on its own line
        with tqdm(total=self.stream.num_layers * len(self.models), desc="eval layers", unit="layer",
                  disable=not progress) as bar:
            for i in range(self.stream.num_layers):
                for m in self.models:
                    with profile.stage(_load_stage(m), layer_label(i, n)):  # read and dequantize
                        weights = m.source.layer(i)
                        mod = self.stream.materialize(i, _fetcher(m.name, weights))
                        del weights
                    t0 = time.perf_counter()
                    with profile.stage(f"{m.role}_forward", layer_label(i, n)):
                        m.topk = self.stream.run_layer_inplace(mod, m.hidden, m.topk)
                    m.seconds += time.perf_counter() - t0
                    self.stream.release(i)
                    bar.update(1)

    @contextlib.contextmanager
    def head(self, m: StreamedModel) -> Iterator[None]:
        """Hold `m`'s final norm and lm_head (on the device) while its logits are computed."""
        with profile.stage(_load_stage(m), "head"):
            m._head = (m.source.get(NORM_NAME), m.source.get(HEAD_NAME).to(self.device))
        try:
            yield
        finally:
            m._head = None

    def scored_logits(self, m: StreamedModel, w: int, first: int) -> torch.Tensor:
        """float32 logits (ctx - 1 - first, vocab) of window w's scored positions, inside `head(m)`."""
        norm_w, lm_head = m._head  # type: ignore[misc]
        t0 = time.perf_counter()
        # as the whole model: final norm over the window, lm_head on the last ctx - first positions, drop the last
        with profile.stage(f"{m.role}_forward", "head"):
            h = self.stream.final_hidden(m.hidden[w:w + 1], norm_w)[0, first:]
            logits = F.linear(h, lm_head)[:-1].float()
        m.seconds += time.perf_counter() - t0
        return logits


def _load_stage(m: StreamedModel) -> str:
    """The profile's name of reading a model's layer: the reference's load, a candidate's decode (its weights
    dequantized)."""
    return "reference_load" if m.role == "reference" else "candidate_decode"


def _fetcher(name: str, weights: dict[str, torch.Tensor]):
    def fetch(n: str) -> torch.Tensor:
        t = weights.get(n)
        if t is None:
            raise FormatError(f"{name}: tensor {n} missing")
        return t

    return fetch
