"""Commands that create, list, resize and end jobs: run_job, kill_job, jobs, scale."""

from __future__ import annotations

import inspect
import time
from pathlib import Path

import click

from petctl.cli.main import provider_for
from petctl.cli.render import age, output_option, print_json, table
from petctl.core.errors import PetctlError, ValidationError


def build_spec(name, min_size, max_size, size, nproc_per_node, max_restarts, env, timeout_items,
               entrypoint, script: Path, args, instance_types, on_demand, on_demand_base, keep=False,
               warm_imports=(), multi_az=False):
    """The job's spec from the command line, validated before anything is touched."""
    from petctl.cli.parse import key_values, timeouts
    from petctl.core.spec import JobSpec, Timeouts

    spec = JobSpec(name=name, min_size=min_size, max_size=max_size,
                   size=min_size if size is None else size, entrypoint="", args=list(args),
                   nproc_per_node=nproc_per_node, max_restarts=max_restarts,
                   env=key_values(env, "--env"), timeouts=timeouts(timeout_items, Timeouts()),
                   instance_types=list(instance_types), on_demand=on_demand, on_demand_base=on_demand_base,
                   keep=keep, warm_imports=list(warm_imports), multi_az=multi_az)
    spec.validate()
    if not script.exists():
        raise ValidationError(f"script not found: {script}")
    if script.is_dir():
        if not entrypoint:
            raise ValidationError(f"{script} is a directory: name the file to run with --entrypoint")
        if not (script / entrypoint).is_file():
            raise ValidationError(f"entrypoint {entrypoint!r} not found in {script}")
        spec.entrypoint = entrypoint
    else:
        if entrypoint:
            raise ValidationError("--entrypoint is only for a directory SCRIPT")
        spec.entrypoint = script.name
    return spec


