"""The user's petctl config: which provider was set up and what `setup` produced.

Stored as JSON in `$PETCTL_HOME/config.json` (default `~/.petctl`), written atomically so a crash never
leaves a half-written file. Passed around explicitly (no module-level state) so tests can point each run
at its own home directory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from petctl.core.errors import NotSetUp
from petctl.io.files import atomic_write

PROVIDERS = ("local", "aws")


def petctl_home() -> Path:
    return Path(os.environ.get("PETCTL_HOME") or Path.home() / ".petctl")


@dataclass
class PetctlConfig:
    home: Path
    provider: str = ""
    # Per-provider settings and setup results, e.g. {"local": {"etcd_endpoint": ...}, "aws": {...}}.
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.home / "config.json"

    @classmethod
    def load(cls, home: Path | None = None) -> PetctlConfig:
        home = home or petctl_home()
        path = home / "config.json"
        if not path.exists():
            return cls(home=home)
        data = json.loads(path.read_text() or "{}")
        return cls(home=home, provider=data.get("provider", ""), settings=data.get("settings", {}))

    def save(self) -> None:
        atomic_write(self.path, json.dumps({"provider": self.provider, "settings": self.settings}, indent=2,
                                           sort_keys=True))

    def forget(self, provider: str) -> None:
        """Drop what `setup` recorded for `provider` (its teardown). With nothing left, remove the file,
        and the home directory if that leaves it empty: teardown leaves no local state behind."""
        self.settings.pop(provider, None)
        if self.provider == provider:
            self.provider = ""
        if self.settings:
            self.save()
            return
        self.path.unlink(missing_ok=True)
        try:
            self.home.rmdir()
        except OSError:
            pass  # not empty (the user keeps files there) or already gone: leave it

    def section(self, provider: str | None = None) -> dict[str, Any]:
        return self.settings.setdefault(provider or self.provider, {})

    def require_setup(self) -> None:
        if not self.provider or not self.settings.get(self.provider, {}).get("ready"):
            raise NotSetUp("petctl is not set up: run `petctl setup` first")
