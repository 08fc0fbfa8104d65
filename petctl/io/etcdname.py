"""Who owns the module name `etcd` in this process: python-etcd (the v2 client), etcd3aio's generated protos
(the v3 client), or both.

Both are a top-level package named `etcd`: python-etcd's a regular package, etcd3aio's
(`etcd3aio/proto/etcd/api/...`) a namespace package, and a regular package always wins the name, so
etcd3aio can only be imported once the `etcd` in `sys.modules` has etcd3aio's directory on its path.
Until issue 47 the v3 store imported python-etcd for that, and with it urllib3 and dnspython: about 0.1 s
of CPU at every agent's start (a third of its imports), for a client the v3 agent never calls.

`claim_for_protos` gives the name to a package of etcd3aio's protos alone when python-etcd is not loaded
yet; `python_etcd` loads python-etcd on demand, over such a package, keeping the protos on its path and
the proto modules already imported, so the two still live in one process in either order. A module that
did `import etcd` while the protos held the name gets python-etcd's attributes through the package's
`__getattr__` (PEP 562).
"""

from __future__ import annotations

import importlib
import sys
import threading
from types import ModuleType

_PROTOS_ONLY = "__petctl_protos_only__"
_lock = threading.RLock()


def _is_protos_only(module: ModuleType | None) -> bool:
    return module is not None and bool(module.__dict__.get(_PROTOS_ONLY))


def claim_for_protos(protos: str) -> None:
    """Make `etcd.api...` importable from etcd3aio's proto directory `protos`: on python-etcd's package
    when it is loaded (its path extended), else on a package of the protos alone (python-etcd stays
    unloaded until `python_etcd` is called)."""
    with _lock:
        current = sys.modules.get("etcd")
        if current is None:
            stub = ModuleType("etcd", "etcd3aio's generated protos (petctl/io/etcdname.py)")
            stub.__path__ = [protos]  # type: ignore[attr-defined]
            stub.__dict__[_PROTOS_ONLY] = True
            stub.__dict__["__getattr__"] = _python_etcd_attribute
            sys.modules["etcd"] = stub
        elif protos not in list(current.__path__):
            current.__path__.append(protos)


def _python_etcd_attribute(name: str) -> object:
    """A missing attribute of the protos-only package: python-etcd's (loaded now). Raises AttributeError
    for dunders (the import system probes them) and names python-etcd does not have."""
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(python_etcd(), name)


def loaded_python_etcd() -> ModuleType | None:
    """python-etcd's `etcd` if this process has loaded it, else None (nothing can raise its errors)."""
    current = sys.modules.get("etcd")
    return None if current is None or _is_protos_only(current) else current


def python_etcd() -> ModuleType:
    """python-etcd's `etcd` module, loaded if it is not yet; etcd3aio's protos stay importable beside it.
    Raises ImportError when python-etcd is not installed."""
    with _lock:
        current = sys.modules.get("etcd")
        if current is not None and not _is_protos_only(current):
            return current
        if current is None:
            return importlib.import_module("etcd")
        del sys.modules["etcd"]
        try:
            real = importlib.import_module("etcd")
        except BaseException:
            sys.modules["etcd"] = current
            raise
        for path in current.__path__:
            if path not in list(real.__path__):
                real.__path__.append(path)
        for name, value in current.__dict__.items():  # etcd.api & co, already imported from the protos
            if isinstance(value, ModuleType) and not hasattr(real, name):
                setattr(real, name, value)
        return real
