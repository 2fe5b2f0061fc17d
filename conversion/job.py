"""Job state of a conversion, for `--resume`: which stages are finished, their part files and hashes, the
calibration state after the last finished stage, and a fingerprint of every setting that changes the output.

Layout (inside the output directory, removed when the conversion completes):
  .mixq-job/job.json            {"fingerprint", "settings", "done": [{"stage", "file", "sha256", "bytes", ...}]}
  .mixq-job/lock                the pid of the process writing OUT, flock-ed while it runs (goes with the process)
  .mixq-job/parts/<stage>.safetensors
  .mixq-job/state.<stage>.safetensors   calibration hidden state after the last finished calibrated stage
Each file is written under a temporary name and renamed, and job.json is updated last, so a kill at any point
leaves either the old or the new consistent state.
"""
from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None

from mixq.errors import InputError
from mixq.formats.atomic import write_json
from mixq.formats.safetensors_io import load_tensors, sha256_file, write_safetensors
from mixq.runtime import profile
from mixq.formats.model_files import read_json

JOB_DIR = ".mixq-job"
LOCK_FILE = "lock"


def fingerprint(settings: dict) -> str:
    """sha256 of the canonical JSON of the settings (sorted keys)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def file_digest(path: str | Path) -> str:
    return sha256_file(Path(path))


class Job:
    """The resumable state of one conversion into `out_dir`."""

    def __init__(self, out_dir: Path, settings: dict) -> None:
        self.out = Path(out_dir)
        self.dir = self.out / JOB_DIR
        self.path = self.dir / "job.json"
        self.settings = settings
        self.fp = fingerprint(settings)
        self.done: list[dict] = []
        self.extra: dict = {}
        self._lock_fd: int | None = None

    @staticmethod
    def check_target(out_dir: str | Path, *, resume: bool) -> None:
        """The checks of `open` that need no work: InputError when OUT holds something else, when --resume finds
        no job, or when a job is there and --resume is not given. Creates nothing."""
        out = Path(out_dir)
        if out.exists() and not out.is_dir():
            raise InputError(f"output {out} exists and is not a directory")
        if (out / JOB_DIR / "job.json").exists():
            if not resume:
                raise InputError(f"{out} holds an unfinished conversion; pass --resume to continue it "
                                 f"or remove the directory")
            return
        if out.exists() and any(out.iterdir()):
            if resume and (out / "config.json").exists():
                raise InputError(f"{out} already holds a finished conversion; nothing to resume")
            raise InputError(f"output directory {out} is not empty" + ("" if not resume else " and has no job"))
        if resume:
            raise InputError(f"nothing to resume in {out}: no {JOB_DIR}/job.json")

    @classmethod
    def open(cls, out_dir: str | Path, settings: dict, *, resume: bool) -> "Job":
        """Start a job, or continue one with `resume` (see `check_target`; also InputError when the settings
        differ from the interrupted run, or when another process is writing OUT)."""
        out = Path(out_dir)
        job = cls(out, settings)
        cls.check_target(out, resume=resume)
        if job.path.exists():
            job._take_lock()
            try:
                job._continue()
            except BaseException:
                job.release()
                raise
            return job
        job.dir.mkdir(parents=True, exist_ok=True)
        job._take_lock()
        job._save()
        return job

    def _continue(self) -> None:
        """Load the interrupted run's state; InputError when its settings differ from ours."""
        data = read_json(self.path, "job state")
        if not isinstance(data, dict):
            raise InputError(f"{self.path}: unreadable job state (not a JSON object)")
        if data.get("fingerprint") != self.fp:
            old = data.get("settings", {})
            diff = sorted(k for k in set(old) | set(self.settings)
                          if json.dumps(old.get(k), sort_keys=True, default=str)
                          != json.dumps(self.settings.get(k), sort_keys=True, default=str))
            raise InputError(f"cannot resume {self.out}: settings differ from the interrupted run ({', '.join(diff)})")
        self.done = list(data.get("done", []))
        self.extra = dict(data.get("extra", {}))
        self._drop_unverified()

    def _take_lock(self) -> None:
        """Hold an exclusive flock on JOB_DIR/lock (holding our pid) while this job runs: a second process on the
        same OUT (a --resume while the first still runs) is refused. The kernel drops the lock with the process,
        so a killed run never blocks its --resume."""
        if fcntl is None:  # not POSIX
            return
        fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise InputError(f"{self.out} is being written by another mixq process (pid {pid}); wait for it to "
                             "end or stop it before resuming") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def release(self) -> None:
        """Drop the lock (the job's files stay for --resume)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    def _drop_unverified(self) -> None:
        """Keep the finished stages whose part files are intact; drop everything after the first bad one."""
        keep = []
        for d in self.done:
            p = self.dir / "parts" / d["file"]
            if not p.exists() or p.stat().st_size != d["bytes"] or file_digest(p) != d["sha256"]:
                break
            keep.append(d)
        self.done = keep

    def _save(self) -> None:
        write_json(self.path, {"fingerprint": self.fp, "settings": self.settings, "done": self.done,
                               "extra": self.extra})

    def is_done(self, stage: str) -> bool:
        return any(d["stage"] == stage for d in self.done)

    def _state_path(self, stage: str) -> Path:
        return self.dir / f"state.{stage}.safetensors"

    def record(self, stage: str, part, *, state: dict[str, torch.Tensor] | None = None, **info) -> None:
        """Mark a stage finished (its part is on disk). The calibration state after it is written first, then
        job.json, then older states are removed: a kill anywhere leaves a state matching job.json."""
        if state is not None:
            tensors = {k: v.contiguous() for k, v in state.items() if v is not None}
            write_safetensors(self._state_path(stage), tensors, metadata={"after": stage})
            info["state_after"] = stage
        self.done.append({"stage": stage, "file": part.file, "sha256": part.sha256, "bytes": part.bytes, **info})
        self._save()
        if state is not None:
            for p in self.dir.glob("state.*.safetensors"):
                if p.name != self._state_path(stage).name:
                    p.unlink(missing_ok=True)

    def load_state(self) -> tuple[str | None, dict[str, torch.Tensor] | None]:
        """(stage, tensors) of the calibration state saved after the last finished calibrated stage."""
        want = next((d["stage"] for d in reversed(self.done) if d.get("state_after")), None)
        if want is None:
            return None, None
        p = self._state_path(want)
        if not p.exists():
            raise InputError(f"cannot resume: calibration state {p} is missing")
        return want, load_tensors(p)

    def part_info(self, stage: str) -> dict:
        return next(d for d in self.done if d["stage"] == stage)

    def cleanup(self) -> None:
        """The conversion is complete: remove the job directory (and the lock with it)."""
        self.release()
        shutil.rmtree(self.dir, ignore_errors=True)


def rss_peak_mib() -> float:
    """Peak resident set size of this process in MiB (Linux ru_maxrss is KiB; while a --profile is recorded, which
    resets the kernel's peak at each stage, the recording's)."""
    if (p := profile.peaks()) is not None:
        return max(p[0] / 2**20, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

