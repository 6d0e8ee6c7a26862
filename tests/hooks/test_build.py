"""What the built library promises about itself: one budget-file layout shared with
the daemon, loadable on old glibc, harmless where it cannot work (musl)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.hooks.test_hooks import BUILD, HOOKS, LIB
from vgpu.adapters import budget
from vgpu.core.contract import BUDGET_FILE_NAME

GLIBC_FLOOR = (2, 28)  # UBI 8; Ubuntu 20.04 has 2.31


def test_budget_file_layout_is_the_same_in_c_and_python() -> None:
    layout = json.loads(
        subprocess.run(
            [str(BUILD / "vgpu_layout")], capture_output=True, text=True, check=True
        ).stdout
    )
    header = (HOOKS / "vgpu_shared.h").read_text()
    (declared,) = re.findall(r"#define VGPU_SHARED_FILE_BYTES (\d+)u", header)
    assert layout["file_bytes"] == int(declared) == budget.FILE_BYTES
    assert layout["sizeof"] <= budget.FILE_BYTES < layout["sizeof"] + 4096
    assert (layout["magic"], layout["version"]) == (budget.MAGIC, budget.VERSION)
    assert layout["file"] == budget.FILE_NAME == BUDGET_FILE_NAME
    assert (layout["max_devices"], layout["max_slots"]) == (budget.MAX_DEVICES, budget.MAX_SLOTS)
    assert layout["uuid_bytes"] == budget.UUID_BYTES
    assert layout["slot_lock_base"] == budget.SLOT_LOCK_BASE
    offsets = layout["offsets"]
    assert offsets["arbiter"] == budget.ARBITER_AT
    assert offsets["used"] == budget.USED_AT
    assert offsets["devices"] == budget.DEVICES_AT
    assert offsets["slots"] == budget.SLOTS_AT
    assert offsets["poll_seq"] == budget.POLL_AT
    assert offsets["teller_at_ns"] == budget.TELLER_AT
    assert offsets["told"] == budget.TOLD_AT
    assert offsets["awaiting"] == budget.AWAITING_AT
    assert offsets["measured"] == budget.MEASURED_AT
    assert layout["pid_lock_base"] == budget.PID_LOCK_BASE
    assert layout["slot_bytes"] == budget.SLOT.size
    assert layout["slot_offsets"] == {"pid": 0, "host_pid": 4, "used": 8}
    fields = ["magic", "version", "file_bytes", "slot_count", "slot_hwm", "device_count"]
    assert [offsets[f] for f in fields] == [0, 4, 8, 12, 16, 20]  # budget.HEADER's order


def _glibc_versions(path: Path) -> set[tuple[int, ...]]:
    out = subprocess.run(
        ["readelf", "--dyn-syms", "--version-info", "-W", str(path)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return {tuple(int(p) for p in v.split(".")) for v in re.findall(r"GLIBC_(\d+(?:\.\d+)+)", out)}


def test_library_loads_on_glibc_2_28() -> None:
    """Every GLIBC_x.y the library needs (symbols and version requirements) is at
    most 2.28: built on a newer glibc it must not pick up 2.34's dlopen/pthread."""
    if shutil.which("readelf") is None:
        pytest.fail("readelf is required (binutils)")
    versions = _glibc_versions(LIB)
    assert versions, "no GLIBC versions found: is this a glibc build?"
    assert max(versions) <= GLIBC_FLOOR, f"needs GLIBC_{'.'.join(map(str, max(versions)))}"


def test_floor_check_sees_a_newer_symbol(tmp_path: Path) -> None:
    """The check above can fail: a library calling dlopen unpinned needs GLIBC_2.34."""
    source = tmp_path / "new.c"
    source.write_text('#include <dlfcn.h>\nvoid *f(void) { return dlopen("x", RTLD_NOW); }\n')
    built = tmp_path / "libnew.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(built), str(source)], check=True)
    glibc = subprocess.run(["ldd", "--version"], capture_output=True, text=True).stdout
    if "2.3" not in glibc.splitlines()[0] or max(_glibc_versions(built)) < (2, 34):
        pytest.skip("this glibc predates 2.34: nothing newer to catch")
    assert max(_glibc_versions(built)) > GLIBC_FLOOR


@pytest.mark.timeout(60)
def test_a_musl_program_still_starts_with_the_library_preloaded(tmp_path: Path) -> None:
    musl_gcc = shutil.which("musl-gcc")
    if musl_gcc is None:
        pytest.skip("musl-gcc not installed (apt-get install musl-tools): musl start not checked")
    source = tmp_path / "hello.c"
    source.write_text(
        "#include <dlfcn.h>\n#include <stdio.h>\n#include <string.h>\n"
        "int main(void) {\n"
        '  size_t (*len)(const char *) = (size_t (*)(const char *))dlsym(RTLD_DEFAULT, "strlen");\n'
        '  printf("started %zu\\n", len ? len("four") : 0);\n'
        "  return 0;\n}\n"
    )
    program = tmp_path / "hello"
    subprocess.run([musl_gcc, "-o", str(program), str(source)], check=True, timeout=30)
    run = subprocess.run(
        [str(program)],
        env={"LD_PRELOAD": str(LIB), "VGPU_MEMORY_LIMIT_MIB": "100", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout == "started 4\n"  # the program's own dlsym still works through ours
