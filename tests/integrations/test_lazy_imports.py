"""The core never imports a framework: only importing an integration module does."""

from __future__ import annotations

import subprocess
import sys

FRAMEWORKS = (
    "lightning",
    "pytorch_lightning",
    "accelerate",
    "torchtitan",
    "megatron",
    "nvidia_resiliency_ext",
)

CHECK = """
import sys
import shoal, shoal.checkpointer, shoal.dcp, shoal.integrations, shoal.kv, shoal.testing.multiproc
import shoal.cli.main
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {frameworks!r})
print(",".join(loaded))
"""


def test_importing_shoal_imports_no_framework():
    code = CHECK.format(frameworks=set(FRAMEWORKS))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"imported by the core: {done.stdout.strip()}"


def test_each_integration_imports_its_own_framework_only():
    for module, own in (
        ("lightning", {"lightning"}),
        ("accelerate", {"accelerate"}),
        ("torchtitan", {"torchtitan"}),
        ("megatron", {"megatron", "nvidia_resiliency_ext"}),  # NVRx's manager; megatron.core only if used
    ):
        others = set(FRAMEWORKS) - own - {"pytorch_lightning"}
        code = f"import sys, shoal.integrations.{module}\n" + (
            f"print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in {others!r})))"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == "", f"shoal.integrations.{module} imported {done.stdout.strip()}"
