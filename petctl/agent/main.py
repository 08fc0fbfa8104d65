"""`petctl-agent --config agent.json`: the process every instance runs.

Kept on argparse and the stdlib so it starts fast and carries nothing it does not need; the config is a
file path or an s3:// URL (the job's S3 prefix on AWS), never values baked into the image.

Never a silent death: an unexpected error emits one `agent.crashed` event (its `error` one line, its
`traceback` the last lines of the formatted exception; the whole traceback also goes to the node log) and
the process exits with `EXIT_CRASHED`. On AWS systemd does not restart an agent that exited with it
(RestartPreventExitStatus, worker_boot.sh.j2): the instance is marked unhealthy at once and replaced.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from petctl.io import methodcache

if TYPE_CHECKING:
    from petctl.core.spec import AgentConfig

# EX_SOFTWARE: the agent itself failed (0 ok or killed, 1 job failed, 2 bad config). worker_boot.sh.j2
# names it in RestartPreventExitStatus: keep the two equal (tests/aws/test_boot_scripts.py checks).
EXIT_CRASHED = 70


def load_config(location: str) -> AgentConfig:
    """The config at a path, `file://` or `s3://` URL. Raises OSError (ObjectNotFound, StoreError) when
    it cannot be read, ValueError or KeyError when it is not a valid agent config."""
    from petctl.core.spec import AgentConfig
    from petctl.io.objstore import read_url

    return AgentConfig.from_json(read_url(location).decode("utf-8"))


def main(argv: list[str] | None = None) -> int:
    """The agent's entry point: the exit code (see EXIT_CRASHED above). The method cache goes in first,
    so every dataclass the imports below define comes from it (petctl/io/methodcache.py)."""
    methodcache.install("agent")
    parser = argparse.ArgumentParser(prog="petctl-agent", description="petctl elastic agent")
    parser.add_argument("--config", default=os.environ.get("PETCTL_AGENT_CONFIG"),
                        help="agent config JSON: a path or s3:// URL (default $PETCTL_AGENT_CONFIG)")
    parser.add_argument("--node-id", help="override the node id in the config")
    parser.add_argument("--host-addr", help="override the address peers use to reach this node")
    parser.add_argument("--warm", action="store_true",
                        help="write the start-up caches and exit (an install step: worker_boot.sh.j2)")
    args = parser.parse_args(argv)
    if args.warm:
        return warm()
    if not args.config:
        parser.error("--config is required")
    try:
        config = load_config(args.config)
    except Exception as e:  # noqa: BLE001 - a path, JSON, a field or S3: any of them is one line
        print(f"error: cannot load agent config {args.config}: {e}", file=sys.stderr)
        return 2
    if args.node_id:
        config.node_id = args.node_id
    if args.host_addr:
        config.host_addr = args.host_addr
    from petctl.agent.agent import AgentCrashed

    try:
        return run(config)
    except AgentCrashed:  # reported by the agent while its event sinks still ran
        traceback.print_exc()
        return EXIT_CRASHED
    except Exception as e:  # noqa: BLE001 - the last line of defence: a crash before the agent ran
        from petctl.agent.health import describe, traceback_tail
        from petctl.io.eventlog import EventLog

        EventLog("agent", stream=sys.stdout, job=config.job.name, node=config.node_id).emit(
            "agent.crashed", error=describe(e), traceback=traceback_tail(e))
        traceback.print_exc()
        return EXIT_CRASHED


def warm() -> int:
    """Import what an agent imports (both store backends: the job picks one) and write the method cache,
    even under PYTHONDONTWRITEBYTECODE, as compileall would. An import that fails raises (a broken
    install fails the boot); a cache that cannot be written is one warning line and 0 (agents then
    compile at each start, as without the cache)."""
    import petctl.agent.agent  # noqa: F401
    import petctl.io.store.v2  # noqa: F401
    import petctl.io.store.v3  # noqa: F401

    try:
        path = methodcache.warm("agent")
    except OSError as e:
        print(f"warning: cannot write the method cache: {e}", file=sys.stderr)
        return 0
    print(f"method cache: {path}")
    return 0


def run(config: AgentConfig) -> int:
    """Run the agent for `config`, its output shipped to the job's prefix if it has one."""
    from petctl.agent.agent import Agent

    if not config.status_url:
        return Agent(config).run()
    # The log is shipped to the job's prefix (see reporting.py). If stdout already is a log file (the local
    # provider), ship that; otherwise (a container's stdout) keep a copy of what we print.
    stdout_file = _regular_file(sys.stdout)
    if stdout_file is not None:
        return Agent(config, log_path=stdout_file).run()
    work = Path(config.work_dir or os.getcwd())
    work.mkdir(parents=True, exist_ok=True)
    log_path = work / "node.log"
    with open(log_path, "a", buffering=1, encoding="utf-8") as log:
        return Agent(config, out=Tee(sys.stdout, log), log_path=log_path).run()


def _regular_file(stream) -> Path | None:
    try:
        fd = stream.fileno()
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except (OSError, ValueError, AttributeError):  # not a real file (a pipe, a test's StringIO)
        return None
    return None


class Tee:
    """A text stream that writes to several (stdout and the shipped log file)."""

    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


if __name__ == "__main__":
    sys.exit(main())
