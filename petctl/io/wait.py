"""Polling with a deadline, written once (on tenacity) instead of a `while time.monotonic() < deadline`
loop in every module.

`wait_until(check, timeout, interval)` calls `check` at once, then every `interval` seconds, until it
returns something true or `timeout` has passed; an exception from `check` propagates at once (whether a
failure is worth retrying is the caller's decision). The interval is fixed, never backed off: the
callers are the agent's and the local provider's waits, where a longer poll is a slower restart.
tenacity is imported on first use, so importing this module costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(check: Callable[[], T], timeout: float, interval: float) -> T:
    """The first true value `check()` returns, else its last (false) value: that of a call that ended
    at or after `timeout` seconds (so a condition met just at the deadline is still seen). Raises what
    `check` raises."""
    from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

    retrying = Retrying(stop=stop_after_delay(max(0.0, timeout)), wait=wait_fixed(interval),
                        retry=retry_if_result(lambda value: not value),
                        retry_error_callback=lambda state: state.outcome.result())
    return retrying(check)

