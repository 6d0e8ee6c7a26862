"""What /etc/ld.so.preload naming libvgpu costs a process that never uses CUDA.

Runs hooks/tests/preload_bench.sh: in a private mount namespace (root and
unshare(1) needed; never on the machine itself) it starts /bin/true and
`python3 -c pass` many times with no preload, with an empty library preloaded
(the least any preload costs) and with libvgpu, and reports the mean CPU time
(user + system) and wall time per start. The hook does nothing until a CUDA or
NVML entry point is called, so what it adds is the loader's work: mapping it
and its two compatibility dependencies (libdl.so.2, libpthread.so.0).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from bench.common import Json, Target

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "hooks" / "build"
SCRIPT = ROOT / "hooks" / "tests" / "preload_bench.sh"
TIMEOUT_S = 600.0
# What libvgpu adds per exec of /bin/true beyond what any preloaded library costs
# (an empty one): the part the hook's own build decides.
OVER_EMPTY_CPU_LIMIT_US = 200.0


def _unavailable(reason: str) -> Json:
    return {"available": False, "reason": reason, "targets": []}


def run(rounds: int = 5, n_true: int = 1000, n_python: int = 40) -> Json:
    needed = [BUILD / "libvgpu.so", BUILD / "libempty.so", BUILD / "exec_loop"]
    missing = [str(p.relative_to(ROOT)) for p in needed if not p.is_file()]
    if missing:
        return _unavailable(f"{', '.join(missing)} not built (run `make -C hooks test-bins`)")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return _unavailable("needs root and unshare(1) for a private mount namespace")
    env = {**os.environ, "ROUNDS": str(rounds), "N_TRUE": str(n_true), "N_PY": str(n_python)}
    try:
        proc = subprocess.run(
            ["sh", str(SCRIPT), str(BUILD)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return _unavailable(f"{SCRIPT.name} took over {TIMEOUT_S:.0f} s")
    cpu_ns: dict[tuple[str, str], int] = {}
    wall_ns: dict[tuple[str, str], int] = {}
    for line in proc.stdout.splitlines():
        fields = line.split()
        if len(fields) == 4 and fields[2].isdigit() and fields[3].isdigit():
            wall_ns[fields[0], fields[1]] = int(fields[2])
            cpu_ns[fields[0], fields[1]] = int(fields[3])
    if proc.returncode != 0 or len(cpu_ns) != 6:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return _unavailable(f"{SCRIPT.name} exited {proc.returncode}: " + " | ".join(tail))
    metrics: Json = {}
    for program in ("true", "python3"):
        for preload in ("none", "empty", "vgpu"):
            metrics[f"{program}_{preload}_cpu_us"] = round(cpu_ns[program, preload] / 1e3, 1)
            metrics[f"{program}_{preload}_wall_us"] = round(wall_ns[program, preload] / 1e3, 1)
    true_added_us = (cpu_ns["true", "vgpu"] - cpu_ns["true", "none"]) / 1e3
    over_empty_us = (cpu_ns["true", "vgpu"] - cpu_ns["true", "empty"]) / 1e3
    python_added = cpu_ns["python3", "vgpu"] / cpu_ns["python3", "none"] * 100 - 100
    metrics["true_vgpu_added_cpu_us"] = round(true_added_us, 1)
    metrics["true_vgpu_over_empty_cpu_us"] = round(over_empty_us, 1)
    metrics["python3_vgpu_added_cpu_percent"] = round(python_added, 2)
    targets = [
        Target("preload: libvgpu over an empty library, CPU per exec of /bin/true",
               over_empty_us, OVER_EMPTY_CPU_LIMIT_US, "us"),
    ]  # fmt: skip
    return {"available": True, "metrics": metrics, "targets": [t.to_json() for t in targets]}
