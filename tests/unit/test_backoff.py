"""The one backoff policy of every retry path (`streamengine.protocol.backoff`)."""

from __future__ import annotations

import itertools

import pytest
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt

from streamengine.protocol.backoff import (
    ETCD_CALL,
    REPLICA_READ,
    ROLL_WITHOUT_SEGMENT,
    STORE_REGISTER,
    STORE_STREAM_REOPEN,
    TRANSIENT_CALL,
    Backoff,
    tenacity_wait,
)


@pytest.mark.parametrize(
    ("rule", "backoff", "attempt", "draw", "expected_ms"),
    [
        ("the first failure waits the first delay", Backoff(50, 1_000), 1, None, 50),
        ("each further failure waits factor times longer", Backoff(50, 1_000), 2, None, 100),
        ("and again", Backoff(50, 1_000), 4, None, 400),
        ("never longer than the cap", Backoff(50, 1_000), 6, None, 1_000),
        ("a cap between two growths is reached", Backoff(100, 3_000), 6, None, 3_000),
        ("a long run of failures stays at the cap", Backoff(50, 1_000), 10_000, None, 1_000),
        ("another factor", Backoff(10, 10_000, factor=3), 3, None, 90),
        ("factor 1 is a fixed delay", Backoff(1_000, 1_000, factor=1), 7, None, 1_000),
        ("no draw, no jitter", Backoff(50, 1_000, jitter_ms=0), 1, None, 50),
        ("a draw of 0 adds nothing", Backoff(50, 1_000, jitter_ms=50), 1, 0.0, 50),
        ("jitter adds its share", Backoff(50, 1_000, jitter_ms=50), 2, 0.5, 125),
        ("in whole milliseconds", Backoff(50, 1_000, jitter_ms=50), 1, 0.999, 99),
        ("jitter is added before the cap", Backoff(50, 1_000, jitter_ms=50), 5, 0.9, 845),
        ("so the cap holds with it", Backoff(50, 1_000, jitter_ms=50), 6, 0.9, 1_000),
    ],
)
def test_a_backoff_delay(rule, backoff, attempt, draw, expected_ms) -> None:
    assert backoff.delay_ms(attempt, draw) == expected_ms, rule


@pytest.mark.parametrize(
    ("policy", "expected_ms"),
    [
        (TRANSIENT_CALL, [50, 100, 200, 400, 800, 1_000, 1_000]),
        (STORE_STREAM_REOPEN, [50, 100, 200, 400, 800, 1_000, 1_000]),
        (ROLL_WITHOUT_SEGMENT, [100, 200, 400, 800, 1_000, 1_000, 1_000]),
        (REPLICA_READ, [100, 200, 400, 800, 1_000, 1_000, 1_000]),
        (STORE_REGISTER, [50, 100, 200, 400, 800, 1_600, 2_000]),
        (ETCD_CALL, [100, 200, 400, 800, 1_000, 1_000, 1_000]),
    ],
)
def test_the_named_policies_without_jitter(policy: Backoff, expected_ms: list[int]) -> None:
    assert [policy.delay_ms(attempt, 0.0) for attempt in range(1, 8)] == expected_ms


@pytest.mark.parametrize("policy", [TRANSIENT_CALL, STORE_REGISTER])
def test_a_jittered_policy_stays_within_its_jitter(policy: Backoff) -> None:
    for attempt, draw in itertools.product(range(1, 12), (0.0, 0.25, 0.5, 0.999)):
        delay = policy.delay_ms(attempt, draw)
        plain = policy.delay_ms(attempt, 0.0)
        assert plain <= delay <= min(plain + policy.jitter_ms, policy.max_ms)


def test_a_jittered_policy_needs_a_draw() -> None:
    with pytest.raises(AssertionError):
        TRANSIENT_CALL.delay_ms(1)


@pytest.mark.parametrize("draw", [-0.1, 1.0])
def test_a_draw_is_in_the_unit_interval(draw: float) -> None:
    with pytest.raises(AssertionError):
        TRANSIENT_CALL.delay_ms(1, draw)


@pytest.mark.parametrize("fields", [(0, 1_000), (2_000, 1_000), (50, 1_000, 0), (50, 1_000, 2, -1)])
def test_a_backoff_without_sense_is_refused(fields: tuple[int, ...]) -> None:
    with pytest.raises(AssertionError):
        Backoff(*fields)


async def test_a_tenacity_loop_waits_as_its_policy_says() -> None:
    draws = iter([0.0, 0.5, 0.999])
    waited_s: list[float] = []

    async def sleep(seconds: float) -> None:
        waited_s.append(seconds)

    async for attempt in AsyncRetrying(
        retry=retry_if_exception_type(TimeoutError),
        wait=tenacity_wait(TRANSIENT_CALL, lambda: next(draws)),
        stop=stop_after_attempt(4),
        sleep=sleep,
        reraise=False,
    ):
        with attempt:
            if attempt.retry_state.attempt_number < 4:
                raise TimeoutError
    assert waited_s == [0.05, 0.125, 0.249]
