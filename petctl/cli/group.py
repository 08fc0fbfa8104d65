"""The `petctl` group and its entry point: every error becomes one line.

Every `PetctlError` (and every usage error) becomes one line `error: ...` on stderr and a non-zero exit
code: scripts can rely on the status, people never see a traceback for a mistake of theirs. The
commands live in their own modules and get their provider from petctl.cli.context; this module only
gathers them.
"""

from __future__ import annotations

import os
import sys

import click

from petctl.cli import infra, insight, jobs, status, steer
from petctl.cli.context import CliContext
from petctl.core.errors import PetctlError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


def fail(message: str, code: int) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def main(argv: list[str] | None = None, obj: CliContext | None = None) -> None:
    """Console-script entry point: run the group, turn every error into one line. `obj` hands the
    commands a context of the caller's (a provider of its own, see petctl.cli.context)."""
    try:
        rv = cli.main(args=argv, prog_name="petctl", standalone_mode=False, obj=obj)
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
    except Exception as e:  # a bug: one line naming it, the traceback on request
        if os.environ.get("PETCTL_DEBUG"):
            raise
        fail(f"unexpected {type(e).__name__}: {e} (set PETCTL_DEBUG=1 for a traceback)", 1)
    sys.exit(rv if isinstance(rv, int) else 0)


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="petctl", message="petctl %(version)s")
def cli() -> None:
    """Elastic, fault-tolerant PyTorch training on EC2 spot capacity (or on this machine)."""


for _command in (*infra.COMMANDS, *jobs.COMMANDS, *status.COMMANDS, *steer.COMMANDS, *insight.COMMANDS):
    cli.add_command(_command)
