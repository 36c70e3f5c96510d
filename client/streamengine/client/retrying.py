"""Retries of unary control calls (create, release, seal) on transient gRPC failures.

Only calls whose repetition cannot duplicate an acked event go through here; the
replication streams reconnect and resend from the store's matched index instead.
FAILED_PRECONDITION (fenced, not the leader) is never retried: the state must change.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from tenacity import (
    AsyncRetrying,
    before_sleep_log,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
)

from streamengine.protocol.backoff import TRANSIENT_CALL, tenacity_wait

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)

# A control call gives up after this long: the master restarting refuses leases for
# one lease period (2 s by default), so a few seconds ride that out.
CONTROL_RETRY_S_MAX = 10.0
CONTROL_ATTEMPTS_MAX = 12


def is_retryable(error: BaseException) -> bool:
    return isinstance(error, grpc.aio.AioRpcError) and error.code() in RETRYABLE_CODES


async def retry_unary(
    call: Callable[[], Awaitable[T]],
    deadline_s: float = CONTROL_RETRY_S_MAX,
    attempts: int = CONTROL_ATTEMPTS_MAX,
) -> T:
    """Await `call()` (a fresh RPC per attempt), retrying transient failures; the last
    error is raised as it is."""
    async for attempt in AsyncRetrying(
        retry=retry_if_exception(is_retryable),
        wait=tenacity_wait(TRANSIENT_CALL, random.random),
        stop=stop_after_delay(deadline_s) | stop_after_attempt(attempts),
        before_sleep=before_sleep_log(log, logging.INFO),
        reraise=True,
    ):
        with attempt:
            return await call()
    raise AssertionError("unreachable: tenacity reraises the last error")
