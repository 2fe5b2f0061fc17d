"""One conversion spread over the devices of one host: torch.distributed (NCCL on GPUs, gloo on CPUs).

Every rank runs the same pipeline on the same inputs and holds the same small state (plan, units, calibration
hidden streams); the work that dominates is dealt out and its results shared, so the output does not depend on
the number of ranks:
- `RankContext` is one rank's view: its rank, the world size, its device, and the few collectives the pipeline
  uses (broadcast a picklable object, share a dict of tensors from one rank with all, gather objects).
- `deal(costs, world)` assigns work items to ranks (largest first, to the least loaded rank): a pure function
  of the costs, so every rank computes the same assignment without talking.
- `launch(target, args, devices)` starts one worker process per device (spawn, a free localhost port), runs
  `target(*args)` in each and returns rank 0's result; the first rank to fail ends every rank, and its error
  is raised here as one line. `rank_context(devices, device)` gives the running process its RankContext: inside
  a worker or under `torchrun` (RANK / WORLD_SIZE / LOCAL_RANK in the environment), else a world of one.
Collectives time out after MIXQ_DIST_TIMEOUT_S seconds (default 1800), so a rank that dies outside a launcher
that watches it cannot leave the others waiting for ever.
"""
from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from mixq import errors
from mixq.runtime.child_process import die_with_parent, without_callers_main
from mixq.errors import InputError, MixqError
from mixq.quant.device import resolve_device

TIMEOUT_ENV = "MIXQ_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800
DEVICES_FLAG = "--devices"
# NVLink SHARP (multicast) stays off: collectives use NVLink point to point, which every H200 host supports.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}


class RankError(MixqError):
    """A worker rank of a multi-device run failed on something other than user input (its traceback is on
    stderr); the message names the rank and the exception."""


# ---------------------------------------------------------------------------------------------- devices

def parse_devices(spec: str | Sequence[str] | None, what: str = DEVICES_FLAG) -> tuple[str, ...]:
    """'0,1' or 'cuda:0,cuda:1' -> ('cuda:0', 'cuda:1'); 'cpu,cpu' -> two CPU ranks. Empty -> ().
    All devices of one type; a GPU named at most once. InputError naming `what` otherwise."""
    if spec is None:
        return ()
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [str(s).strip() for s in spec]
    if not items or any(not s for s in items):
        raise InputError(f"{what} {spec!r}: expected a comma-separated list such as 0,1 or cpu,cpu")
    out = []
    for s in items:
        dev = f"cuda:{s}" if s.isdigit() else s
        try:
            d = torch.device(dev)
        except (RuntimeError, TypeError, ValueError):
            d = None
        if d is None or d.type not in ("cpu", "cuda") or (d.type == "cuda" and d.index is None and len(items) > 1):
            raise InputError(f"{what} {spec!r}: {s!r} is not a device; use GPU numbers (0,1), cuda:N or cpu")
        out.append(str(d))
    if len({torch.device(d).type for d in out}) > 1:
        raise InputError(f"{what} {spec!r}: mixes CPU and GPU ranks; give devices of one type")
    gpus = [d for d in out if d.startswith("cuda")]
    if len(set(gpus)) != len(gpus):
        raise InputError(f"{what} {spec!r}: names a GPU twice")
    return tuple(out)


def check_devices_present(devices: Sequence[str], what: str = DEVICES_FLAG) -> None:
    """InputError naming `what` when a GPU of `devices` is not on this machine."""
    for d in devices:
        dev = torch.device(d)
        if dev.type != "cuda":
            continue
        if not torch.cuda.is_available():
            raise InputError(f"{what} {','.join(devices)}: CUDA is not available on this machine")
        if (dev.index or 0) >= torch.cuda.device_count():
            raise InputError(f"{what} {','.join(devices)}: this machine has {torch.cuda.device_count()} "
                             "CUDA device(s)")


def timeout_s() -> float:
    """Seconds a collective may wait (MIXQ_DIST_TIMEOUT_S, default 1800)."""
    raw = os.environ.get(TIMEOUT_ENV)
    try:
        return float(raw) if raw else float(DEFAULT_TIMEOUT_S)
    except ValueError:
        raise InputError(f"{TIMEOUT_ENV}={raw!r}: expected a number of seconds") from None


