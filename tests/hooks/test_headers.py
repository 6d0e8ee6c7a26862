"""The hook declares the few CUDA and NVML types it needs by hand (no toolkit at
build time). These tests hold those declarations to the real headers where
they are available, and to pynvml's structures (always installed) for NVML."""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sysconfig
from pathlib import Path

import pynvml
import pytest

from tests.hooks.test_hooks import HOOKS

ABI_SOURCE = HOOKS / "tests" / "abi.c"


def _include_dirs() -> list[Path]:
    """Where CUDA headers may be: CUDA_HOME / CUDA_PATH, /usr/local/cuda, and the
    include directories of NVIDIA's pip packages when installed."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    dirs = [Path(r) / "include" for r in roots if r]
    nvidia = Path(sysconfig.get_paths()["purelib"]) / "nvidia"
    if nvidia.is_dir():
        dirs += sorted(nvidia.glob("*/include"))
    return [d for d in dirs if d.is_dir()]


def _find(name: str) -> Path | None:
    return next((d for d in _include_dirs() if (d / name).is_file()), None)


def _cuda_include() -> Path:
    found = _find("cudaTypedefs.h")
    if found is None or not (found / "cuda.h").is_file():
        pytest.skip(
            "no CUDA headers (cuda.h + cudaTypedefs.h) in CUDA_HOME, /usr/local/cuda or "
            "NVIDIA pip packages: the hook's CUDA types are not checked here"
        )
    return found


def _abi(tmp_path: Path, *flags: str) -> dict[str, object]:
    binary = tmp_path / ("abi_real" if flags else "abi_ours")
    build = subprocess.run(
        ["gcc", "-std=gnu11", "-Wall", "-Wextra", "-Werror", *flags, "-o", str(binary),
         str(ABI_SOURCE)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr  # a signature mismatch names the entry point
    run = subprocess.run([str(binary)], capture_output=True, text=True, check=True)
    return json.loads(run.stdout)  # type: ignore[no-any-return]


def test_cuda_types_and_signatures_match_the_real_headers(tmp_path: Path) -> None:
    include = _cuda_include()
    flags = ["-DVGPU_REAL_HEADERS", f"-I{include}"]
    nvml = _find("nvml.h")
    if nvml is not None:
        flags += ["-DVGPU_REAL_NVML", f"-I{nvml}"]
    real, ours = _abi(tmp_path, *flags), _abi(tmp_path)
    real.pop("headers")
    ours.pop("headers")
    if nvml is None:
        real.pop("nvml")  # the hook's own NVML types on both sides: checked below
        ours.pop("nvml")
    assert ours == real


def test_signature_check_catches_a_mismatch(tmp_path: Path) -> None:
    include = _cuda_include()
    build = subprocess.run(
        ["gcc", "-std=gnu11", "-DVGPU_REAL_HEADERS", "-DVGPU_ABI_SELFTEST", f"-I{include}",
         "-o", str(tmp_path / "abi"), str(ABI_SOURCE)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert build.returncode != 0
    assert "cuMemAlloc_v2: the hook" in build.stderr and "PFN_cuMemGetInfo_v3020" in build.stderr


def _pfn_versions(include: Path) -> dict[str, set[tuple[int, int]]]:
    """(version, per-thread) of every PFN_<name>_v<version>[_ptsz] in cudaTypedefs.h."""
    text = (include / "cudaTypedefs.h").read_text()
    versions: dict[str, set[tuple[int, int]]] = {}
    for name, version, ptsz in re.findall(r"\*PFN_(cu\w+?)_v(\d+)(_ptsz|_ptds)?\)", text):
        versions.setdefault(name, set()).add((int(version), int(bool(ptsz))))
    return versions


def _hook_table() -> tuple[int, list[tuple[str, str, int, int, int]]]:
    text = (HOOKS / "vgpu_hooks.h").read_text()
    (known,) = re.findall(r"#define VGPU_PROC_KNOWN_MAX (\d+)", text)
    rows = re.findall(r"X\((cu\w+), (cu\w+), (\d+), (\d+), ([01]),", text)
    return int(known), [(s, b, int(a), int(u), int(p)) for s, b, a, u, p in rows]


def test_get_proc_address_table_matches_the_drivers_versions() -> None:
    """Each entry designates exactly the versions the driver maps to that ABI:
    [since, until) where until is the next PFN version of the same name."""
    pfn = _pfn_versions(_cuda_include())
    known, table = _hook_table()
    assert len(table) >= 49
    for symbol, base, since, until, ptsz in table:
        versions = sorted(v for v, p in pfn.get(base, set()) if p == ptsz and v <= known)
        assert since in versions, f"{symbol}: no PFN_{base}_v{since}"
        later = [v for v in versions if v > since]
        assert until == (later[0] if later else 0), f"{symbol}: until {until}, driver {later}"


@pytest.fixture(scope="module")
def our_nvml(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    abi = _abi(tmp_path_factory.mktemp("abi"))
    return abi["nvml"]  # type: ignore[return-value]


def _layout(struct: type[ctypes.Structure]) -> list[int]:
    return [ctypes.sizeof(struct)] + [getattr(struct, f).offset for f, *_ in struct._fields_]


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        ("nvmlMemory_t", "c_nvmlMemory_t"),
        ("nvmlMemory_v2_t", "c_nvmlMemory_v2_t"),
        ("nvmlProcessInfo_v2_t", "c_nvmlProcessInfo_v2_t"),
        ("nvmlProcessInfo_v2_t", "c_nvmlProcessInfo_v3_t"),
        ("nvmlProcessUtilizationSample_t", "c_nvmlProcessUtilizationSample_t"),
        ("nvmlUtilization_t", "c_nvmlUtilization_t"),
    ],
)
def test_nvml_struct_matches_pynvml(our_nvml: dict[str, list[int]], ours: str, theirs: str) -> None:
    layout = _layout(getattr(pynvml, theirs))
    assert our_nvml[ours] == layout[: len(our_nvml[ours])]


def test_nvml_codes_match_pynvml(our_nvml: dict[str, int]) -> None:
    for name in ("NVML_SUCCESS", "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NOT_FOUND",
                 "NVML_ERROR_INSUFFICIENT_SIZE"):  # fmt: skip
        assert our_nvml[name] == getattr(pynvml, name), name
