"""The job's S3 prefix: code upload, job records, and the agents' status and log mirror.

Layout under `s3://<bucket>/jobs/<job>/`:
    code/<file> or code/code.tar.gz   what the agent runs (uploaded by run_job)
    job.json                          the JobSpec as submitted (for `jobs`/`status` without etcd)
    result.json                       the job's end: written by the agent that recorded it, or kill_job
    agent.json                        the agent config the user data embeds (identity placeholders in)
    checkpoints/                      petctl.elastic checkpoints
    status/<node_id>.json             each agent's published node state (same schema as etcd's)
    events/<node_id>/<chunk>.jsonl    each agent's events, append-only chunks (petctl/core/mirrorchunks.py)
    logs/<node_id>/<chunk>.log        each agent's node log, append-only chunks
"""

from __future__ import annotations

import io
import json
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from petctl.core.errors import ValidationError
from petctl.core.mirrorchunks import ChunkKey, by_node
from petctl.io.aws import aws_errors
from petctl.io.objstore import ObjectNotFound
from petctl.io.s3store import S3Store
from petctl.timeline import mirror_events

ARCHIVE_NAME = "code.tar.gz"


def job_prefix(job: str) -> str:
    return f"jobs/{job}"


@dataclass
class JobStore:
    """The job's prefix, read and written with the CLI session's S3 client (`s3`). The bytes go through
    the object store (`objects`, petctl.io.s3store); this class knows the layout and turns failures into
    one-line errors naming what it was doing."""

    s3: Any
    bucket: str
    job: str
    objects: S3Store = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.objects = S3Store(self.url(), client=self.s3)

    @property
    def prefix(self) -> str:
        return job_prefix(self.job)

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", self.prefix, *parts])

    def upload_code(self, script: Path) -> tuple[str, str]:
        """Upload a file as itself or a directory as one tar.gz; returns (code_url, default entrypoint)."""
        script = Path(script)
        if script.is_file():
            key = f"code/{script.name}"
            with aws_errors(f"upload {script} to {self.url(key)}"):
                self.objects.put_file(key, script)
            return self.url(key), script.name
        if script.is_dir():
            buffer = io.BytesIO()
            with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
                for path in sorted(script.rglob("*")):
                    if "__pycache__" in path.parts or path.name.startswith(".") or not path.is_file():
                        continue
                    tar.add(path, arcname=str(path.relative_to(script)))
            key = f"code/{ARCHIVE_NAME}"
            with aws_errors(f"upload {script}/ to {self.url(key)}"):
                self.objects.put_bytes(key, buffer.getvalue())
            return self.url(key), ""
        raise ValidationError(f"script {script} does not exist")

    def put_json(self, name: str, value: Any) -> None:
        with aws_errors(f"write {self.url(name)}"):
            self.objects.put_bytes(name, json.dumps(value, sort_keys=True).encode(), "application/json")

    def get_json(self, name: str) -> Any:
        text = self.get_text(name)
        if text is None:
            return None
        try:
            return json.loads(text)
        except ValueError:
            return None

    def get_text(self, name: str) -> str | None:
        data = self.get_bytes(name)
        return None if data is None else data.decode("utf-8", "replace")

    def get_bytes(self, name: str) -> bytes | None:
        """The object's bytes, or None when there is none."""
        with aws_errors(f"read {self.url(name)}"):
            try:
                return self.objects.get_bytes(name)
            except ObjectNotFound:
                return None

    def list_names(self, sub: str) -> list[str]:
        """Object names (relative to `<prefix>/<sub>/`) directly under a sub-prefix."""
        base = f"{sub}/"
        return sorted(n for n in (k[len(base):] for k in self.list_keys(sub)) if n and "/" not in n)

    def list_keys(self, sub: str) -> list[str]:
        """Every object name under `<prefix>/<sub>/`, relative to `<prefix>/` (nested ones included)."""
        with aws_errors(f"list {self.url(sub)}/"):
            return [o.key for o in self.objects.list(f"{sub}/")]

    def chunks(self, stream: str) -> dict[str, list[ChunkKey]]:
        """node -> its `events` or `logs` chunks in write order."""
        return by_node(self.list_keys(stream), stream)

    def chunk_text(self, keys: list[ChunkKey]) -> str:
        """One node's stream, reassembled: its chunks' bytes concatenated in write order, then decoded
        (a chunk may end inside a multi-byte character)."""
        return b"".join(self.get_bytes(key.name) or b"" for key in keys).decode("utf-8", "replace")

    def record(self) -> dict[str, Any] | None:
        """What outlives the job's stack: its spec, its result (if it ended) and when it was submitted."""
        spec = self.get_json("job.json")
        if not isinstance(spec, dict):
            return None
        with aws_errors(f"read {self.url('job.json')}"):
            info = self.objects.stat("job.json")
        result = self.get_json("result.json")
        return {"spec": spec, "result": result if isinstance(result, dict) else None,
                "created_at": info.mtime if info is not None else 0.0}

    def node_states(self) -> dict[str, dict[str, Any]]:
        """node_id -> published node state, from `status/<node_id>.json`."""
        states = {}
        for name in self.list_names("status"):
            if not name.endswith(".json") or name.startswith("_"):
                continue
            value = self.get_json(f"status/{name}")
            if isinstance(value, dict):
                states[name[: -len(".json")]] = value
        return states

    def events(self) -> list[dict[str, Any]]:
        """Every event the agents mirrored (each node's chunks in order), unsorted across nodes."""
        with aws_errors(f"read {self.url('events')}/"):
            return mirror_events(self.objects)

    def log_nodes(self) -> list[str]:
        return list(self.chunks("logs"))

    def log_lines(self, node: str) -> Iterator[str]:
        yield from self.chunk_text(self.chunks("logs").get(node, [])).splitlines()

    def delete_all(self) -> None:
        """Remove every object (all versions) under the job's prefix."""
        with aws_errors(f"delete {self.url()}/"):
            self.objects.purge("")


def follow_logs(store: JobStore, node: str | None, available: list[str], follow: bool,
                running: Callable[[], bool], interval: float) -> Iterator[str]:
    """The node logs' lines from their chunks, in order (prefixed `[node] ` unless one node was asked for).

    Each chunk is fetched once, even with `follow`; a line split across two chunks is joined. With
    `follow`, new chunks (and new nodes) are read every `interval` seconds until `running()` is False."""
    nodes = [node] if node else available
    seen: dict[str, set] = {}  # node -> chunks already shown
    partial: dict[str, str] = {}  # node -> the unterminated tail of its last chunk
    while True:
        chunks = store.chunks("logs")
        for n in nodes:
            new = [k for k in chunks.get(n, []) if k not in seen.setdefault(n, set())]
            seen[n].update(new)
            lines = (partial.pop(n, "") + store.chunk_text(new)).split("\n")
            partial[n] = lines.pop()  # "" when the text ended with a newline
            for line in (raw.rstrip("\r") for raw in lines):
                yield line if node else f"[{n}] {line}"
        if not follow or not running():
            for n, rest in partial.items():
                if rest:
                    yield rest if node else f"[{n}] {rest}"
            return
        time.sleep(interval)
        nodes = [node] if node else list(store.chunks("logs"))


def recorded_jobs(s3: Any, bucket: str) -> list[str]:
    """Names of every job with a record under `jobs/` (running or long gone)."""
    with aws_errors(f"list s3://{bucket}/jobs/"):
        return S3Store(f"s3://{bucket}/jobs", client=s3).subdirs("")