# ---------------------------------------------------------------------------------------------- one rank's view

@dataclass(frozen=True)
class RankContext:
    """One rank of a run: `rank` of `world`, computing on `device`. A world of one makes every collective a
    no-op that returns its input, so the pipeline has one code path."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        """Rank 0: the rank that writes files, shows progress and returns the result."""
        return self.rank == 0

    @property
    def comm_device(self) -> torch.device:
        """Where tensors travel: this rank's GPU under NCCL, the host under gloo."""
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """`obj` of rank `src` (picklable) on every rank."""
        if self.world == 1:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, device=self.comm_device)
        return box[0]

    def gather_objects(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank `dst` (None elsewhere)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world if self.rank == dst else None
        if self.comm_device.type == "cuda":  # NCCL has no gather of objects: every rank gets them, dst keeps
            everyone = [None] * self.world
            dist.all_gather_object(everyone, obj)
            return everyone if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def share_tensors(self, tensors: dict[str, torch.Tensor] | None, src: int,
                      out_device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
        """Rank `src`'s `tensors` on every rank, bit for bit (same names, dtypes, shapes), on `out_device`
        (default: where they arrive). One broadcast of all their bytes plus one of their names and shapes."""
        if self.world == 1:
            return tensors if out_device is None else {k: v.to(out_device) for k, v in tensors.items()}
        meta = self.broadcast_object(
            None if self.rank != src else [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], src)
        sizes = [_nbytes(dtype, shape) for _, dtype, shape in meta]
        if self.rank == src:
            parts = [v.detach().contiguous().reshape(-1).view(torch.uint8).to(self.comm_device)
                     for v in tensors.values()]
            buf = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=self.comm_device)
        else:
            buf = torch.empty(sum(sizes), dtype=torch.uint8, device=self.comm_device)
        if buf.numel():
            dist.broadcast(buf, src=src)
        if self.rank == src:
            return tensors if out_device is None else {k: v.to(out_device) for k, v in tensors.items()}
        target = torch.device(out_device) if out_device is not None else self.comm_device
        out, off = {}, 0
        for (name, dtype, shape), n in zip(meta, sizes):
            # a copy of the slice starts its own storage, so the dtype view needs no alignment
            chunk = buf[off:off + n].to(target, copy=True)
            out[name] = chunk.view(dtype).reshape(shape)
            off += n
        return out


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty(0, dtype=dtype).element_size()


def deal(costs: Sequence[float], world: int) -> list[int]:
    """The rank of each work item: largest cost first, each to the least loaded rank (ties: the lower item
    index, the lower rank). Deterministic, so every rank computes the same assignment."""
    load = [0.0] * world
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda j: (-float(costs[j]), j)):
        r = min(range(world), key=lambda k: (load[k], k))
        owner[i] = r
        load[r] += float(costs[i])
    return owner


def block_owner(index: int, count: int, world: int) -> int:
    """The rank owning item `index` of `count` split into `world` contiguous, near-equal blocks."""
    return min(world - 1, index * world // max(count, 1))


# ---------------------------------------------------------------------------------------------- joining a run

def _torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world, local rank) when started by torchrun (or any launcher with its variables), else None."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return None
    if world <= 1 or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))


def process_rank() -> int:
    """This process's rank in a multi-process run (torchrun's variables, or a worker `launch` started), else 0."""
    env = _torchrun_env()
    return 0 if env is None else env[0]


def needs_launch(devices: Sequence[str]) -> bool:
    """True when this process should start one worker per device: several devices, and not already a rank."""
    return len(devices) > 1 and not (dist.is_available() and dist.is_initialized()) and _torchrun_env() is None


def _rank_device(devices: Sequence[str], device: str | None, local_rank: int) -> torch.device:
    if devices:
        return torch.device(devices[local_rank])
    if device is not None and torch.device(device).type == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def _init_group(rank: int, world: int, dev: torch.device, init_method: str) -> None:
    if dev.type == "cuda":
        for k, v in NCCL_ENV.items():
            os.environ.setdefault(k, v)
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s()),
                            device_id=dev if dev.type == "cuda" else None)


