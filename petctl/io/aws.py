"""The one place petctl builds boto3 sessions and clients, plus AWS errors in user terms.

Region and profile follow the CLI's conventions (flags first, then AWS_PROFILE / AWS_REGION /
AWS_DEFAULT_REGION and ~/.aws/config); an endpoint URL (an emulator such as moto) is just configuration
(`AWS_ENDPOINT_URL`, which boto3 also honours per service).

Every client is built with a named retry profile (`RETRY_PROFILES`), chosen for what a failure costs
where it is used, as SkyPilot's adaptors do: the CLI waits out throttling, an agent's control call must
not stall its loop, data transfers ride out a slow S3 prefix, a probe's failure is itself the answer.
boto3 is imported here lazily so `import petctl` never pays for it; nothing else in petctl imports it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from petctl.core.errors import NotSetUp, ObjectStoreError, PetctlError, ProviderError, ValidationError

THROTTLING = {"Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
              "SlowDown", "RequestThrottled", "PriorRequestNotComplete"}
BAD_CREDENTIALS = {"InvalidClientTokenId", "UnrecognizedClientException", "AuthFailure", "ExpiredToken",
                   "ExpiredTokenException", "SignatureDoesNotMatch", "InvalidAccessKeyId"}
NO_REGION = "no AWS region: pass --option region=REGION, set AWS_REGION, or set one in the profile"
NO_CREDENTIALS_HINT = ("set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, run `aws configure` "
                       "or `aws sso login`, or pass --option profile=NAME")


@dataclass(frozen=True)
class RetryProfile:
    """botocore retry and timeout settings for one kind of caller."""

    mode: str
    max_attempts: int
    connect_timeout: float = 60.0
    read_timeout: float = 60.0

    def config(self, region: str = "", max_pool_connections: int = 10):
        """botocore's Config; `max_pool_connections` above its default of 10 for parallel transfers."""
        from botocore.config import Config

        return Config(region_name=region or None, user_agent_extra="petctl",
                      retries={"mode": self.mode, "max_attempts": self.max_attempts},
                      connect_timeout=self.connect_timeout, read_timeout=self.read_timeout,
                      max_pool_connections=max_pool_connections)


RETRY_PROFILES: dict[str, RetryProfile] = {
    # The CLI: long stack waits and bursts of describes; adaptive retries back off under throttling.
    "cli": RetryProfile("adaptive", 10),
    # An agent's control calls (lifecycle hooks, scaling to 0): short, so a stuck call never stalls the
    # agent's loop past a spot notice's two minutes.
    "agent": RetryProfile("standard", 3, connect_timeout=5, read_timeout=10),
    # Checkpoint and log transfers: ride out S3's 503 SlowDown on a hot prefix.
    "data": RetryProfile("standard", 5, connect_timeout=10, read_timeout=60),
    # `petctl doctor`: one retry; a failure is the answer being sought.
    "probe": RetryProfile("standard", 2, connect_timeout=5, read_timeout=10),
}


def client(service: str, profile: str = "agent", region: str = "", endpoint_url: str = "",
           max_pool_connections: int = 10):
    """A boto3 client outside a CLI session (agents, workers): region and credentials from the
    environment or the instance profile; `endpoint_url` (or AWS_ENDPOINT_URL) for an emulator.
    Raises KeyError for an unknown profile name."""
    import boto3

    retry = RETRY_PROFILES[profile]
    return boto3.session.Session().client(service, config=retry.config(region, max_pool_connections),
                                          endpoint_url=endpoint_url or None)


