"""How the CLI's processes end: servers that must not outlive the process that started
them (`cluster up`), SIGTERM taken as Ctrl-C, and a bounded exit once a command that
runs until stopped is done."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
from types import FrameType
from typing import NoReturn

# Set on children: the pid of the process they must not outlive.
PARENT_PID_ENV = "STREAMENGINE_DIE_WITH_PARENT"
PR_SET_PDEATHSIG = 1


def die_with_parent_if_asked() -> None:
    """In a server started with PARENT_PID_ENV: have the kernel SIGKILL it when that
    process dies. The child does this itself, after exec: a `preexec_fn` runs Python
    between fork and exec, which crashes (SIGSEGV) when the parent has other threads,
    and gRPC's always are. The kernel signals when the parent *thread* that started
    the child exits, not the process: start children from a long-lived thread."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent is None or sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(parent):  # it died before the prctl: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)


def stop_on_sigterm_as_on_sigint() -> None:
    """SIGTERM stops a command the way Ctrl-C does, through whatever handles SIGINT when
    it arrives: `asyncio.run`'s handler (which cancels the command's main task, so its
    streams and channels close as on any cancellation), a command's own, or Python's
    KeyboardInterrupt. Without this, SIGTERM kills the process on the spot."""
    signal.signal(signal.SIGTERM, _as_sigint)


def _as_sigint(signum: int, frame: FrameType | None) -> None:
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:  # SIGINT ignored (a background job of a script) or left to the default
        raise KeyboardInterrupt


def exit_at_once(code: int) -> NoReturn:
    """End the process now, once a command has closed what it opened: flush what it
    printed, then `os._exit`, skipping the interpreter's teardown. That teardown (a full
    collection over the grpc, protobuf, pyarrow and numpy modules, and gRPC core's
    shutdown beside its own threads) took 0.5 to 1.5 s after a stopped `tail --follow`
    on a loaded 2-core host, and longer when gRPC's threads were busy: no bound a user
    waiting on Ctrl-C, or a supervisor's stop timeout, can count on."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