@contextlib.contextmanager
def rank_context(devices: Sequence[str] = (), device: str | None = None) -> Iterator[RankContext]:
    """This process's RankContext: a worker of `launch` (its group is already up), a torchrun rank (the group is
    started here from the environment and ended on exit), or a world of one on `devices[0]` / `device`."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
        yield RankContext(rank, world, _rank_device(devices, device, local))
        return
    env = _torchrun_env()
    if env is None:
        yield RankContext(0, 1, resolve_device(devices[0] if devices else device,
                                               DEVICES_FLAG if devices else "--device"))
        return
    rank, world, local = env
    if devices and len(devices) != world:
        raise InputError(f"{DEVICES_FLAG} names {len(devices)} device(s) but the launcher started {world} ranks")
    dev = _rank_device(devices, device, local)
    check_devices_present([str(dev)])
    _init_group(rank, world, dev, "env://")
    try:
        yield RankContext(rank, world, dev)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- launching workers

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, devices: Sequence[str], port: int, target: Callable, args: tuple, kwargs: dict,
            queue, parent: int) -> None:
    """One rank: join the group, run `target(*args, **kwargs)`, report ("ok", result) / ("error", class, message) /
    ("crash", message) on `queue`."""
    die_with_parent(parent)  # a launcher killed outright takes its ranks with it
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        _init_group(rank, len(devices), torch.device(devices[rank]), f"tcp://127.0.0.1:{port}")
        result = target(*args, **kwargs)
        # pickled here, by value: the queue's own pickler would pass tensors as shared memory of this process
        queue.put((rank, "ok", pickle.dumps(result if rank == 0 else None)))
    except MixqError as e:
        queue.put((rank, "error", (type(e).__name__, str(e))))
    except KeyboardInterrupt:  # Ctrl-C reached the whole process group: the launcher reports it, in one line
        queue.put((rank, "crash", "interrupted"))
    except BaseException as e:  # noqa: BLE001 - everything a rank can die of is reported to the launcher
        traceback.print_exc()
        line = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()
        queue.put((rank, "crash", line[-1] if line else type(e).__name__))
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def launch(target: Callable, args: tuple, devices: Sequence[str], kwargs: dict | None = None) -> Any:
    """Run `target(*args, **kwargs)` in one spawned process per device (rank i on devices[i]) and return rank 0's result.
    A rank that raises ends every rank: its MixqError is raised again here (same class, same one line), any
    other failure as a RankError naming the rank."""
    check_devices_present(devices)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, tuple(devices), port, target, args, kwargs or {}, queue, os.getpid()),
                         daemon=False)
             for r in range(len(devices))]
    with without_callers_main():
        for p in procs:
            p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < len(procs):
            msg = _next_message(queue, procs, results)
            rank, kind, payload = msg
            if kind == "ok":
                results[rank] = pickle.loads(payload)
            elif kind == "error":
                cls = getattr(errors, payload[0], None)
                cls = cls if isinstance(cls, type) and issubclass(cls, MixqError) else MixqError
                raise cls(payload[1])
            else:
                raise RankError(f"rank {rank} ({devices[rank]}) failed: {payload}")
        for p in procs:
            p.join()
        return results[0]
    finally:
        _stop(procs)


def _next_message(queue, procs, results: dict) -> tuple:
    """The next report of a worker; a RankError when a worker ended without one (killed, out of memory)."""
    while True:
        try:
            return queue.get(timeout=0.5)
        except queue_mod.Empty:
            pass
        for r, p in enumerate(procs):
            if r not in results and p.exitcode is not None:
                try:  # its report may have landed just before it ended
                    return queue.get(timeout=2.0)
                except queue_mod.Empty:
                    raise RankError(f"rank {r} ended without a result (exit code {p.exitcode})") from None


def _stop(procs) -> None:
    """End every worker still running (the run failed or was interrupted)."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join()
