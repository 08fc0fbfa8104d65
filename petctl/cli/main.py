"""The `petctl` command group, error handling and the infrastructure commands (setup, teardown).

Every `PetctlError` (and every usage error) becomes one line `error: ...` on stderr and a non-zero exit
code: scripts can rely on the status, people never see a traceback for a mistake of theirs.
"""

from __future__ import annotations

import os
import sys

import click

from petctl.core.errors import PetctlError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


def fail(message: str, code: int) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the group, turn every error into one line."""
    try:
        rv = cli.main(args=argv, prog_name="petctl", standalone_mode=False)
    except PetctlError as e:
        fail(str(e), e.exit_code)
    except click.UsageError as e:
        hint = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
        fail(f"{e.format_message()}{hint}", e.exit_code)
    except click.ClickException as e:
        fail(e.format_message(), e.exit_code)
    except (click.Abort, KeyboardInterrupt):
        fail("interrupted", 130)
    except BrokenPipeError:
        sys.exit(0)
    except Exception as e:
        if os.environ.get("PETCTL_DEBUG"):
            raise
        fail(f"unexpected {type(e).__name__}: {e} (set PETCTL_DEBUG=1 for a traceback)", 1)
    sys.exit(rv if isinstance(rv, int) else 0)


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="petctl", message="petctl %(version)s")
def cli() -> None:
    """Elastic, fault-tolerant PyTorch training on EC2 spot capacity (or on this machine)."""


def load_config():
    from petctl.core.config import PetctlConfig

    return PetctlConfig.load()


def provider_for(config=None, name: str | None = None):
    """The configured provider (the CLI never branches on which one it is)."""
    from petctl.providers import get_provider

    config = config or load_config()
    if name is None:
        config.require_setup()
    return get_provider(config, name)


@cli.command()
@click.option("--provider", "provider_name", type=click.Choice(["local", "aws"]), default="local",
              show_default=True, help="Where jobs get their capacity; remembered for later commands.")
@click.option("--region", help="aws: region (default: the AWS CLI's, e.g. AWS_REGION or the profile's).")
@click.option("--profile", help="aws: named profile from your AWS config.")
@click.option("--endpoint-url", help="aws: an emulator's endpoint (e.g. http://127.0.0.1:5000).")
@click.option("--option", "options", multiple=True, metavar="KEY=VALUE",
              help="Provider-specific setup option (repeatable), e.g. stack_name=petctl, max_azs=3.")
def setup(provider_name: str, region: str | None, profile: str | None, endpoint_url: str | None,
          options: tuple[str, ...]) -> None:
    """Create what all jobs share (local: an embedded etcd; aws: the CloudFormation stack)."""
    from petctl.cli.parse import key_values
    from petctl.core.errors import ValidationError

    flags = {k: v for k, v in (("region", region), ("profile", profile), ("endpoint_url", endpoint_url)) if v}
    if flags and provider_name != "aws":
        raise ValidationError(f"--{next(iter(flags)).replace('_', '-')} is for `--provider aws`")
    config = load_config()
    provider = provider_for(config, provider_name)
    result = provider.setup(**{**key_values(options, "--option"), **flags})
    config.provider = provider_name
    config.save()
    endpoint = result.get("etcd_endpoint")
    click.echo(f"petctl is set up ({provider_name})" + (f": etcd at {endpoint}" if endpoint else ""))


@cli.command()
@click.option("--force", is_flag=True, help="Kill running jobs instead of refusing.")
def teardown(force: bool) -> None:
    """Remove what `setup` created (refuses while jobs run unless --force)."""
    config = load_config()
    if not config.provider:
        click.echo("nothing to tear down")
        return
    provider_for(config, config.provider).teardown(force=force)
    click.echo(f"petctl torn down ({config.provider})")


@cli.command()
@click.option("--provider", "provider_name", type=click.Choice(["local", "aws"]), default=None,
              help="Which provider to check (default: the configured one).")
def doctor(provider_name: str | None) -> None:
    """Check what a job needs before it runs (aws: credentials, base stack, spot vCPU quotas, AMI, worker
    image in ECR, your permissions). One line per check: OK, FAIL or SKIP (the endpoint lacks that API)
    with the reason; exits 1 when any check fails."""
    config = load_config()
    checks = provider_for(config, provider_name or config.provider or "local").doctor()
    for check in checks:
        click.echo(check.line())
    failed = [c for c in checks if c.status == "FAIL"]
    if failed:
        fail(f"{len(failed)} of {len(checks)} checks failed", 1)


def _register() -> None:
    from petctl.cli import insight, jobs, steer

    for command in (*jobs.COMMANDS, *steer.COMMANDS, *insight.COMMANDS):
        cli.add_command(command)


_register()
