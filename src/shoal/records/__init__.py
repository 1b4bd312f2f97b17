"""The durable records of a job, each read and written from one process.

The store of manifests and commits and the verified chunk fetcher; pack listing and writing; the
catalog of what is on the shared tier; the writer fence; the host state of staged checkpoints, the
stager and the staged indexes; retention; the event records and the exposure log built from them;
the commit; the metadata cache. Nothing here runs a collective or talks to another rank: that is
:mod:`shoal.engine`, one layer up, and the CLI works on these records alone.
"""
