"""Small parsers for repeatable KEY=VALUE options."""

from __future__ import annotations

import dataclasses

from petctl.core.errors import ValidationError


def key_values(items: tuple[str, ...] | list[str], option: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValidationError(f"{option} expects KEY=VALUE (got {item!r})")
        out[key] = value
    return out


def timeouts(items: tuple[str, ...], base):
    """Apply `--timeout NAME=SECONDS` overrides to a `Timeouts`, rejecting unknown names and bad values."""
    fields = {f.name for f in dataclasses.fields(base)}
    for key, value in key_values(items, "--timeout").items():
        name = key.replace("-", "_")
        if name not in fields:
            raise ValidationError(f"unknown timeout {key!r}: choose one of {', '.join(sorted(fields))}")
        try:
            seconds = float(value)
        except ValueError:
            raise ValidationError(f"--timeout {key} expects seconds (got {value!r})") from None
        if seconds <= 0:
            raise ValidationError(f"--timeout {key} must be > 0 (got {value})")
        setattr(base, name, seconds)
    return base
