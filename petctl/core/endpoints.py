"""How an etcd endpoint list is written: `http(s)://host:port[,http(s)://host:port...]`, one cluster's
members. Every etcd_endpoint is parsed here (stores, health checks, the v2 client, the etcd server's
own checks), so one comma-separated string is all a config carries."""

from __future__ import annotations

from urllib.parse import urlparse


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """`http://host:port` or a comma-separated list of them (an etcd cluster's members) as (host, port)
    pairs, in the order given; a missing port means 2379; `https://` for an etcd that requires client
    certificates (every member alike). Raises ValueError (one line) for an empty list, a scheme other
    than http(s), mixed schemes, or no host."""
    return split_endpoints(text)[1]


def endpoint_scheme(text: str) -> str:
    """"http" or "https" (see parse_endpoints). Raises ValueError."""
    return split_endpoints(text)[0]


def split_endpoints(text: str) -> tuple[str, list[tuple[str, int]]]:
    """(scheme, [(host, port), ...]) of an endpoint list (see parse_endpoints). Raises ValueError."""
    pairs: list[tuple[str, int]] = []
    schemes = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        u = urlparse(part)
        try:
            port = u.port or 2379
        except ValueError:
            raise ValueError(f"invalid etcd endpoint {part!r}: bad port") from None
        if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/"):
            raise ValueError(f"invalid etcd endpoint {part!r}: expected http://host:port or https://host:port")
        schemes.add(u.scheme)
        pairs.append((u.hostname, port))
    if not pairs:
        raise ValueError(f"no etcd endpoint in {text!r}: expected http://host:port[,http://host:port...]")
    if len(schemes) > 1:
        raise ValueError(f"etcd endpoints {text!r} mix http and https")
    return schemes.pop(), pairs
