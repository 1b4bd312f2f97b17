"""The layers of docs/design.md section 2, as tools check them: the import contract, the version, and the
helpers the demo needs importing with shoal's runtime dependencies alone."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import shoal
import shoal._version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"


def _copy_of_the_package(tmp_path: Path) -> Path:
    """A copy of src/shoal and the contract under ``tmp_path``, to break on purpose."""
    shutil.copytree(
        ROOT / "src" / "shoal", tmp_path / "src" / "shoal", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(PYPROJECT, tmp_path / "pyproject.toml")
    return tmp_path / "src" / "shoal"


def _lint_imports(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("importlinter", reason="import-linter is a dev dependency (make lint)")
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    command = (
        "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    )
    return subprocess.run(
        [sys.executable, "-c", command, "--no-cache", "--no-logo", str(cwd / "pyproject.toml")],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_import_contract_is_kept() -> None:
    result = _lint_imports(ROOT, ROOT / "src")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        (
            "format/layout.py",
            "import shoal.engine.pipeline",
            "shoal.format is not allowed to import shoal.engine",
        ),
        ("tiers/base.py", "import shoal.group.topology", "shoal.tiers is not allowed to import shoal.group"),
        ("format/pack.py", "import shoal.config", "shoal.format is not allowed to import shoal.config"),
        ("errors.py", "import shoal.format.names", "shoal.errors is not allowed to import shoal.format"),
        # the model is pure math: it reads no format, no tier, no event log
        ("model/writers.py", "import shoal.format.layout", "shoal.model is not allowed to import"),
        ("model/advisor.py", "import shoal.records.events", "shoal.model is not allowed to import"),
        ("records/retention.py", "import shoal.demo", "shoal.records is not allowed to import shoal.demo"),
        # the records are one process's reads and writes: they never reach up into the collectives
        (
            "records/store.py",
            "import shoal.engine.restore",
            "shoal.records is not allowed to import shoal.engine",
        ),
        # the CLI works on records; the engine's collective modules are not its to import
        ("cli/ls.py", "import shoal.engine.restore", "shoal.cli is not allowed to import shoal.engine"),
        # the package root re-exports the front doors: importing it from below is a chain up to them
        ("records/retention.py", "from shoal import __version__", "shoal.records is not allowed to import"),
        ("checkpointer.py", "import shoal.testing.scenarios", "shoal.checkpointer is not allowed to import"),
        # the test helpers sit below the CLI and the demo (which runs its ranks with them)
        ("testing/scenarios.py", "import shoal.demo", "shoal.testing is not allowed to import shoal.demo"),
        (
            "testing/bench/kv_trace.py",
            "import shoal.cli.main",
            "shoal.testing is not allowed to import shoal.cli",
        ),
        # the KV store, once it exists, is a front door independent of the other two
        ("kv.py", "import shoal.checkpointer", "shoal.kv is not allowed to import shoal.checkpointer"),
        ("records/retention.py", "import shoal.kv", "shoal.records is not allowed to import shoal.kv"),
    ],
)
def test_import_contract_breaks_for_a_wrong_way_import(
    tmp_path: Path, module: str, line: str, broken: str
) -> None:
    package = _copy_of_the_package(tmp_path)
    (package / "kv.py").write_text('"""A front door to be."""\n')
    target = package / module
    target.write_text(target.read_text() + f"\n{line}  # the wrong way\n")
    result = _lint_imports(tmp_path, tmp_path / "src")
    assert result.returncode != 0, result.stdout
    assert broken in result.stdout, result.stdout


def test_a_new_top_level_module_must_be_placed_in_the_contract(tmp_path: Path) -> None:
    new = _copy_of_the_package(tmp_path) / "forecast"
    new.mkdir()
    (new / "__init__.py").write_text('"""Not in the contract yet."""\n')
    result = _lint_imports(tmp_path, tmp_path / "src")
    assert result.returncode != 0, result.stdout
    assert "shoal.forecast" in result.stdout, result.stdout


def test_version_has_one_source() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads(PYPROJECT.read_text())
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "shoal._version.__version__"}
    assert shoal.__version__ == shoal._version.__version__
    # the installed metadata (make reinstalls when _version.py changes)
    assert importlib.metadata.version("shoal") == shoal.__version__


def test_demo_and_test_helpers_import_without_test_dependencies() -> None:
    # None in sys.modules makes `import pytest` (and the others) raise ImportError
    blocked = ("pytest", "hypothesis", "moto")
    code = (
        "import sys\n"
        + "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
        + "import shoal.demo, shoal.testing, shoal.testing.multiproc, shoal.testing.checkpoints\n"
        + "import shoal.testing.scenarios, shoal.testing.restore_scenarios, shoal.cli.main\n"
        + "try:\n    shoal.testing.TierTests\nexcept ImportError:\n    pass\n"
        + "else:\n    raise SystemExit('TierTests imported without pytest')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_conformance_suite_is_still_reachable_from_the_package() -> None:
    from shoal.testing import TierTests
    from shoal.testing.tiers import TierTests as Direct

    assert TierTests is Direct
