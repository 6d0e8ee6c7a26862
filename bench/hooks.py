"""Hook cost: what libvgpu adds per allocation/free pair and per kernel launch.

Runs ``make -C hooks bench`` (hooks/tests/bench.sh against the stand-in driver) when
``hooks/build/libvgpu.so`` and a ``bench`` target exist; otherwise the section says
why it was not measured. A missing hook is never a failure of the benchmark run.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

from bench.common import Json, Target

ROOT = Path(__file__).resolve().parent.parent
HOOKS = ROOT / "hooks"
LIBRARY = HOOKS / "build" / "libvgpu.so"
TIMEOUT_S = 120.0
PAIR_LIMIT_NS = 200.0  # added per cuMemAlloc + cuMemFree pair
LAUNCH_LIMIT_NS = 20.0  # added per kernel launch


def _unavailable(reason: str) -> Json:
    return {"available": False, "reason": reason, "targets": []}


def run() -> Json:
    makefile = HOOKS / "Makefile"
    if not LIBRARY.is_file():
        return _unavailable(f"{LIBRARY.relative_to(ROOT)} is not built (run `make -C hooks`)")
    if not makefile.is_file() or not re.search(r"^bench\s*:", makefile.read_text(), re.M):
        return _unavailable("hooks/Makefile has no bench target")
    if shutil.which("make") is None:
        return _unavailable("make is not installed")
    try:
        proc = subprocess.run(
            ["make", "--no-print-directory", "-s", "-C", str(HOOKS), "bench"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return _unavailable(f"`make -C hooks bench` took over {TIMEOUT_S:.0f} s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return _unavailable(
            f"`make -C hooks bench` exited {proc.returncode} without a JSON line: "
            + " | ".join(tail)
        )
    try:
        numbers = json.loads(lines[-1])
    except json.JSONDecodeError as exc:
        return _unavailable(f"`make -C hooks bench` printed invalid JSON: {exc}")
    metrics = {k: v for k, v in numbers.items() if isinstance(v, int | float)}
    # hooks/tests/bench.sh: `<kind>_ns` is what the hook adds (hooked minus bare),
    # `bare_<kind>_ns` the stand-in driver alone.
    targets = [
        Target(name, float(metrics[key]), limit, "ns")
        for name, key, limit in (
            ("hook cost per alloc/free pair", "alloc_free_pair_ns", PAIR_LIMIT_NS),
            ("hook cost per kernel launch", "launch_ns", LAUNCH_LIMIT_NS),
        )
        if key in metrics
    ]
    return {"available": True, "metrics": metrics, "targets": [t.to_json() for t in targets]}
