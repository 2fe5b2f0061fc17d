"""`--profile FILE`: where a run's time, bytes and memory go, per layer and per named stage, as JSON.

A driver marks its real phase boundaries with `stage(name, layer)` (a context manager); `recording(path, ...)`
around a whole verb makes those marks count and writes the profile when the verb ends. Without a recording,
`stage` returns one shared no-op context: the marks cost a global look-up.

Per stage: wall seconds; bytes read and written, as the checkpoint reader and the writers report them through
`formats/io_counts.py` (bytes go to the innermost open stage of the calling thread, else to the main thread's
innermost one, so a reader thread's prefetch counts where it is used); the peak resident memory of this process
(VmHWM, reset through /proc/self/clear_refs at every stage boundary, the peak before each reset folded into every
open stage, so concurrent stages each get the peak of their own interval); and the peak GPU memory torch
allocated (`torch.cuda.max_memory_allocated`, reset the same way; only once CUDA is in use). Worker processes
(GGUF's CPU encoders) are not in it: the profile is this process's (under torchrun, rank 0's; `--devices`
with several devices is refused with `--profile`).

The JSON (`PROFILE_VERSION` 1):
    {"mixq_profile": 1, "verb", "argv", "format", "device",
     "layers": {"0": {"attention": "linear_attention", "mlp": "dense"}, ..., "nextn": {...}},
     "stages": [{"stage", "layer", "seconds", "bytes_read", "bytes_written", "peak_host_bytes", "peak_gpu_bytes"}],
     "total": {"seconds", "bytes_read", "bytes_written", "peak_host_bytes", "peak_gpu_bytes"}}
`layer` is a decoder layer's index as text, "embed", "head", "nextn" (or "nextn.J" beyond the first), "vision",
or None for a whole-run stage. `total` is the whole recording, not a sum of the stages.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch

from mixq.formats import io_counts
from mixq.formats.atomic import write_json
from mixq.formats.glm5next import normalise_layer_type
from mixq.runtime.distributed import process_rank

PROFILE_VERSION = 1
STAGE_KEYS = ("stage", "layer", "seconds", "bytes_read", "bytes_written", "peak_host_bytes", "peak_gpu_bytes")
TOTAL_KEYS = STAGE_KEYS[2:]


# ------------------------------------------------------------------------------------------- layer kinds
def layer_label(i: int, num_hidden_layers: int) -> str:
    """A layer's name in a profile: "0".."N-1" for decoder layers, "nextn" (then "nextn.1", ...) after them."""
    if i < num_hidden_layers:
        return str(i)
    j = i - num_hidden_layers
    return "nextn" if j == 0 else f"nextn.{j}"


def walk_label(layer: int | None, num_hidden_layers: int) -> str:
    """The profile's name of a calibration walk's stage: its layer's `layer_label`, "head" for the head stage."""
    return "head" if layer is None else layer_label(layer, num_hidden_layers)


def layer_kinds(config: Mapping) -> dict[str, dict[str, str]]:
    """Every layer's kind from a glm5_next config (its text_config or the whole file): attention
    ("linear_attention" | "deepseek_sparse_attention") and mlp ("dense" | "moe"), keyed by `layer_label`.
    A layer is dense where `mlp_layer_types` says "dense", else (no such list) below `first_k_dense_replace`;
    NextN blocks are DSA + MoE (formats/checkpoint.nextn_shapes)."""
    t = config.get("text_config", config)
    n = int(t["num_hidden_layers"])
    lt = t.get("layer_types") or ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention"
                                  for i in range(n)]  # transformers' default pattern, as the checkpoint reader
    mlt = t.get("mlp_layer_types")
    dense_k = int(t.get("first_k_dense_replace") or 0)
    out = {}
    for i in range(n):
        dense = mlt[i] == "dense" if mlt else i < dense_k
        out[layer_label(i, n)] = {"attention": normalise_layer_type(lt[i]), "mlp": "dense" if dense else "moe"}
    for j in range(int(t.get("num_nextn_predict_layers") or 0)):
        out[layer_label(n + j, n)] = {"attention": "deepseek_sparse_attention", "mlp": "moe"}
    return out


# ------------------------------------------------------------------------------------------- memory peaks
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def _host_peak() -> int:
    """VmHWM of this process in bytes (0 where /proc is not there)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _Peaks:
    """Host and GPU peaks since the last reset, folded into every open record before each reset."""

    def __init__(self) -> None:
        self.can_reset_host = True

    def read_and_reset(self, device: torch.device | None) -> tuple[int, int]:
        host = _host_peak()
        if self.can_reset_host:
            try:
                _CLEAR_REFS.write_text("5")  # 5: reset the peak RSS to the current RSS (nothing else)
            except OSError:  # not Linux, or not allowed: the peak stays the process's peak so far
                self.can_reset_host = False
        gpu = 0
        if device is not None and device.type == "cuda" and torch.cuda.is_initialized():
            gpu = int(torch.cuda.max_memory_allocated(device))
            torch.cuda.reset_peak_memory_stats(device)
        return host, gpu


# ------------------------------------------------------------------------------------------- the recorder
class _Record:
    """One stage as it runs; `set_layer` names its layer once it is known (a calibration walk's next layer)."""

    __slots__ = ("stage", "layer", "t0", "seconds", "bytes_read", "bytes_written", "peak_host_bytes",
                 "peak_gpu_bytes", "keep")

    def __init__(self, stage: str | None, layer: str | None) -> None:
        self.stage, self.layer = stage, layer
        self.t0 = time.perf_counter()
        self.seconds = 0.0
        self.bytes_read = self.bytes_written = self.peak_host_bytes = self.peak_gpu_bytes = 0
        self.keep = True

    def set_layer(self, layer) -> None:
        self.layer = None if layer is None else str(layer)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in STAGE_KEYS}


