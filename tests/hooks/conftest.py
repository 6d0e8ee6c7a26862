"""Every test here runs programs built from hooks/: build them first."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _hook_binaries(hook_binaries: None) -> None:
    return hook_binaries
