"""Commands that look at and poke a running job: status, hosts, logs, chaos."""

from __future__ import annotations

import json
from typing import Any

import click

from petctl.cli.main import provider_for
from petctl.cli.render import age, output_option, print_json, status_summary, table


def job_status(provider, name: str) -> dict[str, Any]:
    """What `status -o json` prints: the provider's view of the job plus the agents' (etcd)."""
    info = provider.job(name)
    state = provider.node_states(name)
    data = state.to_dict()
    result = state.result or {}
    final = info.state in ("succeeded", "failed", "killed")
    data.update(
        state=info.state if final else state.state,
        reason=result.get("reason") or info.reason,
        desired=info.desired, min_size=info.min_size, max_size=info.max_size,
        ranks=state.ranks,
        round_no=(state.round or {}).get("round"),
        restarts=(state.round or {}).get("restarts"),
    )
    return data


@click.command("status")
@click.argument("name")
@output_option
def status(name: str, output: str) -> None:
    """A job's state and its nodes: rank, world size, round, restarts, state, step."""
    from petctl.jobsummary import one_line, summarize

    provider = provider_for()
    data = job_status(provider, name)
    data["accounting"] = summarize(provider, name, running=data["state"] not in ("succeeded", "failed",
                                                                                "killed"))
    data["scaling_activities"] = provider.scaling_activities(name)
    if output == "json":
        print_json(data)
        return
    click.echo(status_summary(data))
    click.echo(one_line(data["accounting"]))
    echo_activities(data["scaling_activities"])
    ranks = data["ranks"]
    nodes = sorted(data["nodes"].values(),
                   key=lambda n: (ranks.get(n.get("node_id"), 1 << 30), str(n.get("node_id"))))
    if not nodes:
        click.echo("no live nodes" if data["state"] not in ("succeeded", "failed", "killed")
                   else "the job is over; its node logs: `petctl logs " + name + "`")
        return
    # A script that reports no steps: "n/a" (the one-line summary above says why), not a bare "-".
    no_step = None if data["accounting"].get("steps_reported", True) else "n/a"
    table(None, ["node", "rank", "world size", "round", "restarts", "state", "step", "checkpoint"],
          [[n.get("node_id"), n.get("rank"), n.get("world_size"), n.get("round"), n.get("restarts"),
            n.get("state"), n.get("step", no_step) if n.get("step") is not None else no_step,
            checkpoint_step(n.get("last_checkpoint"))] for n in nodes])


def echo_activities(lines: list[str]) -> None:
    """The capacity's recent scaling activities (why instances launch or not), newest first."""
    if lines:
        click.echo("scaling activities (newest first):")
        for line in lines:
            click.echo(f"  {line}")


def checkpoint_step(value: Any) -> Any:
    """The agent publishes {"step", "url"}; the table shows the step."""
    return value.get("step") if isinstance(value, dict) else value


@click.command("hosts")
@click.argument("name")
@click.option("--all", "show_all", is_flag=True, help="Include terminated instances.")
@output_option
def hosts(name: str, show_all: bool, output: str) -> None:
    """The job's instances as the provider sees them, with their rank in the current round."""
    provider = provider_for()
    infos = provider.hosts(name)
    try:
        ranks = provider.node_states(name).ranks
    except Exception:  # the instance list is still worth showing without ranks
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

    for line in provider_for().logs(name, node=node, follow=follow):
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
@click.option("--grace", type=float, default=10.0, show_default=True,
              help="Seconds between a --notice and the reclaim.")
def chaos(name: str, node: str | None, mode: str | None, grace: float) -> None:
    """Take one instance of a job away, to see it recover (tests, demos, benchmarks)."""
    if mode is None:
        raise click.UsageError("choose one of --kill, --freeze, --unfreeze, --term, --notice")
    host = provider_for().terminate_host(name, node, mode=mode, grace=grace)
    click.echo(f"{mode}: {host}")


COMMANDS = (status, hosts, logs, chaos)
