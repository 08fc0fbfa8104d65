"""How a member of the 3-member etcd cluster (`setup --etcd-nodes 3`) starts, run for real: the boot
script's `etcd_join` (worker_image/etcd_join.sh.j2, rendered as the boot script includes it) against a
real 3-member etcd cluster on 127.0.0.1.

The case that matters on AWS: a member's instance is replaced, and the new one comes back on the same
fixed address with an EMPTY data dir. It must leave the cluster under its old ID and join again, and the
data written before must still be there, on all three members."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from petctl.io.etcd import etcd_client
from petctl.providers.aws.templates import render_boot
from tests.support.etcd_cluster import EtcdCluster, etcdctl_binary

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path: Path):
    c = EtcdCluster.create(tmp_path / "etcd")
    yield c
    c.stop()


def run_join(tmp_path: Path, cluster: EtcdCluster, index: int, wait: float = 30) -> tuple[str, str, str]:
    """Run `etcd_join` for member `index` as the boot script does: (JOIN_STATE, JOIN_CLUSTER, its log)."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    lib = tmp_path / "etcd_join.sh"
    lib.write_text(render_boot("etcd_join.sh.j2"))
    member = cluster.members[index]
    # Retried as the boot script retries it: a fresh cluster refuses `member add` until its members have
    # been connected for 5 s (etcd's strict reconfiguration check), so the first try may stop half-way.
    script = (f'. "{lib}"; n=0; until etcd_join "$1" "$2" "$3" "$4" "$5" "$6" >&2; do '
              '[ $((n += 1)) -lt 20 ] || exit 3; sleep 1; done; echo "$JOIN_STATE"; echo "$JOIN_CLUSTER"')
    out = subprocess.run([bash, "-c", script, "join", member.name, member.peer_url, str(member.data_dir),
                          cluster.initial_cluster, cluster.others(member), str(wait)],
                         capture_output=True, text=True, timeout=120, env={"ETCDCTL": etcdctl_binary(),
                                                                           "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    state, joined = out.stdout.splitlines()
    return state, joined, out.stderr


def member_list(cluster: EtcdCluster, endpoints: str | None = None) -> dict[str, tuple[str, str]]:
    """{peer URL: (id, status)} from `etcdctl member list`."""
    rows = [line.split(", ") for line in cluster.etcdctl("member", "list", endpoints=endpoints).splitlines()]
    return {row[3]: (row[0], row[1]) for row in rows}


def test_a_replaced_member_with_an_empty_data_dir_rejoins_and_the_data_survives(tmp_path, cluster):
    cluster.start_all()
    writer = etcd_client(cluster.endpoints)
    for i in range(20):
        writer.write(f"/petctl/jobs/demo/k{i}", f"v{i}")
    before = member_list(cluster)
    assert {status for _, status in before.values()} == {"started"} and len(before) == 3
    lost = cluster.members[1]
    old_id = before[lost.peer_url][0]

    cluster.kill(lost)  # the instance is gone ...
    cluster.wipe(lost)  # ... and its replacement boots with an empty disk, on the same address
    writer.write("/petctl/jobs/demo/while-one-was-down", "yes")  # two of three still have a quorum

    state, joined, log = run_join(tmp_path, cluster, 1)
    assert state == "existing", log
    assert joined == cluster.initial_cluster  # all three: the two others and itself under its own name
    assert f"replacing its stale entry {old_id}" in log
    after_join = member_list(cluster, cluster.others(lost))
    assert after_join[lost.peer_url][1] == "unstarted" and after_join[lost.peer_url][0] != old_id

    # A boot that failed after `member add` runs etcd_join again: no second entry, the same decision.
    again = run_join(tmp_path, cluster, 1)
    assert again[:2] == (state, joined)
    assert member_list(cluster, cluster.others(lost)) == after_join

    cluster.start(lost, state, joined)
    cluster.wait_healthy(cluster.members, 30)
    after = member_list(cluster)
    assert len(after) == 3 and {status for _, status in after.values()} == {"started"}
    assert after[lost.peer_url][0] == after_join[lost.peer_url][0]
    # The data written before (and during) the outage, read from the rejoined member itself.
    rejoined = etcd_client(lost.client_url)
    deadline = time.monotonic() + 10
    while rejoined.read("/petctl/jobs/demo/k19", quorum=True).value != "v19" and time.monotonic() < deadline:
        time.sleep(0.1)
    values = {n.key.rsplit("/", 1)[1]: n.value for n in rejoined.read("/petctl/jobs/demo").leaves}
    assert values == {**{f"k{i}": f"v{i}" for i in range(20)}, "while-one-was-down": "yes"}

    # The rejoined member restarts from its own data on the next boot of the same instance.
    cluster.kill(lost)
    state, joined, log = run_join(tmp_path, cluster, 1)
    assert (state, "restarting from its data" in log) == ("new", True)
    cluster.start(lost, state, joined)
    cluster.wait_healthy(cluster.members, 30)
    assert member_list(cluster) == after


def test_the_first_boot_of_the_cluster_starts_new_once_no_quorum_answers(tmp_path, cluster):
    started = time.monotonic()
    state, joined, log = run_join(tmp_path, cluster, 0, wait=2)
    assert (state, joined) == ("new", cluster.initial_cluster)
    assert "first boot of the cluster" in log and time.monotonic() - started >= 2
    # Each member decides the same, and the three form the cluster.
    for member in cluster.members:
        cluster.start(member, state, joined)
    cluster.wait_healthy(cluster.members, 30)
    assert len(member_list(cluster)) == 3
