"""Encode GGUF tensors on N cores (`mixq convert --format gguf --threads N`), bytes and order as in one process.

- `encode(x, qtype, imatrix)`: one array -> ggml data (mixq.quant.ggml.encoders, gguf-py for the types it lacks).
- `TensorEncoder(items, load, threads)`: `get(name)` returns tensor `name`'s encoded data; the writer asks for the
  tensors in file order. With threads > 1 each tensor is cut into tasks of about TASK_WEIGHTS weights -- row blocks
  of a 2-D tensor, whole experts or row blocks of one expert of a stacked 3-D tensor -- and the tasks go to a pool
  of worker processes. Rows are independent in every ggml type and the imatrix is per column (per expert for
  stacked tensors), so a task gets the same importance vector its rows get in one process: the bytes are equal.
- Look-ahead: while the writer waits for tensor i, the tasks of the following tensors are handed out too, so
  workers never idle on small tensors. At most 2*N tasks are in the pool or finished but not yet assembled, and
  only one source tensor is being cut at a time (tasks carry copies of their rows), so peak memory stays near the
  one-process converter's: one float32 source tensor plus one encoded tensor plus 2*N tasks.
- Workers are spawned (no fork of a process that holds torch / tqdm threads) with one BLAS/OpenMP thread each, at
  `start()` so that they import numpy, gguf and mixq.quant and build the i-quant code tables while the caller
  still reads metadata. They start without the caller's main module (runtime/child_process), so a calling script
  needs no `if __name__ == "__main__":` and may come from standard input. threads=1 runs everything in-process,
  as the converter always did.
- Lifetime: workers ignore the signals a terminal sends to the whole group (Ctrl-C, SIGTERM, SIGHUP; the parent
  stops the pool, keeping the first error), and die with their parent even when it is killed outright (Linux's
  parent-death signal, and a watch of the parent pid elsewhere): no encoder outlives its conversion.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from typing import Callable, Iterator, Sequence

import gguf
import numpy as np

from mixq.runtime.child_process import die_with_parent, without_callers_main
from mixq.errors import InputError, MixqError
from mixq.formats.gguf_layout import FLOAT_TYPES
from mixq.planning.gguf_mix import ggml_type
from mixq.quant.ggml import encoders

# weights per task: large enough that pickling a task (4 bytes/weight in, <1 back) is small beside its encode time,
# small enough that the last tasks of a conversion end together (the lattice i-quants encode an order of magnitude
# slower than the K-quants, so they get smaller tasks) and 2*N tasks stay a few MB each
TASK_WEIGHTS = 1 << 20
TASK_WEIGHTS_IQ = 1 << 18
# after an error, how long the tasks a worker already holds may take before it is killed (each is about a second)
ABORT_GRACE_S = 120.0
# signals a terminal or a supervisor sends to the whole process group; the parent handles them, workers ignore them
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))
# thread pools the workers' numpy / BLAS / OpenMP would otherwise size to every core, N times over
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS",
              "VECLIB_MAXIMUM_THREADS", "BLIS_NUM_THREADS")


def encode(x: np.ndarray, qtype: str, imatrix: np.ndarray | None = None, device: str | None = None,
           chunk: int | None = None) -> np.ndarray:
    """Encode a float32 array (..., n) as ggml `qtype`: float arrays for F32/F16, raw block bytes otherwise.

    `imatrix` is (n,) or, for stacked 3-D tensors, (E, n): one importance vector per expert/slice. `device`
    (e.g. "cuda"): the quantized types run on mixq's torch encoders there (same bytes); None or "cpu": numpy.
    `chunk`: weights per device call there (None: the device's default; runtime/memory_budget.encode_chunk)."""
    q = qtype.upper()
    x = np.ascontiguousarray(x, dtype=np.float32)
    if q == "F32":
        return x
    if q == "F16":
        return x.astype(np.float16)
    if q in ("BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1") and imatrix is None:
        return gguf.quants.quantize(x, ggml_type(q))
    n = x.shape[-1]
    # one (rows, n) matrix per expert / slice of a 3-D tensor
    mats = x if x.ndim == 3 else x.reshape(1, -1, n)
    imx = None
    if imatrix is not None:
        imx = np.asarray(imatrix, dtype=np.float32).reshape(-1, n)
        if imx.shape[0] not in (1, mats.shape[0]):
            raise InputError(f"imatrix has {imx.shape[0]} vectors for {mats.shape[0]} matrices")
    if device is not None and str(device) != "cpu" and q in encoders.SUPPORTED:
        im = None if imx is None else np.broadcast_to(imx, (mats.shape[0], n))
        res = encoders.quantize_stacked(mats, q, im, device=device, chunk=chunk)  # groups of experts per device call
        return res.reshape(x.shape[:-1] + (res.shape[-1],))
    out = []
    for e in range(mats.shape[0]):
        w = None if imx is None else imx[e if imx.shape[0] > 1 else 0]
        rows = mats[e]
        if q in encoders.SUPPORTED:
            # errors (non-finite weights, bad widths) propagate: never hide them behind another encoder
            out.append(np.asarray(encoders.quantize(rows, q, w), dtype=np.uint8).reshape(rows.shape[0], -1))
            continue
        if w is not None and q in ("Q8_0", "BF16"):  # these ignore the imatrix in ggml too
            w = None
        if w is not None or q not in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16"):
            raise InputError(f"no encoder for {q}{' with imatrix' if w is not None else ''} (mixq.quant.ggml.encoders lacks it)")
        out.append(gguf.quants.quantize(rows, ggml_type(q)))
    res = np.stack(out)
    return res.reshape(x.shape[:-1] + (res.shape[-1],))


@dataclass(frozen=True)
class Piece:
    """Experts [e0, e1) and rows [r0, r1) of a tensor seen as (E, R, n) (E = 1 for a 2-D tensor)."""
    e0: int
    e1: int
    r0: int
    r1: int


def split(shape: Sequence[int], task_weights: int = TASK_WEIGHTS) -> list[Piece]:
    """Cut a 2-D (R, n) or 3-D (E, R, n) tensor into pieces of about `task_weights` weights, in storage order:
    whole experts grouped while an expert is small, row blocks of one expert (or of a 2-D tensor) otherwise."""
    E, R, n = (1, *shape) if len(shape) == 2 else tuple(shape)
    if E * R * n == 0:
        return []
    if len(shape) == 3 and R * n <= task_weights:
        k = max(1, task_weights // (R * n))
        return [Piece(e, min(e + k, E), 0, R) for e in range(0, E, k)]
    rows = max(1, task_weights // n)
    return [Piece(e, e + 1, r, min(r + rows, R)) for e in range(E) for r in range(0, R, rows)]


def _cut(x: np.ndarray, imx: np.ndarray | None, p: Piece) -> tuple[np.ndarray, np.ndarray | None]:
    """A task's own copy of its rows (so the source tensor can be freed once cut) and its importance vector(s)."""
    if x.ndim == 3 and (p.r0, p.r1) == (0, x.shape[1]):
        rows = x[p.e0:p.e1]
        w = None if imx is None else (imx if imx.shape[0] == 1 else imx[p.e0:p.e1])
    else:
        rows = x[p.e0, p.r0:p.r1] if x.ndim == 3 else x[p.r0:p.r1]
        w = None if imx is None else imx[p.e0 if imx.shape[0] > 1 else 0]
    return np.array(rows, dtype=np.float32, copy=True), None if w is None else np.array(w, copy=True)


def _put(res: np.ndarray, x_ndim: int, p: Piece, data: np.ndarray) -> None:
    if x_ndim == 3 and data.ndim == 3:
        res[p.e0:p.e1] = data
    elif x_ndim == 3:
        res[p.e0, p.r0:p.r1] = data
    else:
        res[p.r0:p.r1] = data


def _kill_workers(pool: ProcessPoolExecutor) -> None:
    """Kill a pool's workers (a worker stuck in a task); Python >= 3.14 has an API for it."""
    kill = getattr(pool, "kill_workers", None)
    if kill is not None:
        kill()
        return
    for p in list((getattr(pool, "_processes", None) or {}).values()):
        p.kill()


def _stop_now(pool: ProcessPoolExecutor) -> None:
    """Kill the workers and let the pool go without waiting (it notices the dead workers by itself)."""
    _kill_workers(pool)
    # a worker killed while sending a result leaves the pool's manager thread reading the rest of that message for
    # ever, and the interpreter's exit waits for that thread: this process holds a write end of the result pipe
    # too (never used here), and with it closed the read ends (EOF) once the workers are gone
    writer = getattr(getattr(pool, "_result_queue", None), "_writer", None)
    if writer is not None:
        writer.close()
    pool.shutdown(wait=False, cancel_futures=True)


def _worker_init(parent: int) -> None:
    """Set up one worker: one BLAS/OpenMP thread, no reaction to the terminal's signals, and death with `parent`
    (the pid of the process that made the pool, passed from it: a worker that reads os.getppid() itself may start
    after its parent already died and take the re-parented value for its parent)."""
    for k in THREAD_ENV:  # for any thread pool started after this point (the env was set at spawn time too)
        os.environ[k] = "1"
    # Ctrl-C / SIGTERM / SIGHUP go to the whole process group: the parent stops the pool (TensorEncoder.close),
    # workers must not die mid-queue. They were blocked from birth (_signals_held at spawn), so none arrived
    # during start-up; ignoring drops the pending ones, then the mask is left as Python expects it
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    # a parent killed outright (SIGKILL, OOM killer) cannot stop us, and the task pipe never reports EOF (each
    # worker holds both ends): the kernel kills us with it (Linux), a watch thread covers the other systems
    die_with_parent(parent)


def _worker_encode(x: np.ndarray, qtype: str, imatrix: np.ndarray | None, label: str,
                   device: str | None = None, chunk: int | None = None) -> np.ndarray:
    try:
        return encode(x, qtype, imatrix, device, chunk)
    except InputError as e:
        raise InputError(f"{label}: {e}") from None


def _ready(warm: Sequence[str] = ()) -> int:
    """First task of a worker: build the code tables of the i-quant types to come (once per process,
    each a noticeable wait) while the parent still reads metadata, instead of on the first real task."""
    row = np.linspace(-1.0, 1.0, 256, dtype=np.float32).reshape(1, 256)
    for q in warm:
        try:
            encode(row, q, np.ones(256, dtype=np.float32))
        except Exception:  # only a warm-up: the real task reports any problem with its tensor's name
            pass
    return os.getpid()


@contextmanager
def _signals_held():
    """Block STOP_SIGNALS in this thread while it spawns workers: a spawned process inherits the mask, so a Ctrl-C
    during a worker's start-up (its imports) waits until its initializer ignores it, instead of printing the
    worker's KeyboardInterrupt traceback. The parent gets its own pending signal once the block ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    # multiprocessing starts its resource tracker on first use and unblocks SIGINT / SIGTERM after that spawn,
    # which would undo the block for the workers spawned after it: start it before blocking
    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextmanager
def _single_threaded_env():
    """Spawned workers inherit the environment at start: numpy's BLAS reads its thread count when imported,
    before any initializer runs. The parent's own pools are already sized; it is restored right after."""
    old = {k: os.environ.get(k) for k in THREAD_ENV}
    os.environ.update({k: "1" for k in THREAD_ENV})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class _Tensor:
    qtype: str
    label: str
    x_ndim: int = 0
    out_shape: tuple = ()
    pending: list[tuple[Piece, Future]] = field(default_factory=list)
    cut_done: bool = False
    error: BaseException | None = None
    res: np.ndarray | None = None


class TensorEncoder:
    """Encoded data of the tensors in `items` [(name, qtype, label)], asked for in that order through `get(name)`.

    `load(name) -> (x, imatrix or None)` reads one source tensor (called once per tensor, in order). Encoder
    InputErrors come back as one line `"{label}: {message}"`; load errors propagate as raised, each when its
    tensor is asked for, so the first failing tensor is the one reported, whatever the thread count.
    Use as a context manager (`with TensorEncoder(...) as enc:`): leaving it stops the workers, killing them
    when an exception leaves. `start()` spawns them early; otherwise the first task does.
    `device` (e.g. "cuda"): every tensor is encoded in this process on that device, no worker processes, in
    pieces of `chunk` weights (None: the device's default)."""

    def __init__(self, items: Sequence[tuple[str, str, str]], load: Callable[[str], tuple[np.ndarray, np.ndarray | None]],
                 threads: int = 1, task_weights: int | None = None, device: str | None = None,
                 chunk: int | None = None):
        self.items = [(n, q.upper(), lab) for n, q, lab in items]
        self.load = load
        self.device = None if device is None or str(device) == "cpu" else str(device)
        self.threads = 1 if self.device else max(1, int(threads))
        self.chunk = chunk  # weights per device call (the memory budget's piece); None: the device's default
        self.task_weights = task_weights  # None: TASK_WEIGHTS, or TASK_WEIGHTS_IQ for the i-quants
        self._pos = {n: i for i, (n, _, _) in enumerate(self.items)}
        self._asked = 0                      # index of the next tensor get() must be asked for
        self._cut_next = 0                   # index of the next tensor the look-ahead may start cutting
        self._cutting: tuple[str, Iterator] | None = None
        self._tensors: dict[str, _Tensor] = {}
        self._window = 0                     # tasks in the pool or finished, not yet assembled
        self._stop = False
        self._pool: ProcessPoolExecutor | None = None
        self._source: tuple[np.ndarray, np.ndarray | None] | None = None
        self._starts: list[Future] = []

    # -- public ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the workers now (they import and build tables while the caller goes on); else on first use."""
        if self.threads > 1 and self._pool is None and any(q not in FLOAT_TYPES for _, q, _ in self.items):
            self._pool = self._start_pool()

    def get(self, name: str) -> np.ndarray:
        """Encoded data of tensor `name` (the next one in `items` order)."""
        i = self._pos.get(name)
        if i != self._asked:
            raise ValueError(f"tensor {name!r} asked out of order (expected {self.items[self._asked][0]!r})")
        self._asked += 1
        _, qtype, label = self.items[i]
        if self.threads == 1 or qtype in FLOAT_TYPES:
            x, w = self.load(name)
            return _worker_encode(x, qtype, w, label, self.device, self.chunk)
        self._fill()
        t = self._tensors[name]
        while True:
            if t.error is not None:
                raise t.error
            if t.cut_done and not t.pending:
                break
            if t.pending:
                done, _ = wait([f for _, f in t.pending], return_when=FIRST_COMPLETED)
                keep = []
                for p, f in t.pending:
                    if f in done:
                        self._window -= 1
                        self._assemble(t, p, self._result(f, label))
                    else:
                        keep.append((p, f))
                t.pending = keep
            self._fill()
        del self._tensors[name]
        res, t.res = t.res, None
        if res is None:  # a tensor with no weights
            res = np.zeros(t.out_shape, dtype=np.uint8)
        return res

    def close(self, abort: bool = False) -> None:
        """Stop the workers. `abort` (after an error) drops the look-ahead instead of encoding it: queued tasks
        are cancelled and the few a worker already holds (at most ~3N, each about a second) are let finish, so
        every worker is alive and idle when the pool shuts down. Killing workers mid-task instead can leave a
        half-sent task or result in the pool's pipes, and ProcessPoolExecutor.shutdown(wait=True) then waits for
        ever (seen on loaded machines). Workers still busy after ABORT_GRACE_S are killed as a last resort."""
        pool, self._pool = self._pool, None
        futures = [f for t in self._tensors.values() for _, f in t.pending] + list(self._starts)
        self._tensors.clear()
        self._cutting = None
        self._source = None
        if pool is None:
            return
        try:
            if abort:
                for f in futures:
                    f.cancel()  # only tasks no worker has taken yet; the running ones finish below
                _, busy = wait(futures, timeout=ABORT_GRACE_S)
                if busy:
                    _stop_now(pool)
                    return
            pool.shutdown(wait=True, cancel_futures=True)
        except BaseException:
            # stopping was itself interrupted (a second Ctrl-C, a test's timeout): no more waiting; dead workers
            # let the pool's manager thread end, which the interpreter's exit would otherwise wait for
            _stop_now(pool)
            raise

    def __enter__(self) -> "TensorEncoder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(abort=exc_type is not None)

    # -- look-ahead -----------------------------------------------------------------------------------------
    def _fill(self) -> None:
        """Hand out tasks in tensor order until 2*N are outstanding (or everything is cut)."""
        while self._window < 2 * self.threads and not self._stop:
            if self._cutting is None and not self._start_next():
                return
            name, pieces = self._cutting
            t = self._tensors[name]
            piece = next(pieces, None)
            if piece is None:
                t.cut_done = True
                self._cutting = None
                continue
            rows, w = self._source
            xs, ws = _cut(rows, w, piece)
            fut = self._submit(xs, t.qtype, ws, t.label)
            t.pending.append((piece, fut))
            self._window += 1
        if self._cutting is None:
            self._source = None

    def _start_next(self) -> bool:
        """Load the next tensor that goes to the workers; False when none is left."""
        self._source = None
        while self._cut_next < len(self.items):
            name, qtype, label = self.items[self._cut_next]
            self._cut_next += 1
            if qtype in FLOAT_TYPES:
                continue
            t = self._tensors[name] = _Tensor(qtype, label)
            try:
                x, w = self.load(name)
            except Exception as e:  # e.g. a bad imatrix entry: raised as is when its tensor is due, as in one process
                t.error, self._stop = e, True
                return False
            x = np.asarray(x)
            if w is not None:
                w = np.asarray(w, dtype=np.float32).reshape(-1, x.shape[-1])
                if w.shape[0] not in (1, x.shape[0] if x.ndim == 3 else 1):
                    t.error = InputError(f"{label}: imatrix has {w.shape[0]} vectors for "
                                         f"{x.shape[0] if x.ndim == 3 else 1} matrices")
                    self._stop = True
                    return False
            if x.ndim not in (2, 3):
                x = x.reshape(-1, x.shape[-1]) if x.ndim > 3 else x.reshape(1, -1)
            t.x_ndim = x.ndim
            t.out_shape = x.shape[:-1] + (0,)
            self._source = (x, w)
            tw = self.task_weights or (TASK_WEIGHTS_IQ if qtype.startswith("IQ") else TASK_WEIGHTS)
            self._cutting = (name, iter(split(x.shape, tw)))
            return True
        return False

    def _assemble(self, t: _Tensor, p: Piece, data: np.ndarray) -> None:
        if t.res is None:
            t.res = np.empty(t.out_shape[:-1] + (data.shape[-1],), dtype=data.dtype)
        _put(t.res, t.x_ndim, p, data)

    # -- pool -----------------------------------------------------------------------------------------------
    def _submit(self, x, qtype, w, label) -> Future:
        if self._pool is None:
            self._pool = self._start_pool()
        try:
            return self._pool.submit(_worker_encode, x, qtype, w, label)
        except BrokenProcessPool as e:
            raise self._broken(label) from e

    def _start_pool(self) -> ProcessPoolExecutor:
        ctx = multiprocessing.get_context("spawn")
        with _single_threaded_env(), _signals_held(), without_callers_main():
            pool = ProcessPoolExecutor(self.threads, mp_context=ctx, initializer=_worker_init,
                                       initargs=(os.getpid(),))
            # spawn every worker now, while the environment says one thread (later spawns would not see it);
            # not waited for: the parent goes on reading and cutting tensors while the workers import
            warm = sorted({q for _, q, _ in self.items if q.startswith("IQ")})
            self._starts = [pool.submit(_ready, warm) for _ in range(self.threads)]
        return pool

    def _result(self, f: Future, label: str) -> np.ndarray:
        try:
            return f.result()
        except BrokenProcessPool as e:
            raise self._broken(label) from e

    def _broken(self, label: str) -> MixqError:
        if not all(f.done() and f.exception() is None for f in self._starts):
            return MixqError("the GGUF encoder worker processes could not start; retry with threads=1")
        return MixqError(f"{label}: a GGUF encoder worker process died (out of memory?); "
                         f"retry with fewer --threads than {self.threads}")
