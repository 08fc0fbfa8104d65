"""Every test report and warning reaches the xdist controller, whatever text it carries (a pytest plugin,
registered by tests/conftest.py).

Why: an xdist worker sends each report to the controller through execnet, which encodes every string as
UTF-8. A string holding a lone surrogate (text decoded with `surrogateescape` somewhere, or a JSON
`"\\udcff"` escape) cannot be encoded, so the send raises inside the worker's report hook: the worker's
session ends as an internal error with its test still pending, and the controller stops the whole run with
`INTERNALERROR> assert not crashitem` (the test's own outcome, and every test after it, lost). A log record
captured during a test is enough: pytest attaches captured logs to the report of every phase, passed or
failed. A warning is sent the same way, after its test's phases, and stops the run the same way.

CI stopped with that signature on 2026-11-28 (exit 3 after 752 s, `assert not crashitem` for
`tests/e2e/test_preemption.py`'s kill test on gw2). The part of CI's log on record does not hold the
worker's own error, so which text it was is not known; this is the mechanism found that gives exactly that
signature from inside a test, and `tests/project/test_suite_reports.py` reproduces it.

The fix is at the two places everything a worker sends passes: a report's serialized form, and a warning
before xdist serializes it. Each unencodable string gets its surrogates written as `\\udcff` escapes, so
the text stays readable and the report or warning is sent.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest


def encodable(value: Any) -> Any:
    """`value` (a report's serialized form: dicts, lists, tuples, strings and scalars) with every string
    made UTF-8-encodable: lone surrogates become backslash escapes; everything else is returned as is."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
        return value
    if isinstance(value, dict):
        return {encodable(k): encodable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(encodable(v) for v in value)
    return value


@pytest.hookimpl(wrapper=True)
def pytest_report_to_serializable(config: pytest.Config, report: Any) -> Any:
    return encodable((yield))


@pytest.hookimpl(tryfirst=True)
def pytest_warning_recorded(warning_message: warnings.WarningMessage, when: str, nodeid: str,
                            location: tuple[str, int, str] | None) -> None:
    """Before xdist's worker sends the warning (this runs first): its message's arguments, file and line
    made encodable, in place."""
    message = warning_message.message
    if isinstance(message, Warning):
        message.args = encodable(message.args)
    else:
        warning_message.message = encodable(message)
    warning_message.filename = encodable(warning_message.filename)
    warning_message.line = encodable(warning_message.line)
