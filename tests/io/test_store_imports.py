"""What a process on each store backend loads: a v3 agent never loads python-etcd (with urllib3 and
dnspython, 0.1 s of CPU at every agent's start; `store_errors` names its errors only once it is loaded),
nor grpc or protobuf (the v3 client is petctl/io/store/v3wire.py, on http2.py). Each case runs in a
fresh interpreter: it is about what one process has imported."""

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


def test_store_errors_name_python_etcds_only_once_it_is_loaded():
    run("""
        import sys
        from petctl.core.store import StoreError
        from petctl.io.store import store_errors
        from petctl.io.store import open_store
        open_store("http://127.0.0.1:1", "v3", None, 1.0).close()
        loaded = [m for m in ("urllib3", "dns", "etcd", "grpc", "google.protobuf") if m in sys.modules]
        assert not loaded, loaded
        assert store_errors() == (StoreError, OSError)
        import petctl.io.store.v2  # noqa: F401
        assert sys.modules["etcd"].EtcdException in store_errors()
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


def test_an_agent_loads_nothing_its_job_may_not_need():
    """Every agent pays its imports in CPU at start, 64 of them at once on a small host (bench P5). The
    etcd server's module (and urllib's HTTP client with it) is for starting etcd and checking its health,
    tarfile only for code shipped as an archive: an agent on the v3 store loads neither at start."""
    run("""
        import sys
        import petctl.agent.main  # noqa: F401
        import petctl.agent.agent  # noqa: F401
        from petctl.io.store import open_store
        open_store("http://127.0.0.1:1", "v3", None, 1.0).close()
        unneeded = ("petctl.io.etcd", "urllib.request", "http.client", "tarfile")
        loaded = [m for m in unneeded if m in sys.modules]
        assert not loaded, loaded
    """)
