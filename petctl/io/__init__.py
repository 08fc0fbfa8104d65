"""The I/O layer: every way petctl talks to the outside world, written once.

The object store (`file://` and `s3://`), the boto3 session and client factory with named retry
profiles, etcd (its server, clients, certificates and auth), process helpers and atomic files. It
imports only `petctl.core`; the agent, `petctl.elastic` and the providers build on it and never on each
other.
"""
