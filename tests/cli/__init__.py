"""Tests of the ``shoal`` command line."""
