"""A cache of the methods `dataclasses` writes, so an agent does not compile them again at every start.

Why: `@dataclass` writes each class's `__init__`, `__eq__`, `__repr__`, `__hash__` (and the frozen
`__setattr__`) as source text and compiles it when the class is defined. Bytecode caches (`.pyc`) hold a
module's own code, not code it compiles at import, so every process pays that compile again. The agent's
imports define about 80 dataclasses, and the compile is a third of their cost (bench/README.md, "The
agent's start, without compiling its dataclasses"). Every node paid it at every agent start, on the CPU
that the rendezvous waits for.

How: `install(name)` loads the code objects kept in `petctl/__pycache__/` (one file per entry point:
`agent`, `cli`), keyed by the exact source text, and gives `dataclasses` an `exec` that looks the text up
before compiling it. A hit runs the same code object a compile of the same text would make (same text,
same `<string>` file name, same flags), so the classes are the same. The file starts with
`importlib.util.MAGIC_NUMBER` and its name carries `sys.implementation.cache_tag`: another Python never
reads it. `save()` writes it (atomically) when this run compiled something new: the entries loaded and
those compiled, so two CLI commands that define different classes do not evict each other, and only the
entries this run used once the file passes `KEEP_LIMIT`, so edits and upgrades cannot grow it for ever. It
writes nothing under `sys.dont_write_bytecode` (`-B`, PYTHONDONTWRITEBYTECODE), as Python writes no `.pyc`
then. `warm(name)` writes the entries used, regardless, as `compileall` does: an install runs it
(`petctl-agent --warm`, worker_boot.sh.j2).

A missing file is a cold start, not a problem. An unreadable, foreign or corrupt file is ignored (the
classes compile as they would without the cache) and named in `state()`, which the agent reports once in
its `agent.started` event; the next `save()` replaces it.

Stdlib only, and imported before anything that defines a dataclass.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import marshal
import os
import sys
import tempfile
import types
from pathlib import Path

KEEP_LIMIT = 2000  # entries a saved file may hold (about 1 KB each); the agent's imports use about 400
_FILENAME = "<string>"  # what dataclasses itself passes to exec: tracebacks read the same with the cache
_builtin_exec = exec


class _Cache:
    """The code objects of one entry point: those loaded, those this run used, those it compiled."""

    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.path = path
        self.loaded: dict[str, object] = {}
        self.used: dict[str, object] = {}
        self.compiled = 0
        self.problem: str | None = None
        self.saved = False

    def load(self) -> None:
        """Read the file; a missing one is a cold start, any other failure is recorded in `problem`."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as e:
            self.problem = f"cannot read {self.path}: {e.strerror or e}"
            return
        magic = importlib.util.MAGIC_NUMBER
        if not data.startswith(magic):
            self.problem = f"{self.path} was written by another Python: ignored"
            return
        try:
            entries = marshal.loads(data[len(magic):])
        except (EOFError, ValueError, TypeError) as e:
            self.problem = f"{self.path} is corrupt ({e}): ignored"
            return
        if not isinstance(entries, dict) or not all(
                isinstance(k, str) and isinstance(v, types.CodeType) for k, v in entries.items()):
            self.problem = f"{self.path} is not a method cache: ignored"
            return
        self.loaded = entries

    def exec(self, source, globals=None, locals=None, /) -> None:  # noqa: A002 - exec's own signature
        """`dataclasses`' exec: compile `source` only when no earlier run did."""
        if isinstance(source, str):
            code = self.used.get(source) or self.loaded.get(source)
            if code is None:
                code = compile(source, _FILENAME, "exec", dont_inherit=True)
                self.compiled += 1
            self.used[source] = code
            source = code
        _builtin_exec(source, globals, locals)

    def write(self, keep_loaded: bool) -> None:
        """Replace the file with the entries this run used, and with those loaded when `keep_loaded`
        and the two fit in KEEP_LIMIT. Raises OSError when it cannot be written."""
        entries = {**self.loaded, **self.used} if keep_loaded else self.used
        if len(entries) > KEEP_LIMIT:
            entries = self.used
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(importlib.util.MAGIC_NUMBER + marshal.dumps(entries))
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.saved = True


_active: _Cache | None = None


def cache_path(name: str) -> Path:
    """Where entry point `name`'s cache lives: beside petctl's own bytecode, for this Python only."""
    package = Path(__file__).resolve().parent.parent
    return package / "__pycache__" / f"dataclass-methods.{name}.{sys.implementation.cache_tag}.marshal"


def install(name: str, path: Path | None = None) -> None:
    """Load entry point `name`'s cache and route `dataclasses`' compiles through it. Call it before the
    imports that define dataclasses; a second call is a no-op. Never raises for a bad file (see `state`)."""
    global _active
    if _active is not None:
        return
    cache = _Cache(name, path or cache_path(name))
    cache.load()
    _active = cache
    dataclasses.exec = cache.exec  # shadows the builtin for that module only


def uninstall() -> None:
    """Give `dataclasses` its builtin exec back (tests)."""
    global _active
    if getattr(dataclasses, "exec", None) is not None and _active is not None:
        del dataclasses.exec
    _active = None


def save() -> None:
    """Write the cache if this run compiled something and bytecode may be written. A failure to write
    (a read-only install) is recorded in `state()`, never raised: the next start just compiles again."""
    cache = _active
    if cache is None or not cache.compiled or sys.dont_write_bytecode:
        return
    try:
        cache.write(keep_loaded=True)
    except OSError as e:
        cache.problem = f"cannot write {cache.path}: {e.strerror or e}"


def warm(name: str) -> Path:
    """Write entry point `name`'s cache whatever `sys.dont_write_bytecode` says (an install step). Call
    it after the imports; raises OSError when the file cannot be written."""
    cache = _active
    if cache is None or cache.name != name:
        raise RuntimeError(f"methodcache.install({name!r}) was not called before the imports")
    cache.write(keep_loaded=False)
    return cache.path


def state() -> dict[str, object] | None:
    """What the cache did in this process, for one event field; None when it is not installed."""
    cache = _active
    if cache is None:
        return None
    out: dict[str, object] = {"hits": len(cache.used) - cache.compiled, "compiled": cache.compiled,
                              "saved": cache.saved}
    if cache.problem:
        out["problem"] = cache.problem
    return out
