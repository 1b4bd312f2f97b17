"""shoal's version, in a module of its own: any layer may import it without importing the package's
front doors (``shoal/__init__.py`` pulls in the engine). pyproject.toml reads it from here."""

from __future__ import annotations

__version__ = "0.1.0"
