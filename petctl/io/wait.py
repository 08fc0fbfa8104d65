"""Polling with a deadline, written once (on tenacity) instead of a `while time.monotonic() < deadline`
loop in every module.

`wait_until(check, timeout, interval)` calls `check` at once, then every `interval` seconds, until it
returns something true or `timeout` has passed; an exception from `check` propagates at once (retrying a
failure is the caller's decision, see `retry_until`). The interval is fixed, never backed off: the
callers are the agent's and the local provider's waits, where a longer poll is a slower restart.
tenacity is imported on first use, so importing this module costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(check: Callable[[], T], timeout: float, interval: float) -> T:
    """The first true value `check()` returns, or its last (false) value once `timeout` seconds have
    passed (it is called at least once, and once more at or after the deadline). Raises what `check`
    raises."""
    from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

    retrying = Retrying(stop=stop_after_delay(max(0.0, timeout)), wait=wait_fixed(interval),
                        retry=retry_if_result(lambda value: not value),
                        retry_error_callback=lambda state: state.outcome.result())
    return retrying(check)


def retry_until(call: Callable[[], T], timeout: float, interval: float,
                retry_on: tuple[type[BaseException], ...]) -> T:
    """`call()`'s result, retrying it every `interval` seconds while it raises one of `retry_on`, for up to
    `timeout` seconds; then the last such exception is raised (as is any other exception, at once)."""
    from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

    retrying = Retrying(stop=stop_after_delay(max(0.0, timeout)), wait=wait_fixed(interval),
                        retry=retry_if_exception_type(retry_on), reraise=True)
    return retrying(call)