class _NoRecord:
    """The context `stage` gives when nothing is recorded."""

    def __enter__(self) -> "_NoRecord":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def set_layer(self, layer) -> None:
        return None


_NO_RECORD = _NoRecord()


class Profile:
    """The stages of one recorded run (see the module docstring); `to_dict()` is the JSON written."""

    def __init__(self, verb: str, fmt: str | None = None, argv: list[str] | None = None) -> None:
        self.verb, self.format = verb, fmt
        self.argv = list(sys.argv if argv is None else argv)
        self.device: torch.device | None = None
        self.device_name = "cpu"
        self.layers: dict[str, dict[str, str]] = {}
        self.stages: list[_Record] = []
        self.total = _Record(None, None)
        self._open: list[_Record] = []  # every open record, all threads, oldest first
        self._local = threading.local()
        self._main_stack: list[_Record] = []
        self._lock = threading.Lock()
        self._peaks = _Peaks()
        self._fold()

    # -- what the drivers tell it
    def set_device(self, device) -> None:
        """The device the run computes on ("cuda:0 NVIDIA H200" in the JSON); peaks of that GPU are recorded."""
        d = torch.device(device) if device is not None else torch.device("cpu")
        if d.type == "cuda" and d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
        self.device = d
        self.device_name = f"{d} {torch.cuda.get_device_name(d)}" if d.type == "cuda" else str(d)

    def set_layers(self, config: Mapping) -> None:
        """The layer kinds of the model (`layer_kinds`), so a projection can price each kind."""
        self.layers = layer_kinds(config)

    # -- the hooks
    def _fold(self) -> None:
        """The peaks since the last boundary into every open record and the total, then reset them."""
        host, gpu = self._peaks.read_and_reset(self.device)
        for r in (*self._open, self.total):
            r.peak_host_bytes = max(r.peak_host_bytes, host)
            r.peak_gpu_bytes = max(r.peak_gpu_bytes, gpu)

    def _count(self, kind: str, n: int) -> None:
        with self._lock:
            stack = getattr(self._local, "stack", None)
            target = stack[-1] if stack else self._ambient()
            for r in (target, self.total):
                if r is None:
                    continue
                if kind == "read":
                    r.bytes_read += n
                else:
                    r.bytes_written += n

    def _ambient(self) -> _Record | None:
        """Where a thread with no stage of its own counts: the main thread's innermost stage, else the last
        opened."""
        main = self._main_stack
        return main[-1] if main else (self._open[-1] if self._open else None)

    @contextlib.contextmanager
    def stage(self, name: str, layer=None) -> Iterator[_Record]:
        rec = _Record(name, None if layer is None else str(layer))
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
            if threading.current_thread() is threading.main_thread():
                self._main_stack = stack
        with self._lock:
            self._fold()
            self._open.append(rec)
            stack.append(rec)
        try:
            yield rec
        finally:
            with self._lock:
                self._fold()
                rec.seconds = time.perf_counter() - rec.t0
                stack.remove(rec)
                self._open.remove(rec)
                if rec.keep:
                    self.stages.append(rec)

    def finish(self) -> None:
        with self._lock:
            self._fold()
            self.total.seconds = time.perf_counter() - self.total.t0

    def to_dict(self) -> dict:
        """The profile as the JSON schema of the module docstring."""
        return {"mixq_profile": PROFILE_VERSION, "verb": self.verb, "argv": self.argv, "format": self.format,
                "device": self.device_name, "layers": self.layers,
                "stages": [r.as_dict() for r in self.stages],
                "total": {k: getattr(self.total, k) for k in TOTAL_KEYS}}


_ACTIVE: Profile | None = None


def active() -> Profile | None:
    """The profile being recorded, or None."""
    return _ACTIVE


def stage(name: str, layer=None):
    """A context manager timing stage `name` of `layer` (an index as text, "embed", "head", "nextn", "vision",
    or None for a whole-run stage) into the profile being recorded; a shared no-op without one. It yields a
    record whose `set_layer` names the layer once known."""
    p = _ACTIVE
    if p is None:
        return _NO_RECORD
    return p.stage(name, layer)


