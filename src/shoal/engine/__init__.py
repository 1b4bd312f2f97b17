"""The engine: stager, background pipeline, reads and retention.

The only layer that does I/O and collectives together.
"""
