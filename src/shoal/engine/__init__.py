"""The engine: what runs I/O and collectives together for one job.

The job's resources (:mod:`~shoal.engine.runtime`), the background save pipeline and the group
save protocol, replication to the partner host, restore and its inventory of surviving copies, the
path policy, the save handle and the exposure feed. The durable records these read and write from
one process (manifests, commits, packs, the writer fence, host state, events) are one layer below,
in :mod:`shoal.records`.
"""
