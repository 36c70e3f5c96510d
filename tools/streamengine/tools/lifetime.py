"""Servers that must not outlive the process that started them (`cluster up`)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

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
