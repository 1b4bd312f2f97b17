"""On-disk formats: chunking and hashing, packs, manifests, DCP metadata as JSON. Pure; no I/O."""
