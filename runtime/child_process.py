"""Processes mixq spawns (GGUF encoder workers, distributed ranks): started without the caller's main module, ended
with the process that spawned them.

A spawned child normally runs its parent's `__main__` again before it takes its task. mixq's children need nothing
from it, and a caller's script may not survive a second run (top-level code without `if __name__ == "__main__":`,
or a script read from standard input), so `without_callers_main()` spawns them with an empty one.
A parent killed outright (SIGKILL, the OOM killer) runs no cleanup, so a child must notice by itself: on Linux the
kernel kills it with its parent (PR_SET_PDEATHSIG), elsewhere a watch thread sees it re-parented.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import types
from contextlib import contextmanager
from typing import Iterator

PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_POLL_S = 0.5  # how often a child looks whether its parent is still there (the portable fallback)


@contextmanager
def without_callers_main() -> Iterator[None]:
    """Processes spawned (multiprocessing's "spawn") while this is held start with an empty `__main__` instead of
    re-running the caller's script or module. Only for children whose tasks are defined in importable modules."""
    callers = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if callers is None:
            del sys.modules["__main__"]
        else:
            sys.modules["__main__"] = callers


def die_with_parent(parent: int) -> None:
    """Make this child process end when `parent` ends. `parent` is the spawner's pid, passed from it: a child that
    read os.getppid() itself may start after its parent already died and take the re-parented value."""
    _kernel_kills_me_with_parent()
    if os.getppid() != parent:  # died before the line above took effect
        os._exit(1)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="mixq-parent-watch").start()


def _kernel_kills_me_with_parent() -> None:
    """Linux: prctl(PR_SET_PDEATHSIG, SIGKILL). The kernel sends it when the thread that spawned this process ends;
    mixq spawns and stops its children in one call chain of one thread, so that is the parent's end."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # no usable libc: the watch thread alone
        pass


def _exit_with_parent(parent: int) -> None:
    """Leave as soon as this process is re-parented (its parent died), instead of working for no one."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent:
            os._exit(1)
