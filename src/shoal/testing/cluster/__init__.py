"""The emulated cluster: hosts in network namespaces on one machine (docs/cluster.md).

:mod:`~shoal.testing.cluster.hosts` builds it (``Cluster``, ``ClusterSpec``: veth pairs, shaped
storage NICs and fabric links, a real S3 endpoint) and runs ranks in it;
:mod:`~shoal.testing.cluster.ranks` is the launcher each rank runs under;
:mod:`~shoal.testing.cluster.load` the weather and the background tenants;
:mod:`~shoal.testing.cluster.scenarios` the configurations and states a rank saves there.
"""
