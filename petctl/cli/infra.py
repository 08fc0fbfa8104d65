"""The infrastructure commands: setup, teardown and doctor."""

from __future__ import annotations

import click

from petctl.cli.context import configured, load_config, provider_for
from petctl.core.errors import PetctlError


class ChecksFailed(PetctlError):
    exit_code = 1


@click.command()
@click.option("--provider", "provider_name", type=click.Choice(["local", "aws"]), default="local",
              show_default=True, help="Where jobs get their capacity; remembered for later commands.")
@click.option("--region", help="aws: region (default: the AWS CLI's, e.g. AWS_REGION or the profile's).")
@click.option("--profile", help="aws: named profile from your AWS config.")
@click.option("--endpoint-url", help="aws: an emulator's endpoint (e.g. http://127.0.0.1:5000).")
@click.option("--etcd-nodes", metavar="N", help="aws: etcd members, 1 (default: one host that heals itself, "
              "etcd away while it is replaced) or 3 (one per AZ: any one can be lost without an outage; "
              "3x the etcd instances' cost).")
@click.option("--option", "options", multiple=True, metavar="KEY=VALUE",
              help="Provider-specific setup option (repeatable), e.g. stack_name=petctl, max_azs=3 (aws) or "
                   "agent_command='python my_agent.py {config}' (local).")
def setup(provider_name: str, region: str | None, profile: str | None, endpoint_url: str | None,
          etcd_nodes: str | None, options: tuple[str, ...]) -> None:
    """Create what all jobs share (local: an embedded etcd; aws: the CloudFormation stack)."""
    from petctl.cli.parse import key_values
    from petctl.core.errors import ValidationError

    flags = {k: v for k, v in (("region", region), ("profile", profile), ("endpoint_url", endpoint_url),
                                ("etcd_nodes", etcd_nodes)) if v is not None and v != ""}
    if flags and provider_name != "aws":
        raise ValidationError(f"--{next(iter(flags)).replace('_', '-')} is for `--provider aws`")
    if etcd_nodes is not None and etcd_nodes.strip() not in ("1", "3"):
        raise ValidationError(f"--etcd-nodes must be 1 or 3 (got {etcd_nodes!r})")
    config = load_config()
    provider = provider_for(provider_name)
    result = provider.setup(**{**key_values(options, "--option"), **flags})
    config.provider = provider_name
    config.save()
    endpoint = result.get("etcd_endpoint")
    click.echo(f"petctl is set up ({provider_name})" + (f": etcd at {endpoint}" if endpoint else ""))


@click.command()
@click.option("--force", is_flag=True, help="Kill running jobs instead of refusing.")
def teardown(force: bool) -> None:
    """Remove what `setup` created (refuses while jobs run unless --force)."""
    config = load_config()
    if not config.provider:
        click.echo("nothing to tear down")
        return
    provider_for(config.provider).teardown(force=force)
    click.echo(f"petctl torn down ({config.provider})")


@click.command()
@click.option("--provider", "provider_name", type=click.Choice(["local", "aws"]), default=None,
              help="Which provider to check (default: the configured one).")
@click.option("--probe", is_flag=True,
              help="aws: run two one-node probe jobs on your account and print a table of every contract "
                   "they prove (about half an hour, a few cents; docs/aws.md: Prove it on your account). "
                   "Needs `petctl setup --provider aws`; deletes what it made, also after Ctrl-C.")
@click.option("--instance-type", metavar="TYPE",
              help="--probe: the probe jobs' instance type (default: a small x86_64 type, "
                   "t3.medium).")
def doctor(provider_name: str | None, probe: bool, instance_type: str | None) -> None:
    """Check what a job needs before it runs (aws: credentials, base stack, spot vCPU quotas, AMI, worker
    image in ECR, your permissions). One line per check: OK, FAIL or SKIP (the endpoint lacks that API)
    with the reason; exits 1 when any check fails. With --probe (aws), run probe jobs instead and print
    each contract as held, broken (with AWS's error), needs AWS (an emulator cannot show it) or not
    reached; exits 1 unless every one held or needs AWS."""
    from petctl.providers.base import Check
    from petctl.providers.capabilities import Diagnostics

    if probe or instance_type is not None:
        run_probe(provider_name, probe, instance_type)
        return
    provider = provider_for(provider_name or configured() or "local")
    if isinstance(provider, Diagnostics):
        checks = provider.doctor()
    else:
        checks = [Check("provider", "SKIP", f"no checks for the {provider.name} provider")]
    for check in checks:
        click.echo(check.line())
    failed = [c for c in checks if c.status == "FAIL"]
    if failed:
        raise ChecksFailed(f"{len(failed)} of {len(checks)} checks failed")


def run_probe(provider_name: str | None, probe: bool, instance_type: str | None) -> None:
    """`doctor --probe`: the input checked with no AWS call, then petctl/providers/aws/probe.py."""
    from petctl.core.errors import ValidationError

    if not probe:
        raise ValidationError("--instance-type is for `doctor --probe`")
    name = provider_name or configured() or "local"
    if name != "aws":
        raise ValidationError(f"--probe is for `--provider aws` (not {name})")
    from petctl.providers.aws import probe as probing
    from petctl.providers.aws.capacity import validate_instance_types

    (checked,) = validate_instance_types([instance_type or probing.DEFAULT_TYPE])
    provider = provider_for("aws")
    provider.require_ready()  # NotSetUp, one line, before anything is made
    plan = probing.Plan(instance_type=checked)
    observations, cost, elapsed = probing.run(provider, plan, provider.progress)
    results = probing.verdicts(observations)
    for line in probing.render(results, elapsed, cost):
        click.echo(line)
    if observations.interrupted:
        raise KeyboardInterrupt  # one line "interrupted", exit 130 (petctl.cli.group)
    if not probing.passed(results):
        bad = [v for v in results if v.status not in (probing.HELD, probing.NEEDS_AWS)]
        raise ChecksFailed(f"{len(bad)} of {len(results)} contracts did not hold: "
                           + ", ".join(v.contract for v in bad))


COMMANDS = (setup, teardown, doctor)
