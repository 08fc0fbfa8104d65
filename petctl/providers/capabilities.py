"""What only some providers can do, as capabilities the CLI checks (`isinstance`), never sniffs.

A provider has a capability by implementing its methods (the protocols are runtime-checkable); a command
that needs one it lacks fails with one line naming the provider (`require`). Kept apart from the
`Provider` interface, which is capacity only, so a new provider implements what it can and no more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from petctl.core.errors import ProviderError

if TYPE_CHECKING:
    from petctl.core.boots import BootReport
    from petctl.jobview.cost import Prices
    from petctl.providers.base import Check, Provider

C = TypeVar("C")


@runtime_checkable
class Chaos(Protocol):
    """Taking an instance away on purpose, to see the job recover (tests, demos, benchmarks)."""

    chaos_modes: tuple[str, ...]  # of: kill | freeze | unfreeze | term | notice | rebalance

    def terminate_host(self, name: str, host_id: str | None, mode: str = "kill", grace: float = 0.0) -> str:
        """Take one instance of job `name` away (`host_id`, or the provider's default pick); return its id.
        Raises ProviderError for a mode the provider lacks, PetctlError when no instance fits."""
        ...


@runtime_checkable
class Pricing(Protocol):
    """Prices for the job's instance hours (the read side computes the cost)."""

    def prices(self) -> Prices:
        """The provider's price source. Raises PetctlError when it cannot be reached."""
        ...


@runtime_checkable
class Diagnostics(Protocol):
    """Checks of what a job needs before it runs (quotas, images, permissions)."""

    def doctor(self) -> list[Check]: ...


@runtime_checkable
class CapacityInsight(Protocol):
    """Why capacity is (not) arriving, in the provider's own terms."""

    def scaling_activities(self, name: str) -> list[str]:
        """The job's recent scaling activities, newest first, one line each."""
        ...


@runtime_checkable
class BootInsight(Protocol):
    """How the job's instances boot (launching, booting, installing, joined, failed), and the boot
    breaker's view of them (petctl/core/boots.py): for `status` and `run_job --wait`."""

    def boots(self, name: str) -> BootReport:
        """The job's boot report. Raises PetctlError when its records cannot be read."""
        ...


def require(provider: Provider, capability: type[C], what: str) -> C:
    """`provider` as `capability`, or ProviderError: "the local provider cannot <what>"."""
    if not isinstance(provider, capability):
        raise ProviderError(f"the {provider.name} provider cannot {what}")
    return provider


def check_chaos_mode(provider: Provider, mode: str) -> Chaos:
    """`provider` as `Chaos`, once it is known to support `mode`. Raises ProviderError otherwise."""
    chaos = require(provider, Chaos, "take instances away (chaos)")
    if mode not in chaos.chaos_modes:
        raise ProviderError(f"chaos mode {mode!r} is not supported on {provider.name}: only "
                            f"{', '.join(chaos.chaos_modes)}")
    return chaos
