"""`--image` jobs: the image must be in this region's ECR and built for linux/amd64, checked before any
instance launches (an arm64 image, as `docker build` makes on Apple silicon without --platform, would
fail on every GPU instance the group starts).

The platform is read the way a registry client does: an image index (OCI) or manifest list (Docker) names
each manifest's platform; a single manifest's platform is in its config blob, fetched through ECR's
GetDownloadUrlForLayer. What cannot be read is refused, never guessed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from petctl.core.errors import ValidationError

PLATFORM = "linux/amd64"
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")
ECR_IMAGE_RE = re.compile(r"^(?P<account>\d{12})\.dkr\.ecr\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(\.cn)?/"
                          r"(?P<repo>[^:@]+)(:(?P<tag>[^@]+))?(@(?P<digest>sha256:[0-9a-f]{64}))?$")


def platforms(manifest: dict[str, Any], config: Callable[[str], dict[str, Any] | None]) -> set[str]:
    """The os/architecture pairs an image offers ("unknown/unknown" attestation entries left out).
    `config(digest)` returns a single manifest's config blob, or None when it cannot be read."""
    if "manifests" in manifest:  # an index: one entry per platform
        found = {f"{m.get('platform', {}).get('os', '')}/{m.get('platform', {}).get('architecture', '')}"
                 for m in manifest["manifests"]}
        return {p for p in found if p != "/" and "unknown" not in p}
    if manifest.get("schemaVersion") == 1:  # the old signed manifests name the architecture themselves
        return {f"linux/{manifest['architecture']}"} if manifest.get("architecture") else set()
    digest = (manifest.get("config") or {}).get("digest", "")
    blob = config(digest) if digest else None
    if not blob or not blob.get("architecture"):
        return set()
    return {f"{blob.get('os', 'linux')}/{blob['architecture']}"}


def verdict(image: str, offered: set[str]) -> str:
    """"" when the image runs on petctl's instances, else the one-line reason it does not."""
    if PLATFORM in offered:
        return ""
    if not offered:
        return (f"cannot tell which platform image {image} is built for: petctl launches only "
                f"{PLATFORM} images (push it with `docker build --platform {PLATFORM}`)")
    return (f"image {image} is built for {', '.join(sorted(offered))}, not {PLATFORM} (x86_64 GPU "
            f"instances): rebuild it with `docker build --platform {PLATFORM}` and push it again")


def check_image(ecr: Any, image: str, region: str, fetch: Callable[[str], bytes] | None = None) -> str:
    """Refuse (ValidationError, one line) an image that is not in this region's ECR, does not exist, or
    is not built for linux/amd64; returns its platform. `fetch(url)` reads a config blob's download URL
    (urllib by default; tests pass their own)."""
    from petctl.io.aws import ClientError, aws_errors, error_code

    match = ECR_IMAGE_RE.match(image)
    if not match or match.group("region") != region:
        raise ValidationError(f"--image {image} must be in this region's ECR (ACCOUNT.dkr.ecr.{region}."
                              "amazonaws.com/REPO:TAG), where petctl checks its platform before launching")
    repo = match.group("repo")
    image_id = {"imageDigest": match.group("digest")} if match.group("digest") else {
        "imageTag": match.group("tag") or "latest"}
    with aws_errors(f"look up the worker image {image}"):
        try:
            reply = ecr.batch_get_image(repositoryName=repo, imageIds=[image_id],
                                        acceptedMediaTypes=[*INDEX_TYPES, *MANIFEST_TYPES])
        except ClientError as exc:
            if error_code(exc) != "RepositoryNotFoundException":
                raise
            reply = {"images": []}
    if not reply.get("images"):
        raise ValidationError(f"worker image {image} is not in ECR: push it first (docs/aws.md: your own "
                              "image), or run without --image")
    manifest = json.loads(reply["images"][0]["imageManifest"])

    def config(digest: str) -> dict[str, Any] | None:
        try:
            url = ecr.get_download_url_for_layer(repositoryName=repo, layerDigest=digest)["downloadUrl"]
            return json.loads((fetch or _fetch)(url))
        except Exception:  # noqa: BLE001 unreadable is "unknown", which verdict() refuses with the reason
            return None

    offered = platforms(manifest, config)
    reason = verdict(image, offered)
    if reason:
        raise ValidationError(reason)
    return PLATFORM


def _fetch(url: str) -> bytes:
    from urllib.request import urlopen

    with urlopen(url, timeout=30) as reply:  # noqa: S310 (an https URL ECR signed for this blob)
        return reply.read(1 << 20)
