"""Contracts: the types every other layer agrees on, with no third-party imports.

Errors, the job spec, the typed wire records (what agents, the CLI and the workers write to etcd and the
object store), the etcd key layout, structured events and the agent<->worker control files. Nothing here
does network I/O; importing it is instant, so the CLI, the agent and the workers can all share it.
"""
