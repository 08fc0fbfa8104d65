"""What every command gets from its invocation: the user's config and the provider, made once per
command and kept on click's context object (no module state).

Commands import this module, never `main` (which imports the commands), so there is no import cycle; a
test or an embedding program can hand the commands a provider of its own:
`cli.main(args, obj=CliContext(provider=my_provider))`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from petctl.io.config import PetctlConfig
    from petctl.jobview.view import JobView
    from petctl.providers.base import Provider


@dataclass
class CliContext:
    config: PetctlConfig | None = None
    provider: Provider | None = None  # the configured provider, once a command asked for it

    def load_config(self) -> PetctlConfig:
        if self.config is None:
            from petctl.io.config import PetctlConfig

            self.config = PetctlConfig.load()
        return self.config

    def configured(self) -> str:
        """The name of the provider later commands use ("" before `petctl setup`)."""
        return self.provider.name if self.provider is not None else self.load_config().provider

    def provider_for(self, name: str | None = None) -> Provider:
        """Provider `name`, or (None) the configured one, which requires a completed `petctl setup`.
        Raises NotSetUp, or PetctlError for an unknown provider name."""
        if self.provider is not None and name in (None, self.provider.name):
            return self.provider
        from petctl.providers import get_provider

        config = self.load_config()
        if name is None:
            config.require_setup()
        provider = get_provider(config, name)
        if name is None:
            self.provider = provider
        return provider


def current() -> CliContext:
    """This invocation's context (created on first use)."""
    return click.get_current_context().ensure_object(CliContext)


def load_config() -> PetctlConfig:
    return current().load_config()


def configured() -> str:
    return current().configured()


def provider_for(name: str | None = None) -> Provider:
    """The configured provider (or the one named): the CLI never branches on which one it is."""
    return current().provider_for(name)


def job_view(name: str) -> JobView:
    """The read side of job `name` on the configured provider."""
    from petctl.providers import job_view as open_view

    return open_view(provider_for(), name)
