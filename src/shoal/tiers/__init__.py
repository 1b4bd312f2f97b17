"""Tiers: where bytes live. See :mod:`shoal.tiers.base` for the contract."""
