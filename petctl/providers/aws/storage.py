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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from petctl.core.errors import ValidationError
from petctl.io.aws import aws_errors, error_code

ARCHIVE_NAME = "code.tar.gz"


def job_prefix(job: str) -> str:
    return f"jobs/{job}"


@dataclass
class JobStore:
    s3: Any
    bucket: str
    job: str

    @property
    def prefix(self) -> str:
        return job_prefix(self.job)

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", self.prefix, *parts])

    def upload_code(self, script: Path) -> tuple[str, str]:
        """Upload a file as itself or a directory as one tar.gz; returns (code_url, default entrypoint)."""
        script = Path(script)
        if script.is_file():
            key = f"{self.prefix}/code/{script.name}"
            with aws_errors(f"upload {script} to s3://{self.bucket}/{key}"):
                self.s3.upload_file(str(script), self.bucket, key)
            return f"s3://{self.bucket}/{key}", script.name
        if script.is_dir():
            buffer = io.BytesIO()
            with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
                for path in sorted(script.rglob("*")):
                    if "__pycache__" in path.parts or path.name.startswith(".") or not path.is_file():
                        continue
                    tar.add(path, arcname=str(path.relative_to(script)))
            key = f"{self.prefix}/code/{ARCHIVE_NAME}"
            with aws_errors(f"upload {script}/ to s3://{self.bucket}/{key}"):
                self.s3.put_object(Bucket=self.bucket, Key=key, Body=buffer.getvalue())
            return f"s3://{self.bucket}/{key}", ""
        raise ValidationError(f"script {script} does not exist")

    def put_json(self, name: str, value: Any) -> None:
        with aws_errors(f"write s3://{self.bucket}/{self.prefix}/{name}"):
            body = json.dumps(value, sort_keys=True).encode()
            self.s3.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{name}", Body=body,
                               ContentType="application/json")

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
        from botocore.exceptions import ClientError

        with aws_errors(f"read s3://{self.bucket}/{self.prefix}/{name}"):
            try:
                return self.s3.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{name}")["Body"].read()
            except ClientError as exc:
                if error_code(exc) in {"NoSuchKey", "404", "NotFound"}:
                    return None
                raise

    def list_names(self, sub: str) -> list[str]:
        """Object names (relative to `<prefix>/<sub>/`) directly under a sub-prefix."""
        names = []
        base = f"{self.prefix}/{sub}/"
        with aws_errors(f"list s3://{self.bucket}/{base}"):
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
                names.extend(obj["Key"][len(base):] for obj in page.get("Contents", []))
        return sorted(n for n in names if n and "/" not in n)

    def list_keys(self, sub: str) -> list[str]:
        """Every object name under `<prefix>/<sub>/`, relative to `<prefix>/` (nested ones included)."""
        names = []
        base = f"{self.prefix}/"
        with aws_errors(f"list s3://{self.bucket}/{base}{sub}/"):
            paginator = self.s3.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=f"{base}{sub}/"):
                names.extend(obj["Key"][len(base):] for obj in page.get("Contents", []))
        return sorted(names)

    def record(self) -> dict[str, Any] | None:
        """What outlives the job's stack: its spec, its result (if it ended) and when it was submitted."""
        spec = self.get_json("job.json")
        if not isinstance(spec, dict):
            return None
        created = 0.0
        with aws_errors(f"read s3://{self.bucket}/{self.prefix}/job.json"):
            try:
                head = self.s3.head_object(Bucket=self.bucket, Key=f"{self.prefix}/job.json")
                created = head["LastModified"].timestamp()
            except Exception as e:
                if error_code(e) not in ("404", "NoSuchKey", "NotFound"):
                    raise
        result = self.get_json("result.json")
        return {"spec": spec, "result": result if isinstance(result, dict) else None, "created_at": created}

    def delete_all(self) -> None:
        """Remove every object (all versions) under the job's prefix."""
        with aws_errors(f"delete s3://{self.bucket}/{self.prefix}/"):
            paginator = self.s3.get_paginator("list_object_versions")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + "/"):
                objects = [{"Key": v["Key"], "VersionId": v["VersionId"]}
                           for v in page.get("Versions", []) + page.get("DeleteMarkers", [])]
                for start in range(0, len(objects), 1000):
                    batch = {"Objects": objects[start:start + 1000]}
                    self.s3.delete_objects(Bucket=self.bucket, Delete=batch)


def recorded_jobs(s3: Any, bucket: str) -> list[str]:
    """Names of every job with a record under `jobs/` (running or long gone)."""
    names = []
    with aws_errors(f"list s3://{bucket}/jobs/"):
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="jobs/", Delimiter="/")
        for page in pages:
            names += [p["Prefix"][len("jobs/"):].rstrip("/") for p in page.get("CommonPrefixes", [])]
    return sorted(n for n in names if n)
