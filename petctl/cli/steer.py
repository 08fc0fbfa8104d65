"""Commands that look at and poke a running job's instances: hosts, logs, chaos."""

from __future__ import annotations

import json

import click

from petctl.cli.context import job_view, provider_for
from petctl.cli.render import age, output_option, print_json, table
from petctl.cli.status import echo_activities
from petctl.core.errors import PetctlError


@click.command("hosts")
@click.argument("name")
@click.option("--all", "show_all", is_flag=True, help="Include terminated instances.")
@output_option
def hosts(name: str, show_all: bool, output: str) -> None:
    """The job's instances as the provider sees them, with their rank in the current round."""
    from petctl.providers.capabilities import CapacityInsight

    provider = provider_for()
    infos = provider.hosts(name)
    try:
        ranks = job_view(name).state().ranks
    except PetctlError as e:  # the instance list is still worth showing without ranks
        click.echo(f"note: no ranks: {e}", err=True)
        ranks = {}
    for h in infos:
        h.rank = ranks.get(h.host_id)
    if not show_all:
        infos = [h for h in infos if h.state != "terminated"]
    if output == "json":
        print_json([h.to_dict() for h in infos])
        return
    table(None, ["host", "state", "rank", "age", "type", "market", "zone", "address"],
          [[h.host_id, h.state, h.rank, age(h.launched_at), h.instance_type, h.market, h.az, h.private_ip]
           for h in infos])
    if isinstance(provider, CapacityInsight):
        echo_activities(provider.scaling_activities(name))


@click.command("logs")
@click.argument("name")
@click.option("--node", help="One node's log (an instance id, or `reconciler`).")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until the job ends.")
@output_option
def logs(name: str, node: str | None, follow: bool, output: str) -> None:
    """Print the job's node logs (each line prefixed with its node unless --node is given).

    `-o json` prints one object per line, {"node", "text"}, and the event itself when the line is one.
    """
    from petctl.core.eventlog import parse_line

    for line in job_view(name).logs(node=node, follow=follow):
        if output != "json":
            click.echo(line)
            continue
        source, text = node, line
        if node is None and line.startswith("[") and "] " in line:
            source, text = line[1:].split("] ", 1)
        record = {"node": source, "text": text}
        event = parse_line(text)
        if event is not None:
            record["event"] = event
        click.echo(json.dumps(record, default=str))


@click.command("chaos")
@click.argument("name")
@click.option("--node", help="Instance to take away (default: the highest-ranked one in the current round "
                              "that has no pending notice).")
@click.option("--kill", "mode", flag_value="kill", help="SIGKILL the instance (the host vanished).")
@click.option("--freeze", "mode", flag_value="freeze", help="SIGSTOP the instance (the host hangs).")
@click.option("--unfreeze", "mode", flag_value="unfreeze", help="SIGCONT a frozen instance.")
@click.option("--term", "mode", flag_value="term", help="SIGTERM the agent (a graceful leave).")
@click.option("--notice", "mode", flag_value="notice",
              help="A spot interruption notice; the instance is reclaimed after --grace.")
@click.option("--rebalance", "mode", flag_value="rebalance",
              help="A rebalance recommendation: the job checkpoints at once; a replacement is launched, "
                   "and once it is in service the instance gets a scale-in notice (reclaimed after "
                   "--grace).")
@click.option("--grace", type=float, default=10.0, show_default=True,
              help="Seconds between a --notice (or --rebalance's scale-in notice) and the reclaim.")
@click.option("--trace", "trace_file", type=click.Path(dir_okay=False),
              help="Replay a spot trace (JSON, see bench/traces/): notices, silent losses, rebalance "
                   "recommendations, capacity delays and outages at their (scaled) times.")
def chaos(name: str, node: str | None, mode: str | None, grace: float, trace_file: str | None) -> None:
    """Take one instance of a job away, to see it recover (tests, demos, benchmarks)."""
    from petctl.providers.capabilities import check_chaos_mode

    if trace_file is not None:
        _replay_trace(name, trace_file, mode, node)
        return
    if mode is None:
        raise click.UsageError("choose one of --kill, --freeze, --unfreeze, --term, --notice, --rebalance, "
                               "or --trace FILE")
    host = check_chaos_mode(provider_for(), mode).terminate_host(name, node, mode=mode, grace=grace)
    click.echo(f"{mode}: {host}")


def _replay_trace(name: str, trace_file: str, mode: str | None, node: str | None) -> None:
    from petctl.core.errors import PetctlError
    from petctl.core.spottrace import Trace
    from petctl.providers.capabilities import check_chaos_mode
    from petctl.providers.tracereplay import replay

    if mode is not None or node is not None:
        raise click.UsageError("--trace picks its own instances and modes: drop --node and the mode flag")
    try:
        text = open(trace_file, encoding="utf-8").read()
    except OSError as e:
        raise PetctlError(f"cannot read trace {trace_file}: {e.strerror or e}") from None
    trace = Trace.from_json(text, trace_file)
    provider = provider_for()
    for needed in ("notice", "kill", "rebalance"):
        check_chaos_mode(provider, needed)
    click.echo(f"replaying {trace.name}: {trace.counts()} over {trace.replay_seconds():.0f}s "
               f"(x{trace.time_scale:g} simulated)")
    skipped = replay(provider, name, trace, echo=click.echo)
    click.echo(f"trace done: {len(trace.events)} events, {skipped} actions skipped")


COMMANDS = (hosts, logs, chaos)
