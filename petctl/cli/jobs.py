"""Commands that create, list, resize and end jobs: run_job, kill_job, jobs, scale."""

from __future__ import annotations

import time
from pathlib import Path

import click

from petctl.cli.context import job_view, provider_for
from petctl.cli.render import age, output_option, print_json, table
from petctl.core.errors import PetctlError
from petctl.core.spec import SPOT_STRATEGIES


def build_submission(name, min_size, max_size, size, nproc_per_node, max_restarts, env, timeout_items,
                     entrypoint, script: Path, args, instance_types, on_demand, on_demand_base, spot_strategy,
                     multi_az, warm_imports, keep, replace_delay, image=None, requirements=None):
    """The job as the command line describes it, validated before a provider is even loaded (its
    provider-specific options are checked against the provider later, in `Provider.validate`)."""
    from petctl.cli.parse import key_values, timeouts
    from petctl.core.spec import JobSpec, JobSubmission, Timeouts

    spec = JobSpec(name=name, min_size=min_size, max_size=max_size,
                   size=min_size if size is None else size, entrypoint=entrypoint or "", args=list(args),
                   nproc_per_node=nproc_per_node, max_restarts=max_restarts,
                   env=key_values(env, "--env"), timeouts=timeouts(timeout_items, Timeouts()),
                   instance_types=list(instance_types), on_demand=on_demand, on_demand_base=on_demand_base,
                   spot_strategy=spot_strategy, multi_az=multi_az, keep=keep, warm_imports=list(warm_imports))
    return JobSubmission(spec, script, replace_delay=replace_delay, image=image or "",
                         requirements=requirements).validate()


def wait_formed(provider, name: str, timeout: float) -> None:
    """Block until the job's first round is frozen (or it ended, or `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_view(name).state()
        if state.result is not None:
            raise PetctlError(f"job {name!r} ended before it formed: {state.result.state} "
                              f"({state.result.reason})")
        if state.ranks:
            round_no = state.round.round if state.round is not None else None
            click.echo(f"job {name} formed: round {round_no}, world size {state.world_size}")
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
@click.option("--replace-delay", type=float,
              help="Local: how long a replacement boots before its agent starts; billed from launch (the "
                   "first instances and scale-ups start at once).")
@click.option("--instance-type", "instance_types", multiple=True, help="Instance type (aws; repeatable).")
@click.option("--on-demand", is_flag=True, help="Use on-demand instead of spot capacity (aws).")
@click.option("--on-demand-base", type=int, default=0, help="On-demand instances before spot (aws).")
@click.option("--spot-strategy", type=click.Choice(SPOT_STRATEGIES), default=SPOT_STRATEGIES[0],
              show_default=True,
              help="Spot allocation strategy of a mixed-instances group (aws).")
@click.option("--multi-az", is_flag=True,
              help="Spread the job over every AZ (aws). Costly: all-reduce across AZs is billed per GB.")
@click.option("--image", metavar="URI",
              help="Run the agent in this linux/amd64 image from this region's ECR (aws; default: the Deep "
                   "Learning AMI's Python with this petctl installed).")
@click.option("--requirements", type=click.Path(path_type=Path), metavar="FILE",
              help="pip requirements the instances install next to petctl (aws, without --image).")
@click.option("--warm-import", "warm_imports", multiple=True, metavar="MODULE",
              help="A heavy module warm workers import ahead, so restarts skip it (repeatable).")
@click.option("--keep", is_flag=True,
              help="Keep the capacity when the job ends (debugging); by default it is released by itself.")
@click.option("--wait", is_flag=True,
              help="Return once the job is up, with progress: its first round formed (local), its first "
                   "agent joined (aws; boot failures shown as they happen, non-zero if the boot breaker "
                   "stops the job).")
@click.option("--wait-timeout", type=float, default=300.0, show_default=True)
@click.argument("script", type=click.Path(path_type=Path))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run_job(name, min_size, max_size, size, nproc_per_node, max_restarts, env, entrypoint, timeout_items,
            replace_delay, instance_types, on_demand, on_demand_base, spot_strategy, multi_az, image,
            requirements, warm_imports, keep, wait, wait_timeout, script, args):
    """Start an elastic job running SCRIPT (a file, or a directory with --entrypoint) -- ARGS."""
    from petctl.cli.parse import timeouts

    job = build_submission(name, min_size, max_size, size, nproc_per_node, max_restarts, env, timeout_items,
                           entrypoint, script, args, instance_types, on_demand, on_demand_base, spot_strategy,
                           multi_az, warm_imports, keep, replace_delay, image, requirements)
    provider = provider_for()
    # The provider's defaults (a networked etcd on AWS needs longer heartbeats than a LAN), then --timeout.
    job.spec.timeouts = timeouts(timeout_items, provider.default_timeouts())
    info = provider.create_job(provider.validate(job))
    click.echo(f"job {info.name} started: {info.desired} nodes (min {info.min_size}, max {info.max_size}); "
               f"follow it with `petctl status {info.name}`")
    if wait:
        from petctl.providers.capabilities import BootInsight

        if isinstance(provider, BootInsight):  # instances that boot: up once an agent joined
            from petctl.cli.bootview import wait_joined

            wait_joined(provider, name, wait_timeout)
        else:
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
    from petctl.jobview.summary import cost_text
    from petctl.providers.capabilities import Pricing

    provider = provider_for()
    infos = provider.jobs()
    costs = {}
    for i in infos:
        costs[i.name] = None
        if isinstance(provider, Pricing):
            try:
                view = job_view(i.name)
                costs[i.name] = view.cost(view.events(), running=i.state == "running")
            except PetctlError as e:  # a price lookup never hides the list of jobs: its cell says why
                click.echo(f"note: no cost for job {i.name}: {e}", err=True)
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
