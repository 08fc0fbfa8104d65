"""The `petctl` command line: the group in group.py, the commands in their modules. Importing it stays
cheap (click only): providers, etcd, rich and boto3 are imported inside the commands that need them, so
`petctl --help` is instant.

`main` (the console script) puts the dataclass method cache in before it imports the commands, so what
`dataclasses` compiled at one run is not compiled again at the next (petctl/io/methodcache.py). Importing
`cli` from here leaves the cache out: tests and embedders get plain imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from petctl.cli.context import CliContext

__all__ = ["cli", "main"]


def main(argv: list[str] | None = None, obj: CliContext | None = None) -> None:
    """Console-script entry point (see petctl.cli.group.main): exits with the command's code."""
    from petctl.io import methodcache

    methodcache.install("cli")
    from petctl.cli.group import main as run_cli

    try:
        run_cli(argv, obj)
    finally:
        methodcache.save()  # what this command compiled, for the next run


def __getattr__(name: str) -> Any:
    if name == "cli":
        from petctl.cli.group import cli

        return cli
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
