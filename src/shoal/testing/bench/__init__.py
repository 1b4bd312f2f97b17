"""Drivers of the benchmarks in ``benchmarks/``: not part of the API a user relies on.

Each module is what one benchmark runs inside the emulated cluster (:mod:`shoal.testing.cluster.hosts`)
or beside it, kept in the package so that the suite can test it: ``cluster_save`` (the cluster
save benchmark and its CPU accounting), ``coordination`` (the control collectives' cost),
``model_fidelity`` and ``model_paths`` (the completion-time model's fidelity and its path map),
``replicas`` (replica placement and load), ``kv_serving`` and ``kv_trace`` (the KV replay: the
serving simulator and the Mooncake trace tools), ``scratch`` (a benchmark's temporary disk and DRAM
roots).
"""
