"""The dataclass method cache (petctl/io/methodcache.py): a hit gives the same classes as a compile, the
agent's whole import is served from a warm file, and a bad file is named, ignored and replaced."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import marshal
import subprocess
import sys
from pathlib import Path

import pytest

from petctl.io import methodcache

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache file under tmp_path, installed for the test and taken out after it."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    methodcache.uninstall()
    path = tmp_path / "dataclass-methods.test.marshal"
    yield path
    methodcache.uninstall()
    assert "exec" not in vars(dataclasses)


def define():
    """Two classes like the agent's: a frozen record and a mutable one with a default factory."""

    @dataclasses.dataclass(frozen=True)
    class Round:
        number: int
        members: tuple[str, ...] = ()

    @dataclasses.dataclass
    class Status:
        step: int
        notes: list[str] = dataclasses.field(default_factory=list)

    return Round, Status


def behaviour(Round, Status) -> tuple:
    r = Round(3, ("a", "b"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.number = 4
    s = Status(7)
    s.notes.append("x")
    return (repr(r), r == Round(3, ("a", "b")), hash(r) == hash(Round(3, ("a", "b"))), repr(s),
            s == Status(7, ["x"]), Status(1).notes is not Status(1).notes)


def test_a_hit_makes_the_same_classes_as_a_compile(cache):
    plain = behaviour(*define())
    methodcache.install("test", cache)
    cold = behaviour(*define())
    first = methodcache.state()
    assert first["compiled"] > 0 and first["hits"] == 0 and "problem" not in first
    methodcache.save()
    assert methodcache.state()["saved"] and cache.read_bytes().startswith(importlib.util.MAGIC_NUMBER)
    methodcache.uninstall()

    methodcache.install("test", cache)
    warm = behaviour(*define())
    second = methodcache.state()
    assert second["compiled"] == 0 and second["hits"] == first["compiled"]
    assert plain == cold == warm
    methodcache.save()  # nothing new: nothing written
    assert not methodcache.state()["saved"]


def test_nothing_is_written_where_python_writes_no_bytecode(cache, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    methodcache.install("test", cache)
    define()
    methodcache.save()
    assert not cache.exists() and not methodcache.state()["saved"]
    assert methodcache.warm("test") == cache and cache.exists()  # an install step writes regardless


@pytest.mark.parametrize("content, named", [
    (importlib.util.MAGIC_NUMBER + b"\x00garbage", "is corrupt"),
    (b"\x00\x00\x0d\x0a" + marshal.dumps({}), "another Python"),
    (importlib.util.MAGIC_NUMBER + marshal.dumps({"def f(): pass": "not code"}), "not a method cache"),
])
def test_a_bad_file_is_named_ignored_and_replaced(cache, content, named):
    plain = behaviour(*define())
    cache.write_bytes(content)
    methodcache.install("test", cache)
    assert behaviour(*define()) == plain
    state = methodcache.state()
    assert named in state["problem"] and str(cache) in state["problem"] and state["compiled"] > 0
    methodcache.save()
    methodcache.uninstall()
    methodcache.install("test", cache)
    define()
    assert methodcache.state() == {"hits": state["compiled"], "compiled": 0, "saved": False}


def test_an_unwritable_cache_is_named_not_raised(cache, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    methodcache.install("test", blocked / "cache.marshal")  # its parent is a file: no directory there
    define()
    methodcache.save()
    assert "cannot write" in methodcache.state()["problem"]
    with pytest.raises(OSError):
        methodcache.warm("test")


def test_a_save_keeps_other_runs_entries_until_the_limit(cache, monkeypatch):
    methodcache.install("test", cache)
    define()
    methodcache.save()
    methodcache.uninstall()

    def other():
        @dataclasses.dataclass
        class Other:
            a: int
            b: str = ""
        return Other

    methodcache.install("test", cache)
    other()
    methodcache.save()  # another command: both sets stay
    both = marshal.loads(cache.read_bytes()[len(importlib.util.MAGIC_NUMBER):])
    methodcache.uninstall()
    monkeypatch.setattr(methodcache, "KEEP_LIMIT", len(both) - 1)
    methodcache.install("test", cache)
    more = dataclasses.make_dataclass("More", [("z", float)])
    assert more(1.0).z == 1.0
    methodcache.save()  # over the limit: only what this run used is kept
    kept = marshal.loads(cache.read_bytes()[len(importlib.util.MAGIC_NUMBER):])
    assert set(kept) == set(methodcache._active.used) and not set(kept) & set(both)


def test_the_agents_imports_are_served_whole_from_a_warm_cache(tmp_path):
    """The real agent's imports, twice in fresh interpreters: the second compiles nothing."""
    path = tmp_path / "agent.marshal"
    code = ("import json, sys; from petctl.io import methodcache; "
            f"methodcache.install('agent', __import__('pathlib').Path({str(path)!r})); "
            "import petctl.agent.agent, petctl.io.store.v3; methodcache.save(); "
            "print(json.dumps(methodcache.state()))")
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                      check=True).stdout) for _ in range(2)]
    assert runs[0]["compiled"] > 100 and runs[0]["saved"], runs
    assert runs[1] == {"hits": runs[0]["compiled"], "compiled": 0, "saved": False}, runs


def test_the_agent_entry_point_installs_the_cache_before_its_imports():
    """`petctl-agent` itself: main.py imports no dataclass-defining module before main() runs."""
    code = ("import sys; import petctl.agent.main; "
            "print(sorted(m for m in sys.modules if m.startswith('petctl')))")
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["petctl", "petctl.agent", "petctl.agent.main", "petctl.io", "petctl.io.methodcache"]
