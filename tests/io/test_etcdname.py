"""Issue 47: a v3 agent no longer loads python-etcd (with urllib3 and dnspython, 0.1 s of CPU at every
agent's start) only to give etcd3aio's protos the module name `etcd`; python-etcd still loads beside
them, in either order (petctl/io/etcdname.py). Each case runs in a fresh interpreter: it is about what
one process has imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.support.paths import REPO


def run(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_v3_client_loads_without_python_etcd_and_python_etcd_still_loads_after():
    run("""
        import sys
        from petctl.core.store import StoreError
        from petctl.io.etcd import store_errors
        from petctl.io.store.v3 import import_etcd3aio
        import_etcd3aio()
        from etcd.api.mvccpb import kv_pb2
        loaded = [m for m in ("urllib3", "dns", "etcd.client") if m in sys.modules]
        assert not loaded, loaded
        assert store_errors() == (StoreError, OSError)
        import etcd  # a module that imports python-etcd now gets it, attribute by attribute
        assert etcd.Client.__module__ == "etcd.client"
        import petctl.io.store.v2  # noqa: F401
        real = sys.modules["etcd"]
        assert real.EtcdException in store_errors() and real.api.mvccpb.kv_pb2 is kv_pb2
        from etcd.api.etcdserverpb import rpc_pb2  # noqa: F401  # protos not yet imported still resolve
    """)


def test_python_etcd_first_then_the_v3_client():
    run("""
        import etcd
        from petctl.io.etcd import store_errors
        from petctl.io.store.v3 import import_etcd3aio
        import_etcd3aio()
        from etcd.api.mvccpb import kv_pb2  # noqa: F401
        import sys
        assert sys.modules["etcd"] is etcd and etcd.EtcdException in store_errors()
    """)


@pytest.mark.parametrize("backend", ["v3", "v2"])
def test_the_agents_imports_follow_its_backend(backend: str):
    """What an agent on each backend has loaded once its store is open (no etcd needed to build one)."""
    run(f"""
        import sys
        import petctl.agent.agent  # noqa: F401
        from petctl.io.store import open_store
        store = open_store("http://127.0.0.1:1", "{backend}", None, 1.0)
        store.close()
        assert ("urllib3" in sys.modules) == ("{backend}" == "v2"), sorted(sys.modules)[:50]
    """)