def timed(name: str, items: Iterable, label) -> Iterator:
    """`items` with each `next()` recorded as stage `name` of the layer `label(item)` (a calibration walk, whose
    forward of a layer runs when the walk is asked for it); the last, empty `next()` is not recorded."""
    it = iter(items)
    while True:
        with stage(name) as rec:
            try:
                item = next(it)
            except StopIteration:
                if isinstance(rec, _Record):
                    rec.keep = False
                return
            rec.set_layer(label(item))
        yield item


def peaks() -> tuple[int, int] | None:
    """(peak host bytes, peak GPU bytes) of the recording so far, or None when nothing is recorded. The recorder
    resets the kernel's and torch's peak counters at every stage boundary, so a report that reads peaks while a
    profile is recorded reads them here."""
    p = _ACTIVE
    if p is None:
        return None
    with p._lock:
        p._fold()
    return p.total.peak_host_bytes, p.total.peak_gpu_bytes


class Switch:
    """One stage open at a time, moved on to a new record whenever the (stage, layer) asked for changes: for a
    loop whose items belong to layers in turn (the GGUF writer's tensors). A context: the last stage ends with
    it."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.ctx = None

    def __call__(self, name: str, layer=None) -> None:
        if (name, layer) == self.key:
            return
        self.close()
        self.key, self.ctx = (name, layer), stage(name, layer)
        self.ctx.__enter__()

    def close(self) -> None:
        if self.ctx is not None:
            ctx, self.ctx, self.key = self.ctx, None, None
            ctx.__exit__(None, None, None)

    def __enter__(self) -> "Switch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def note_device(device) -> None:
    """Tell the profile being recorded (if any) the device the run computes on."""
    if _ACTIVE is not None:
        _ACTIVE.set_device(device)


def note_layers(config: Mapping) -> None:
    """Tell the profile being recorded (if any) the model's layer kinds."""
    if _ACTIVE is not None:
        _ACTIVE.set_layers(config)


@contextlib.contextmanager
def recording(path, verb: str, fmt: str | None = None, *, table: bool = False) -> Iterator[Profile | None]:
    """Record the run inside the block into a profile written to `path` as JSON when the block ends without an
    error (None: nothing is recorded); `table`: then also print the per-stage table on stderr."""
    global _ACTIVE
    if path is None:
        yield None
        return
    if _ACTIVE is not None:  # a verb run by another (a family's members): the outer recording holds the stages
        yield _ACTIVE
        return
    p = Profile(verb, fmt)
    _ACTIVE = p
    old = io_counts.set_sink(p._count)
    try:
        yield p
        p.finish()
    finally:
        _ACTIVE = None
        io_counts.set_sink(old)
    if process_rank() != 0:  # under torchrun every rank records; rank 0 alone writes
        return
    write_json(path, p.to_dict())
    if table:
        print(format_table(p.to_dict()), file=sys.stderr)


# ------------------------------------------------------------------------------------------- reading back
def check_profile(d: Mapping) -> dict:
    """`d` when it is a profile of this version with every key of the schema, else ValueError naming what is
    wrong (the benches read profiles through this)."""
    if not isinstance(d, Mapping) or d.get("mixq_profile") != PROFILE_VERSION:
        raise ValueError(f"not a mixq profile of version {PROFILE_VERSION}")
    for k in ("verb", "argv", "format", "device", "layers", "stages", "total"):
        if k not in d:
            raise ValueError(f"profile: no {k!r}")
    for i, s in enumerate(d["stages"]):
        missing = [k for k in STAGE_KEYS if k not in s]
        if missing:
            raise ValueError(f"profile stage {i}: no {missing[0]!r}")
    missing = [k for k in TOTAL_KEYS if k not in d["total"]]
    if missing:
        raise ValueError(f"profile total: no {missing[0]!r}")
    return dict(d)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def format_table(d: Mapping) -> str:
    """The profile summed per stage name, in first-seen order: count, seconds, MiB read / written, peak host /
    GPU MiB; then the whole run."""
    rows: dict[str, list] = {}
    for s in d["stages"]:
        r = rows.setdefault(s["stage"], [0, 0.0, 0, 0, 0, 0])
        r[0] += 1
        r[1] += s["seconds"]
        r[2] += s["bytes_read"]
        r[3] += s["bytes_written"]
        r[4] = max(r[4], s["peak_host_bytes"])
        r[5] = max(r[5], s["peak_gpu_bytes"])
    t = d["total"]
    head = f"{'stage':<20}{'n':>5}{'seconds':>10}{'read MiB':>11}{'written MiB':>13}{'host MiB':>10}{'GPU MiB':>9}"
    lines = [f"profile ({d['verb']}, {d['device']}):", head]
    for name, (n, sec, rd, wr, host, gpu) in rows.items():
        lines.append(f"{name:<20}{n:>5}{sec:>10.2f}{_mib(rd):>11}{_mib(wr):>13}{_mib(host):>10}{_mib(gpu):>9}")
    lines.append(f"{'total':<20}{'':>5}{t['seconds']:>10.2f}{_mib(t['bytes_read']):>11}"
                 f"{_mib(t['bytes_written']):>13}{_mib(t['peak_host_bytes']):>10}{_mib(t['peak_gpu_bytes']):>9}")
    return "\n".join(lines)
