"""The `petctl` command line. Importing it stays cheap (click only): providers, etcd, rich and boto3 are
imported inside the commands that need them, so `petctl --help` is instant."""

from petctl.cli.main import cli, main

__all__ = ["cli", "main"]
