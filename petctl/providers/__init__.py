"""Capacity providers. The CLI talks to `Provider` only; `get_provider` picks the backend."""

from __future__ import annotations

from petctl.core.config import PetctlConfig
from petctl.core.errors import PetctlError
from petctl.providers.base import Provider


def get_provider(config: PetctlConfig, name: str | None = None) -> Provider:
    name = name or config.provider or "local"
    if name == "local":
        from petctl.providers.local.provider import LocalProvider

        return LocalProvider(config)
    if name == "aws":
        from petctl.providers.aws.provider import AwsProvider

        return AwsProvider(config)
    raise PetctlError(f"unknown provider {name!r}: choose local or aws")
