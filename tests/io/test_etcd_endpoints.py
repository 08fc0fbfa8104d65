"""etcd_endpoint as a comma-separated list of members: parsed in one place, health asked of any member,
and a client that moves between members without ever getting stuck (against a real 3-member cluster)."""

from __future__ import annotations

import time
from pathlib import Path

import etcd
import pytest

from petctl.core.endpoints import parse_endpoints
from petctl.io.etcd import etcd_client, etcd_healthy
from petctl.io.procs import free_port
from tests.support.etcd_cluster import EtcdCluster, running


def test_parse_endpoints():
    assert parse_endpoints("http://10.42.0.10:2379") == [("10.42.0.10", 2379)]
    assert parse_endpoints(" http://a:1, http://b:2 ,http://c") == [("a", 1), ("b", 2), ("c", 2379)]
    assert parse_endpoints("http://10.42.0.10:2379/") == [("10.42.0.10", 2379)]
    assert parse_endpoints("https://a:1,https://b") == [("a", 1), ("b", 2379)]  # client certificates
    for bad, message in [("", "no etcd endpoint"), (" , ", "no etcd endpoint"),
                         ("10.0.0.1:2379", "expected"), ("ftp://a:1", "expected"),
                         ("http://a:1,https://b:2", "mix http and https"),
                         ("http://:2379", "expected"), ("http://a:x", "bad port"),
                         ("http://a:1/v2", "expected")]:
        with pytest.raises(ValueError, match=message) as error:
            parse_endpoints(bad)
        assert "\n" not in str(error.value)


def test_a_client_for_one_endpoint_is_python_etcds_own():
    client = etcd_client("http://127.0.0.1:2379")
    assert type(client) is etcd.Client and not client._allow_reconnect
    with pytest.raises(ValueError, match="expected http://host:port"):
        etcd_client("127.0.0.1:2379")


@pytest.fixture
def cluster(tmp_path: Path):
    with running(tmp_path / "etcd") as c:
        yield c


def member_at(cluster: EtcdCluster, uri: str):
    (member,) = [m for m in cluster.members if m.client_url == uri]
    return member


def restart(cluster: EtcdCluster, member) -> None:
    cluster.start(member, "new", cluster.initial_cluster)  # its data dir is there: the flags are ignored
    cluster.wait_healthy(cluster.members, 30)


@pytest.mark.slow
def test_health_of_a_list_is_any_members(cluster):
    dead = f"http://127.0.0.1:{free_port()}"
    assert etcd_healthy(f"{dead},{cluster.members[2].client_url}")
    assert not etcd_healthy(f"{dead},http://127.0.0.1:{free_port()}")
    assert not etcd_healthy("not an endpoint")


def lose_the_member_in_use(cluster: EtcdCluster, client, value: str) -> str:
    """Kill the member `client` talks to, write through it, bring the member back. Returns the error
    the write raised ("" when it went through another member)."""
    in_use = member_at(cluster, client.base_uri)
    cluster.kill(in_use)
    try:
        client.write("/petctl/k", value)
    except etcd.EtcdConnectionFailed as e:
        return str(e)
    finally:
        restart(cluster, in_use)
    assert client.base_uri != in_use.client_url
    return ""


@pytest.mark.slow
def test_python_etcds_own_client_is_stuck_once_every_member_failed_once(cluster):
    """The trap this module's client exists for: a quorum all along, yet the third loss strands it."""
    theirs = etcd.Client(host=tuple(parse_endpoints(cluster.endpoints)), read_timeout=2.0,
                         allow_reconnect=True, use_proxies=True)
    assert [lose_the_member_in_use(cluster, theirs, str(n)) for n in range(2)] == ["", ""]
    assert "No more machines" in lose_the_member_in_use(cluster, theirs, "2")


@pytest.mark.slow
def test_the_client_outlives_every_member_failing_once(cluster):
    """Lose the member in use four times in a row, each brought back before the next loss: every write
    goes through. Then all three go down: a bounded failure, not a hang, and the same client works once
    they are back."""
    ours = etcd_client(cluster.endpoints, read_timeout=2.0)
    errors = [lose_the_member_in_use(cluster, ours, str(n)) for n in range(4)]
    assert errors == ["", "", "", ""]
    assert ours.read("/petctl/k", quorum=True).value == "3"

    for member in cluster.members:
        cluster.kill(member)
    started = time.monotonic()
    with pytest.raises(etcd.EtcdConnectionFailed, match="none of the 3 etcd members answered"):
        ours.read("/petctl/k")
    assert time.monotonic() - started < 10  # one pass over the members, never an endless loop
    with pytest.raises(etcd.EtcdConnectionFailed, match="none of the 3"):
        ours.read("/petctl/k")  # and the next request tries them all again
    for member in cluster.members:
        cluster.start(member, "new", cluster.initial_cluster)
    cluster.wait_healthy(cluster.members, 30)
    assert ours.read("/petctl/k", quorum=True).value == "3"
    ours.write("/petctl/k", "4")
    assert etcd_client(cluster.members[0].client_url).read("/petctl/k", quorum=True).value == "4"
