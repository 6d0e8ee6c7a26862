"""docs/configuration.md (the config reference) stays in step with vgpu.config.KEYS."""

from __future__ import annotations

import re
from pathlib import Path

from vgpu.config import KEYS, Settings

README = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
ROW = re.compile(r"^\| `(\w+)` \| (.+?) \| (.+) \|$")


def _rows() -> dict[str, tuple[str, str]]:
    rows = {}
    for line in README.read_text().splitlines():
        match = ROW.match(line)
        if match and match.group(1) in Settings.__dataclass_fields__:
            rows[match.group(1)] = (match.group(2), match.group(3))
    return rows


def _shown(value: object) -> str:
    if value is None:
        return "*(unset)*"
    if isinstance(value, list):
        return "`[" + ", ".join(str(v) for v in value) + "]`"
    return f"`{value}`"


def test_config_table_lists_every_key_with_its_default_and_help() -> None:
    rows = _rows()
    assert list(rows) == list(KEYS)
    defaults = Settings().public()
    for key, help_text in KEYS.items():
        assert rows[key] == (_shown(defaults[key]), help_text), key
