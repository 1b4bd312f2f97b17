"""Test helpers shipped with shoal: the tier conformance suite and a local S3 server.

Importing this package needs ``pytest`` (a test dependency); :mod:`shoal.testing.s3`
additionally needs ``moto[server]`` and ``boto3``, imported only when used.
"""

from __future__ import annotations

from shoal.testing.tiers import TierTests

__all__ = ["TierTests"]
