#!/usr/bin/env bash
# Checks libvgpu on a machine with a real NVIDIA GPU and PyTorch:
#   1. VGPU_MEMORY_LIMIT_MIB=2048: torch.cuda.mem_get_info() reports a 2 GiB
#      total, 1 GiB can be allocated, 3 GiB raises torch.cuda.OutOfMemoryError;
#   2. VGPU_CORE_LIMIT=30: a matmul loop runs at roughly 30 % of its
#      unthrottled throughput (accepted: 15-45 %).
# Prints one JSON summary; exits non-zero if any check failed.
# Usage: hooks/gpu-check.sh   (PYTHON=... to pick the interpreter)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
make -s -C "$here" >&2
lib="$here/build/libvgpu.so"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cat >"$work/check.py" <<'PY'
import json, os, sys, time
import torch

GIB = 1 << 30
mode = sys.argv[1]
torch.cuda.init()
if mode == "memory":
    free, total = torch.cuda.mem_get_info()
    small_ok = big_refused = False
    try:
        held = torch.empty(GIB, dtype=torch.uint8, device="cuda")
        small_ok = True
    except torch.cuda.OutOfMemoryError:
        pass
    try:
        torch.empty(3 * GIB, dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError:
        big_refused = True
    print(json.dumps({"total": total, "free": free, "alloc_1gib_ok": small_ok,
                      "alloc_3gib_refused": big_refused}))
else:
    seconds, warmup = float(sys.argv[2]), float(sys.argv[3])
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    def loop(duration):
        n, end = 0, time.monotonic() + duration
        while time.monotonic() < end:
            for _ in range(4):
                torch.matmul(a, b)
            torch.cuda.synchronize()
            n += 4
        return n / duration
    loop(warmup)  # lets the throttle converge
    print(json.dumps({"matmul_per_s": loop(seconds)}))
PY

run() { # run ENV... -- ARGS: one JSON line from check.py under the hook
    local envs=()
    while [[ $1 != -- ]]; do envs+=("$1"); shift; done
    shift
    env "${envs[@]}" LD_PRELOAD="$lib" VGPU_SHARED_DIR="$work" "$python" "$work/check.py" "$@"
}

failed='{"error": "the check crashed; see stderr"}'
mem=$(run VGPU_MEMORY_LIMIT_MIB=2048 -- memory) || mem=$failed
base=$(run -- compute 8 2) || base=$failed
slow=$(run VGPU_CORE_LIMIT=30 -- compute 8 5) || slow=$failed

"$python" - "$mem" "$base" "$slow" <<'PY'
import json, sys
mem, base, slow = (json.loads(a) for a in sys.argv[1:])
ratio = slow.get("matmul_per_s", 0) / base.get("matmul_per_s", float("inf"))
checks = {
    "memory_total_is_2gib": mem.get("total") == 2 << 30,
    "memory_1gib_allocates": mem.get("alloc_1gib_ok", False),
    "memory_3gib_refused": mem.get("alloc_3gib_refused", False),
    "compute_ratio_near_30pct": 0.15 <= ratio <= 0.45,
}
print(json.dumps({"memory": mem, "unthrottled": base, "core_limit_30": slow,
                  "throughput_ratio": round(ratio, 3), "checks": checks,
                  "ok": all(checks.values())}))
sys.exit(0 if all(checks.values()) else 1)
PY