def wait_formed(provider, name: str, timeout: float) -> None:
    """Block until the job's first round is frozen (or it ended, or `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = provider.node_states(name)
        if state.result:
            raise PetctlError(f"job {name!r} ended before it formed: {state.result.get('state')} "
                              f"({state.result.get('reason', '')})")
        if state.ranks:
            click.echo(f"job {name} formed: round {state.round.get('round')}, world size {state.world_size}")
            return
        if provider.job(name).state != "running":
            raise PetctlError(f"job {name!r} stopped before it formed (see `petctl logs {name}`)")
        time.sleep(0.3)
    raise PetctlError(f"job {name!r} did not form within {timeout:.0f}s (see `petctl logs {name}`)")


@click.command("run_job")
@click.option("--name", required=True, help="Job name (lowercase letters, digits, '-').")
@click.option("--min", "min_size", type=int, required=True, help="Fewest nodes the job runs with.")
@click.option("--max", "max_size", type=int, required=True, help="Most nodes the job admits.")
@click.option("--size", type=int, help="Nodes to start with (default: --min).")
@click.option("--nproc-per-node", type=int, default=1, show_default=True, help="Workers per node.")
@click.option("--max-restarts", type=int, default=3, show_default=True,
              help="Worker failures tolerated before the job fails (membership changes do not count).")
@click.option("--env", multiple=True, metavar="KEY=VALUE", help="Environment for the workers (repeatable).")
@click.option("--entrypoint", help="The file to run when SCRIPT is a directory.")
@click.option("--timeout", "timeout_items", multiple=True, metavar="NAME=SECONDS",
              help="Override an agent timeout, e.g. heartbeat_ttl=2 (repeatable).")
@click.option("--replace-delay", type=float, help="Seconds before a lost instance is replaced (local).")
@click.option("--instance-type", "instance_types", multiple=True, help="Instance type (aws; repeatable).")
@click.option("--on-demand", is_flag=True, help="Use on-demand instead of spot capacity (aws).")
@click.option("--on-demand-base", type=int, default=0, help="On-demand instances before spot (aws).")
@click.option("--spot-strategy", type=click.Choice(["price-capacity-optimized", "capacity-optimized"]),
              default="price-capacity-optimized", show_default=True,
              help="Spot allocation strategy of a mixed-instances group (aws).")
@click.option("--multi-az", is_flag=True,
              help="Spread the job over every AZ (aws). Costly: all-reduce across AZs is billed per GB.")
@click.option("--warm-import", "warm_imports", multiple=True, metavar="MODULE",
              help="A heavy module warm workers import ahead, so restarts skip it (repeatable).")
@click.option("--keep", is_flag=True,
              help="Keep the capacity when the job ends (debugging); by default it is released by itself.")
@click.option("--wait", is_flag=True, help="Return once the first round has formed.")
@click.option("--wait-timeout", type=float, default=300.0, show_default=True)
@click.argument("script", type=click.Path(path_type=Path))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run_job(name, min_size, max_size, size, nproc_per_node, max_restarts, env, entrypoint, timeout_items,
            replace_delay, instance_types, on_demand, on_demand_base, spot_strategy, multi_az, warm_imports,
            keep, wait, wait_timeout, script, args):
    """Start an elastic job running SCRIPT (a file, or a directory with --entrypoint) -- ARGS."""
    from petctl.cli.parse import timeouts

    spec = build_spec(name, min_size, max_size, size, nproc_per_node, max_restarts, env, timeout_items,
                      entrypoint, script, args, instance_types, on_demand, on_demand_base, keep, warm_imports,
                      multi_az=multi_az)
    spec.spot_strategy = spot_strategy
    provider = provider_for()
    # The provider's defaults (a networked etcd on AWS needs longer heartbeats than a LAN), then --timeout.
    spec.timeouts = timeouts(timeout_items, provider.default_timeouts())
    extra = {}
    if replace_delay is not None:
        if "replace_delay" not in inspect.signature(provider.create_job).parameters:
            raise ValidationError(f"--replace-delay is not supported by the {provider.name} provider")
        extra["replace_delay"] = replace_delay
    info = provider.create_job(spec, script, **extra)
    click.echo(f"job {info.name} started: {info.desired} nodes (min {info.min_size}, max {info.max_size}); "
               f"follow it with `petctl status {info.name}`")
    if wait:
        wait_formed(provider, name, wait_timeout)


@click.command("kill_job")
@click.argument("name")
def kill_job(name: str) -> None:
    """End a job and delete its capacity (and only it)."""
    provider = provider_for()
    before = provider.job(name).state
    provider.kill_job(name)
    final = before in ("succeeded", "failed", "killed")
    click.echo(f"job {name} was already {before}" if final else f"job {name} killed")


@click.command("jobs")
@output_option
def jobs(output: str) -> None:
    """List jobs."""
    from petctl.jobsummary import cost_text

    provider = provider_for()
    infos = provider.jobs()
    costs = {}
    for i in infos:
        try:
            events = provider.job_events(i.name)
            costs[i.name] = provider.cost(i.name, events, time.time() if i.state == "running" else None)
        except Exception:  # a price lookup never hides the list of jobs
            costs[i.name] = None
    if output == "json":
        print_json([{**i.to_dict(), "cost": c.to_dict() if (c := costs[i.name]) else None} for i in infos])
        return
    if not infos:
        click.echo("no jobs (start one with `petctl run_job`)")
        return
    table(None, ["job", "state", "desired", "min", "max", "age", "cost", "reason"],
          [[i.name, i.state, i.desired, i.min_size, i.max_size, age(i.created_at),
            cost_text(c.to_dict()) if (c := costs[i.name]) else "-", i.reason] for i in infos])


@click.command("scale")
@click.argument("name")
@click.option("--size", type=int, required=True, help="New desired node count, within [min, max].")
def scale(name: str, size: int) -> None:
    """Change a running job's desired node count."""
    provider_for().scale(name, size)
    click.echo(f"job {name}: desired size {size}")


COMMANDS = (run_job, kill_job, jobs, scale)
