"""How many threads a worker's torch runs: torchrun's default on a node of several workers
(`torchrun_threads`), and a local instance's share of the machine's cores (`host_threads`)."""

from __future__ import annotations

import pytest

from petctl.agent.workers import torchrun_threads
from petctl.core.spec import JobSpec
from petctl.providers.local.instances import host_threads


@pytest.mark.parametrize(("nproc", "host", "job", "expected"), [
    (1, {}, {}, {}),  # torchrun leaves a single worker's threads to torch
    (2, {}, {}, {"OMP_NUM_THREADS": "1"}),
    (8, {}, {}, {"OMP_NUM_THREADS": "1"}),
    (2, {"OMP_NUM_THREADS": "4"}, {}, {}),  # the host's setting stands, as under torchrun
    (2, {}, {"OMP_NUM_THREADS": "3"}, {}),  # so does the job's (`--env`)
    (2, {"OMP_NUM_THREADS": ""}, {}, {}),  # set, even empty: not ours to replace
])
def test_torchrun_threads_is_torchruns_default(nproc, host, job, expected):
    assert torchrun_threads(nproc, host, job) == expected


def spec(max_size: int, nproc: int = 1, env: dict[str, str] | None = None) -> JobSpec:
    return JobSpec(name="t", min_size=1, max_size=max_size, size=1, entrypoint="train.py",
                   nproc_per_node=nproc, env=env or {})


@pytest.mark.parametrize(("max_size", "nproc", "cpus", "threads"), [
    (2, 1, 2, "1"),  # 2 instances on 2 cores: one each
    (3, 1, 2, "1"),  # more workers than cores: never 0
    (2, 1, 16, "8"),
    (3, 2, 16, "2"),  # 6 workers on 16 cores: 2 each (rounded down, so none oversubscribes)
    (1, 1, 4, "4"),
])
def test_a_local_instance_gets_its_share_of_the_cores(max_size, nproc, cpus, threads):
    assert host_threads(spec(max_size, nproc), {}, cpus) == {"OMP_NUM_THREADS": threads}


def test_the_users_own_thread_setting_stands_on_the_local_provider():
    assert host_threads(spec(2), {"OMP_NUM_THREADS": "2"}, 16) == {}
    assert host_threads(spec(2, env={"OMP_NUM_THREADS": "2"}), {}, 16) == {}
