"""The engine: stager, background pipeline, restore and retention; the only layer doing I/O and collectives together."""
