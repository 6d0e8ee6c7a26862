"""Style, types and layering are part of the suite: ruff, mypy --strict, import-linter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
def test_ruff_lint_and_format() -> None:
    lint = _run(sys.executable, "-m", "ruff", "check", "vgpu", "tests", "bench")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = _run(sys.executable, "-m", "ruff", "format", "--check", "vgpu", "tests", "bench")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


@pytest.mark.timeout(300)
def test_mypy_strict() -> None:
    result = _run(sys.executable, "-m", "mypy")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(300)
def test_import_layers() -> None:
    result = _run(str(BIN / "lint-imports"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout
