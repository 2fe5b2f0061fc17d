"""`--rounding hessian` for GGUF: encode the tensors that have a calibration Hessian with Hessian-aware rounding.

`--rounding exact` (the default) leaves every tensor to ggml's own encoder, so files are byte-identical to
llama-quantize's. `--rounding hessian` keeps every tensor's ggml type (so the bytes count is the same and llama.cpp
loads the file unchanged) but picks the codes inside each block to minimise the layer-output error
tr(ΔW·H·ΔWᵀ) (quant/ggml/rounding/hessian.py), with H from a calibration forward this module runs itself
(measurement/hessians.py: layer by layer, routing-weighted per routed expert).

`encode_hessian_rounded(...)` walks the calibration once and encodes every covered tensor as its layer is reached,
spilling the encoded blocks to .npy files in a work directory (the file is written later in GGUF order, and the
encoded model is as large as the output, so it is not kept in memory). Covered: 2-D Linears and stacked routed
experts whose input the forward forms, and token_embd (rows weighted by what the first layer's Linears make of
their error: gguf_hessians.embedding_hessian), in a type `quant.ggml.rounding.hessian` supports. The rest (the split
attn_k_b/attn_v_b, the NextN block, F16/BF16/F32 tensors, types without a Hessian path) keep ggml's encoder.
With `tune_iters` > 0 (the default), each stage's Hessian-rounded codes are then tuned together for the decoder
layer's output on the quantized model's streams (conversion/gguf/tuning.py), and the tuned blocks replace the
spilled ones.
"""
from __future__ import annotations

import math
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from mixq.measurement.encode_cache import EncodeCache, array_sha256
from mixq.measurement.hessians import DAMP, REFINE_PASSES, embedding_hessian, layer_hessians, token_frequency
from mixq.conversion.gguf.tuning import BYTES_PER_TUNED_WEIGHT, LayerTuner
from mixq.conversion.options import DEFAULT_TUNE_ITERS
from mixq.formats.partials import make_partial_dir
from mixq.quant.ggml.rounding import hessian as kh
from mixq.quant.device import device_kind, pick_device
from mixq.runtime.calibration import CALIBRATION_ROWS, CALIBRATION_SEQ_LEN, calibration_rows, load_tokenizer
from mixq.runtime import profile
from mixq.runtime.memory_budget import MemoryBudget, rounding_slice, tuning_weights
from mixq.runtime.overlap import ahead

# where block-output tuning follows, the 2-bit types take fewer passes. On k256, with the other types at three:
# one pass scores as three everywhere (llama.cpp's KLD x0.566 against x0.582 at Q2_K, IQ2_S experts x0.677 against
# x0.678, IQ2_XS experts x0.663 against x0.655, each within about a standard error), and each pass left out
# shortens a stack's rounding; IQ2_S experts with no pass score x0.655 (IQ2_XS experts x0.682: they keep one). At
# 4 bits one pass loses (Q4_K_M x0.760 against x0.726), as on mini's 32-weight fallbacks (docs/results.md §1)
TUNED_REFINE_PASSES = {"Q2_K": 1, "IQ2_S": 0, "IQ2_XS": 1}
# routed experts rounded per call: their float64 Hessians within SLICE_HESSIAN_BYTES and their weights within
# SLICE_WEIGHTS, per device type (GLM-5.3's 288 x 4096^2 Hessians are 39 GB): at 2048 x 4096, 4 per call on a CPU
# and 32 on a GPU (measured as fast per weight as 8 there: bench/speed/hessian_rounding_speed.py)
SLICE_HESSIAN_BYTES = {"cpu": 1 << 30, "accelerator": 1 << 32}
SLICE_WEIGHTS = {"cpu": None, "accelerator": 1 << 28}


def covered(spec, qtype: str) -> bool:
    """Whether a GGUF tensor gets Hessian rounding: a calibrated Linear (or expert stack), or the token embedding
    (with the metric of `gguf_hessians.embedding_hessian`), in a supported type."""
    return (qtype in kh.SUPPORTED and len(spec.shape) >= 2 and not spec.mtp
            and spec.transform in ("none", "stack"))


