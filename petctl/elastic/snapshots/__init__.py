"""The in-memory snapshot tier: a node lost costs at most one step (docs/elastic.md).

Modules: `tier` (options, the replicated tier), `writer` (its writer, cadence, device copy), `codec`
(wire formats, replicated and sharded), `resume` (offers, choice and resume, both flavours), `ring` (the
sharded tier: capture, the ring, `ShardSnapshotTier`).
"""