@dataclass
class AwsSession:
    """A region-bound boto3 session with clients built on demand (and cached per service)."""

    region: str
    profile: str = ""
    endpoint_url: str = ""
    _session: Any = None
    _clients: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(cls, region: str = "", profile: str = "", endpoint_url: str = "") -> AwsSession:
        import boto3
        from botocore.exceptions import ProfileNotFound

        try:
            session = boto3.Session(profile_name=profile or None, region_name=region or None)
        except ProfileNotFound:
            raise NotSetUp(f"AWS profile {profile!r} not found in ~/.aws/config or "
                           "~/.aws/credentials") from None
        region = region or session.region_name or ""
        if not region:
            raise ValidationError(NO_REGION)
        check_region(session, region)
        if session.get_credentials() is None:
            raise NotSetUp(f"no AWS credentials found: {NO_CREDENTIALS_HINT}")
        endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL", "")
        return cls(region=region, profile=profile, endpoint_url=endpoint_url, _session=session)

    def client(self, service: str, region: str = "", profile: str = "cli"):
        """A cached client; `region` for the few global-ish APIs (pricing: us-east-1); `profile` names
        the retry profile (`probe` for petctl doctor, whose failures are answers)."""
        key = f"{service}@{region or self.region}#{profile}"
        if key not in self._clients:
            config = RETRY_PROFILES[profile].config(region or self.region)
            self._clients[key] = self._session.client(service, config=config,
                                                      endpoint_url=self.endpoint_url or None)
        return self._clients[key]


def known_regions(session) -> set[str]:
    regions: set[str] = set()
    for partition in session.get_available_partitions():
        regions.update(session.get_available_regions("ec2", partition_name=partition))
    return regions


def check_region(session, region: str) -> None:
    """Fail fast on a typo: botocore would otherwise try to resolve a host that does not exist."""
    regions = known_regions(session)
    if regions and region not in regions:
        close = sorted(r for r in regions if r.split("-")[0] == region.split("-")[0])[:6]
        hint = f" (did you mean one of: {', '.join(close)}?)" if close else ""
        raise ValidationError(f"unknown AWS region {region!r}{hint}")


def error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def error_message(exc: BaseException) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Message", "")) or str(exc)


@contextlib.contextmanager
def aws_errors(action: str) -> Iterator[None]:
    """Turn botocore failures (and the object store's, which carry the AWS error code) into one-line
    `PetctlError`s naming what petctl was doing."""
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        EndpointConnectionError,
        NoCredentialsError,
        NoRegionError,
        PartialCredentialsError,
    )


    try:
        yield
    except PetctlError:
        raise
    except (NoCredentialsError, PartialCredentialsError):
        raise NotSetUp(f"no AWS credentials found while trying to {action}: {NO_CREDENTIALS_HINT}") from None
    except NoRegionError:
        raise ValidationError(NO_REGION) from None
    except EndpointConnectionError as exc:
        raise ProviderError(f"cannot reach AWS to {action}: {exc}") from None
    except ClientError as exc:
        raise coded_error(action, error_code(exc), error_message(exc)) from None
    except ObjectStoreError as exc:  # the object store's wrapping of one of the above: judged by its cause
        cause = exc.__cause__
        if isinstance(cause, (NoCredentialsError, PartialCredentialsError)):
            raise NotSetUp(f"no AWS credentials found while trying to {action}: "
                           f"{NO_CREDENTIALS_HINT}") from None
        if isinstance(cause, ClientError):
            raise coded_error(action, error_code(cause), error_message(cause)) from None
        raise ProviderError(f"failed to {action}: {exc}") from None
    except BotoCoreError as exc:
        raise ProviderError(f"failed to {action}: {exc}") from None





def coded_error(action: str, code: str, message: str) -> PetctlError:
    """The user-facing error for an AWS error code met while trying to `action`."""
    if code in THROTTLING:
        return ProviderError(f"AWS is throttling requests ({code}) while trying to {action}, even after "
                             "adaptive retries: wait a minute and run the command again")
    if code in BAD_CREDENTIALS:
        return NotSetUp(f"AWS rejected the credentials ({code}) while trying to {action}: "
                        f"{NO_CREDENTIALS_HINT}")
    if code in {"AccessDenied", "AccessDeniedException", "UnauthorizedOperation"}:
        return ProviderError(f"AWS denied permission to {action}: {message}")
    return ProviderError(f"failed to {action}: {code}: {message}")


# botocore's exception classes, importable from here (`from petctl.io.aws import ClientError`) and
# resolved on first use, so callers catch them without importing botocore (only this layer does) and
# without paying for it at import time.
_BOTOCORE_EXCEPTIONS = {"ClientError": "botocore.exceptions", "BotoCoreError": "botocore.exceptions",
                        "ResponseParserError": "botocore.parsers"}


def __getattr__(name: str) -> Any:
    module = _BOTOCORE_EXCEPTIONS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)