def passes_for(qtype: str, given: int | None = None, tuned: bool = True) -> int:
    """The rounding's descent passes after its feedback walk for `qtype`: `given` (--refine-passes) when set, else
    ``TUNED_REFINE_PASSES``'s where block-output tuning follows (`tuned`), else ``REFINE_PASSES``."""
    if given is not None:
        return int(given)
    return TUNED_REFINE_PASSES.get(qtype, REFINE_PASSES) if tuned else REFINE_PASSES


def expert_slice(rows: int, n: int, dev: torch.device) -> int:
    """Routed experts (rows x n each) rounded per call on `dev` (SLICE_HESSIAN_BYTES, SLICE_WEIGHTS); a memory
    budget may take fewer (runtime/memory_budget.rounding_slice: each expert rounds the same either way)."""
    kind = device_kind(dev)
    per = SLICE_HESSIAN_BYTES[kind] // (8 * n * n)
    if SLICE_WEIGHTS[kind] is not None:
        per = min(per, SLICE_WEIGHTS[kind] // (rows * n))
    return max(1, per)


def _encode_spec(spec, qtype: str, stage, fetch, imatrix: np.ndarray | None, out: Path, dev,
                 refine: int = REFINE_PASSES, budget: MemoryBudget | None = None) -> bool:
    """Encode one covered tensor of this stage into `out` (.npy); False when the stage has no Hessian for it.
    `fetch(name)`: the source weight as stored (widened where it is rounded). A stack's expert slices are read one
    ahead, on a worker thread, while the device rounds the slice before."""
    if spec.transform == "stack":
        E, n = len(spec.hf_names), spec.shape[-1]
        step = rounding_slice(budget, spec.shape[-2], n, min(E, expert_slice(spec.shape[-2], n, dev)))
        slices = [(e0, min(E, e0 + step)) for e0 in range(0, E, step)]

        def read(r: tuple[int, int]) -> torch.Tensor:
            return torch.stack([fetch(spec.hf_names[e]) for e in range(*r)])
        arr = None
        for (e0, e1), w in ahead(slices, read):
            h = stage.experts(spec, e0, e1)
            if h is None:
                return False
            im = None if imatrix is None else imatrix.reshape(E, n)[e0:e1]
            b = kh.quantize_hessian(w, h, qtype, im, damp=DAMP, refine=refine, device=dev)
            if arr is None:
                arr = np.lib.format.open_memmap(out, mode="w+", dtype=np.uint8, shape=(E,) + b.shape[1:])
            arr[e0:e1] = b
        arr.flush()
        del arr
        return True
    h = stage.get(spec)
    if h is None:
        return False
    w = fetch(spec.hf_names[0])
    np.save(out, kh.quantize_hessian(w, h, qtype, imatrix, damp=DAMP, refine=refine, device=dev))
    return True


def encode_hessian_rounded(ckpt, specs: Sequence, types: Sequence[str], work_dir: str | Path, *,
                           imatrix: Mapping[str, np.ndarray] | None = None, calibration=None,
                           rows: int = CALIBRATION_ROWS, seq_len: int = CALIBRATION_SEQ_LEN, tune_iters: int = DEFAULT_TUNE_ITERS,
                           tune_group_iters: int | None = None, refine_passes: int | None = None,
                           device: str | None = None, progress: bool = True, cache: EncodeCache | None = None,
                           load: Callable[[str], tuple] | None = None,
                           budget: MemoryBudget | None = None, expert_group: int | None = None) -> dict[str, Path]:
    """Hessian-rounded ggml blocks of every covered tensor of `specs` (with their planned `types`), as .npy files
    in `work_dir`: {GGUF name: path}; with tuning, also the blocks ggml's encoder made for the tuner (the tensors
    Hessian rounding leaves to it, which the tuner needs as the file holds them), so that the writer does not
    encode them again. `imatrix` (GGUF name -> importance) feeds ggml's scale search, as in the
    exact path; without it the Hessian's diagonal does. Tensors whose input the forward never forms are left out.
    `tune_iters` > 0: each stage's codes are then tuned for the layer's output on the quantized model's streams
    (conversion/gguf/tuning.py), with that many descent steps per stage (`tune_group_iters` per group of routed
    experts tuned apart, None: the tuner's default). `refine_passes`: descent passes over the codes and scales
    after the feedback walk (None: per type, :func:`passes_for`).

    `cache` (a family's, with `load(name) -> (GGUF tensor, imatrix)` for its keys): the codes before tuning depend
    only on the source weights, the imatrix and the source model's calibration forward, not on the member, so a
    (tensor, type) another member already rounded is served from the cache (the same bytes); tuning, which runs
    on this member's own quantized streams, is always this member's. `budget` (--gpu-memory): the routed experts
    per rounding call and the weights per tuning stage within it (runtime/memory_budget.py); `expert_group` the
    routed experts per group of the calibration forward (None: the whole layer; the same Hessians either way)."""
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    todo = [(s, t) for s, t in zip(specs, types) if covered(s, t)]
    if not todo:
        return {}
    dev = pick_device(device)
    passes = {t: passes_for(t, refine_passes, tune_iters > 0) for _, t in todo}
    ids = calibration_rows(load_tokenizer(ckpt.path), calibration, rows=rows, seq_len=seq_len,
                           vocab_size=int(ckpt.text_config["vocab_size"]))
    by_layer: dict[int | None, list] = {}
    embed = []
    for s, t in todo:
        (embed if s.role == "embed" else by_layer.setdefault(s.layer, [])).append((s, t))
    fetch = lambda n: ckpt.get(n, dtype=torch.float32)  # noqa: E731
    stored = lambda n: ckpt.get(n, dtype=None)  # noqa: E731
    planned = {s.name: (s, t) for s, t in zip(specs, types)}
    done: dict[str, Path] = {}
    tags = {t: rounding_tag(ids, dev, n) for t, n in passes.items()} if cache is not None else {}
    rounded = _CachedRounding(cache, load, str(ckpt.path), tags)
    tuner = None
    if tune_iters > 0:
        max_weights = None  # without a given budget: the device's free memory, as tuning_budget counts it
        if budget is not None and budget.given:
            max_weights = tuning_weights(budget, BYTES_PER_TUNED_WEIGHT)
        tuner = LayerTuner(ckpt, ids, specs, types, imatrix=imatrix, iters=tune_iters, group_iters=tune_group_iters,
                           device=dev, max_weights=max_weights)
    bar = tqdm(total=sum(math.prod(s.shape) for s, _ in todo), desc="hessian rounding", unit="w", unit_scale=True,
               disable=not progress)
    for stage in layer_hessians(ckpt, ids, device=dev, expert_group=expert_group):
        before = set(done)
        where = profile.walk_label(stage.layer, ckpt.num_hidden_layers)
        with profile.stage("round", where):  # Hessian rounding of the stage's tensors
            for s, t in embed:  # the first stage: its Linears read the embedding
                path = work / f"{len(done):05d}.npy"
                if rounded.encode(s, t, path,
                                  lambda: _encode_embedding(s, t, stage, ckpt, ids, fetch, path, dev, passes[t])):
                    done[s.name] = path
                bar.update(math.prod(s.shape))
            embed = []
            for s, t in by_layer.get(stage.layer, []):
                path = work / f"{len(done):05d}.npy"
                im = None if imatrix is None else imatrix.get(s.name)
                im = None if im is None else np.asarray(im, np.float32)
                if rounded.encode(s, t, path,
                                  lambda: _encode_spec(s, t, stage, stored, im, path, dev, passes[t], budget)):
                    done[s.name] = path
                bar.update(math.prod(s.shape))
        if tuner is not None:
            # the calibration's own copy of the layer: not read in a second time
            with profile.stage("tune", where), stage.lent_layer() as source:
                _tune_stage(tuner, stage.layer, {n: done[n] for n in done if n not in before}, source)
            for name, blocks in tuner.take_encoded().items():  # ggml's bytes, encoded once for tuning and the file
                path = work / f"{len(done):05d}.npy"
                np.save(path, blocks, allow_pickle=False)
                done[name] = path
                rounded.keep_exact(*planned[name], blocks)
            if progress and tuner.reports and tuner.reports[-1].layer == stage.layer:
                bar.write(tuner.reports[-1].describe())
    bar.close()
    return done


def rounding_tag(ids: torch.Tensor, dev: torch.device, refine: int = REFINE_PASSES) -> str:
    """What Hessian-rounded codes depend on besides the tensor, its type and its imatrix (an encode-cache key's
    "rounding"): the calibration tokens, the damping, the refinement passes, the expert slicing and the device
    type (the float arithmetic differs between devices)."""
    kind = device_kind(dev)
    slicing = f"{SLICE_HESSIAN_BYTES[kind]}" + (f"/{SLICE_WEIGHTS[kind]}" if SLICE_WEIGHTS[kind] else "")
    return (f"hessian damp {DAMP} refine {refine} slice {slicing} device {dev.type} "
            f"calibration {array_sha256(ids.cpu().numpy())}")


class _CachedRounding:
    """The family's encode cache for Hessian-rounded codes before tuning (a no-op without a cache)."""

    def __init__(self, cache: EncodeCache | None, load, source: str, tags: Mapping[str, str]) -> None:
        self.cache, self.load, self.source, self.tags = cache, load, source, tags  # tags: type -> rounding_tag

    def encode(self, spec, qtype: str, path: Path, encode: Callable[[], bool]) -> bool:
        """The codes of (spec, qtype) into `path`: copied from the cache when another member rounded them, else
        `encode()` (False: this stage has no Hessian for it) and kept in the cache."""
        key = None if self.cache is None or self.load is None else self.cache.key(
            self.source, spec.name, qtype, tuple(spec.shape), lambda: self.load(spec.name), rounding=self.tags[qtype])
        if key is not None and self.cache.has(key):
            np.save(path, self.cache.get(key), allow_pickle=False)
            return True
        if not encode():
            return False
        if key is not None:
            self.cache.put(key, np.load(path, mmap_mode="r"))
        return True

    def keep_exact(self, spec, qtype: str, blocks: np.ndarray) -> None:
        """Keep in the cache, under the exact path's key, blocks that ggml's encoder made for (spec, qtype)."""
        if self.cache is not None and self.load is not None:
            key = self.cache.key(self.source, spec.name, qtype, tuple(spec.shape), lambda: self.load(spec.name))
            self.cache.put(key, blocks)


def _encode_embedding(spec, qtype: str, stage, ckpt, ids: torch.Tensor, fetch, out: Path, dev,
                      refine: int = REFINE_PASSES) -> bool:
    """Encode token_embd with the metric of `gguf_hessians.embedding_hessian` into `out`; False without one."""
    w = fetch(spec.hf_names[0])
    h = embedding_hessian(stage, ckpt, w, token_frequency(ids, w.shape[0]))
    if h is None:
        return False
    np.save(out, kh.quantize_hessian(w, h, qtype, None, damp=DAMP, refine=refine, device=dev))
    return True


def _tune_stage(tuner, layer: int | None, paths: Mapping[str, Path], source=None) -> None:
    """Tune one stage's encoded tensors (their .npy files in `paths`) and write the tuned blocks back; `source`: the
    decoder layer with its source weights, when the caller has it (the tuner may overwrite it)."""
    encoded = {n: np.load(p) for n, p in paths.items()}
    tuned = tuner.layer(layer, encoded, source) if layer is not None else tuner.head(encoded)
    for n, b in tuned.items():
        np.save(paths[n], b)


@contextmanager
def hessian_rounded(ckpt, specs: Sequence, types: Sequence[str], out: str | Path, *,
                    imatrix: Mapping[str, np.ndarray] | None = None, calibration=None,
                    rows: int = CALIBRATION_ROWS, seq_len: int = CALIBRATION_SEQ_LEN, tune_iters: int = DEFAULT_TUNE_ITERS, tune_group_iters: int | None = None,
                    refine_passes: int | None = None, device: str | None = None, progress: bool = True,
                    cache: EncodeCache | None = None, load: Callable[[str], tuple] | None = None,
                    budget: MemoryBudget | None = None,
                    expert_group: int | None = None) -> Iterator[dict[str, Callable[[], np.ndarray]]]:
    """For the GGUF writer: {GGUF name: loader of its Hessian-rounded blocks} of every covered tensor.

    The encoded tensors are spilled into a `.NAME.partial-hessian-*` directory next to `out` (the converter's
    stale-partials cleanup knows the pattern), removed when the block exits, whatever happens."""
    out = Path(out)
    work = make_partial_dir(out, "hessian")
    try:
        paths = encode_hessian_rounded(ckpt, specs, types, work, imatrix=imatrix, calibration=calibration,
                                       rows=rows, seq_len=seq_len, tune_iters=tune_iters,
                                       tune_group_iters=tune_group_iters, refine_passes=refine_passes,
                                       device=device, progress=progress, cache=cache, load=load, budget=budget,
                                       expert_group=expert_group)
        yield {n: (lambda p=p: np.load(p)) for n, p in paths.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
