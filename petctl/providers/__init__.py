"""Capacity providers. The CLI talks to `Provider` only; `get_provider` picks the backend, `job_view`
opens a job's read side with whatever the provider knows about where its records and prices are."""

from __future__ import annotations

from typing import TYPE_CHECKING

from petctl.core.errors import PetctlError
from petctl.io.config import PetctlConfig
from petctl.providers.base import Provider

if TYPE_CHECKING:
    from petctl.jobview.view import JobView


def get_provider(config: PetctlConfig, name: str | None = None) -> Provider:
    name = name or config.provider or "local"
    if name == "local":
        from petctl.providers.local.provider import LocalProvider

        return LocalProvider(config)
    if name == "aws":
        from petctl.providers.aws.provider import AwsProvider

        return AwsProvider(config)
    raise PetctlError(f"unknown provider {name!r}: choose local or aws")


def job_view(provider: Provider, name: str) -> JobView:
    """The read side of job `name`: its records where `provider` keeps them, priced when it can price.
    Raises JobNotFound where the provider can tell the job never existed."""
    from petctl.jobview.view import JobView
    from petctl.providers.capabilities import Pricing

    prices = provider.prices if isinstance(provider, Pricing) else None  # called only for a cost
    return JobView(provider.sources(name), prices=prices)
