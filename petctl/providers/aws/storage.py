"""The job's S3 prefix: code upload and job records. The agents' status, events and logs mirrored here
are read by petctl.jobview (a `JobStore` is the `PrefixReader` the AWS provider hands it).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from petctl.core.errors import ValidationError
from petctl.io.aws import aws_errors
from petctl.io.objstore import ObjectNotFound, S3Store

ARCHIVE_NAME = "code.tar.gz"


def job_prefix(job: str) -> str:
    return f"jobs/{job}"


@dataclass
class JobStore:
    """The job's prefix, read and written with the CLI session's S3 client (`s3`). The bytes go through
    the object store (`objects`, petctl.io.objstore); this class knows the layout and turns failures into
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

    def delete_all(self) -> None:
        """Remove every object (all versions) under the job's prefix."""
        with aws_errors(f"delete {self.url()}/"):
            self.objects.purge("")


def recorded_jobs(s3: Any, bucket: str) -> list[str]:
    """Names of every job with a record under `jobs/` (running or long gone)."""
    with aws_errors(f"list s3://{bucket}/jobs/"):
        return S3Store(f"s3://{bucket}/jobs", client=s3).subdirs("")
