#!/usr/bin/env bash
# The real-GPU check of libvgpu: one prepared script for a single H100/H200
# with PyTorch, every step under its own timeout, one JSON report on stdout
# (exit 0 when every check passed).  Under 8 minutes.
#   1. versions: driver, CUDA, torch, and the glibc floor of the library;
#   2. memory, 4 GiB limit, under PyTorch's default allocator,
#      expandable_segments and cudaMallocAsync: 3 GiB succeeds, 5 GiB raises
#      OutOfMemoryError, torch and nvidia-smi report a 4 GiB total;
#   3. two processes of 3 GiB: the second fails, and succeeds once the first
#      is killed -9;
#   4. the per-process memory the limit does not charge (NVML's figure minus
#      the budget's);
#   5. compute: an fp16 matmul loop at VGPU_CORE_LIMIT=30 runs at 0.25-0.35 of
#      its unlimited rate, also as CUDA-graph replay;
#   6. two tenants in separate PID namespaces at 30 and 60, started together
#      (their contexts are likely created at the same moment), each get their
#      own share and each tells its host pid (no "could not tell" line);
#   7. with the hook loaded and no limits, throughput within 3 % of no hook;
#   8. compute arbitration (docs/enforcement-arbiter.md): bench/arbiter.py's
#      scenarios (alone at 30 % with and without a cap of 100, 10/90, 30/60,
#      a noisy neighbour, a 5 % light neighbour beside a greedy tenant, three
#      tenants arriving and leaving) with the
#      daemon's arbiter on the real NVML and fp16 matmul loops as tenants;
#      reported, not judged (its targets were set on the stand-in).
# Usage: hooks/gpu-check.sh [--dry-run]   (PYTHON=... picks the interpreter)
# --dry-run checks the script and its Python without a GPU and prints the plan.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
python=${PYTHON:-python3}
dry_run=0
[[ ${1:-} == --dry-run ]] && dry_run=1
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
GIB=$((1 << 30))

cat >"$work/check.py" <<'PY'
"""One step of hooks/gpu-check.sh; prints one JSON line."""
import json, os, sys, time

mode = sys.argv[1]
if mode == "syntax":
    sys.exit(0)
import torch

GIB = 1 << 30


def emit(**fields):
    print(json.dumps(fields), flush=True)


def tensor(gib):
    return torch.empty(int(gib * GIB), dtype=torch.uint8, device="cuda")


if mode == "info":
    emit(torch=torch.__version__, cuda=torch.version.cuda, device=torch.cuda.get_device_name(0))
elif mode == "memory":
    free, total = torch.cuda.mem_get_info()
    ok3 = refused5 = False
    try:
        held = tensor(3)
        ok3 = True
        del held
    except torch.cuda.OutOfMemoryError:
        pass
    torch.cuda.empty_cache()
    try:
        tensor(5)
    except torch.cuda.OutOfMemoryError:
        refused5 = True
    emit(total=total, free=free, alloc_3gib_ok=ok3, alloc_5gib_refused=refused5,
         allocator=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"))
elif mode == "hold":
    held = tensor(float(sys.argv[2]))
    torch.cuda.synchronize()
    emit(held=True, pid=os.getpid())
    time.sleep(3600)
elif mode == "try":
    try:
        held = tensor(float(sys.argv[2]))
        emit(ok=True)
    except torch.cuda.OutOfMemoryError:
        emit(ok=False)
elif mode == "overhead":
    held = tensor(1)
    torch.cuda.synchronize()
    sys.path.insert(0, os.environ["VGPU_REPO"])
    from vgpu.adapters import budget
    charged = budget.usage_mib(os.path.join(os.environ["VGPU_SHARED_DIR"], budget.FILE_NAME))
    emit(pid=os.getpid(), charged_mib=charged)
    sys.stdin.readline()  # nvidia-smi reads our figure meanwhile
elif mode == "matmul":
    seconds, warmup, graphs = float(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "graph"
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    step = lambda: torch.matmul(a, b)
    if graphs:
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(4):
                torch.matmul(a, b)
        step = g.replay

    def loop(duration):
        n, end = 0, time.monotonic() + duration
        while time.monotonic() < end:
            for _ in range(1 if graphs else 4):
                step()
            torch.cuda.synchronize()
            n += 4
        return n / duration

    loop(warmup)  # lets the throttle converge
    emit(matmul_per_s=loop(seconds), graphs=graphs)
elif mode == "load":  # bench/arbiter.py's tenant: PHASES = DEMAND:SECONDS[,...]
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    for _ in range(3):
        torch.matmul(a, b)
    torch.cuda.synchronize()
    t = time.monotonic()
    for _ in range(20):
        torch.matmul(a, b)
    torch.cuda.synchronize()
    per_s, window_s = (time.monotonic() - t) / 20, 0.02
    start_at = float(os.environ.get("TENANT_START_AT", "0"))
    time.sleep(max(0.0, start_at - time.time()))  # every tenant's phases start together
    for phase in sys.argv[2].split(","):
        demand, seconds = (float(x) for x in phase.split(":"))
        end, n = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            w0 = time.monotonic()
            k = 16 if demand >= 100 else int(demand / 100 * window_s / per_s)
            for _ in range(k):
                torch.matmul(a, b)
            if k:
                torch.cuda.synchronize()
            n += k
            if demand < 100:
                time.sleep(max(0.0, w0 + window_s - time.monotonic()))
        emit(demand=demand, seconds=seconds, matmuls=n, matmul_s=per_s)
PY

if ((dry_run)); then
    "$python" -m py_compile "$work/check.py"
    "$python" "$work/check.py" syntax
    PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$python" -m bench.arbiter --help >/dev/null
    echo '{"dry_run": true, "steps": ["versions", "memory_default", "memory_expandable_segments", "memory_cudaMallocAsync", "two_processes", "overhead", "compute_30", "compute_30_graphs", "tenants_30_60", "hook_without_limits", "arbiter_scenarios"]}'
    exit 0
fi

make -s -C "$here" >&2
lib="$here/build/libvgpu.so"

# run TIMEOUT [ENV=...] -- ARGS: one JSON line from check.py under the hook ("null" on failure)
run() {
    local limit=$1 envs=()
    shift
    while [[ $1 != -- ]]; do envs+=("$1"); shift; done
    shift
    local shared
    shared=$(mktemp -d -p "$work")
    timeout -s KILL "$limit" env "${envs[@]}" LD_PRELOAD="$lib" VGPU_SHARED_DIR="$shared" \
        VGPU_REPO="$repo" "$python" "$work/check.py" "$@" 2>>"$work/stderr" | tail -n 1 || echo null
}
bare() { # the same without the hook
    local limit=$1
    shift
    timeout -s KILL "$limit" "$python" "$work/check.py" "$@" 2>>"$work/stderr" | tail -n 1 || echo null
}
ratio() { "$python" -c 'import json,sys; a,b=(json.loads(x) or {} for x in sys.argv[1:]); print(round(a.get("matmul_per_s",0)/b.get("matmul_per_s",1e-9),3))' "$@"; }

# 1. versions
info=$(bare 60 info)
driver=$(timeout 20 nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1 || echo unknown)
glibc=$(readelf --dyn-syms --version-info -W "$lib" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)

# 2. memory under each allocator
mem4="VGPU_MEMORY_LIMIT_MIB=4096"
mem_default=$(run 120 $mem4 -- memory)
mem_expandable=$(run 120 $mem4 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -- memory)
mem_async=$(run 120 $mem4 PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync -- memory)
smi_total=$(timeout 30 env LD_PRELOAD="$lib" VGPU_SHARED_DIR="$work" $mem4 \
    nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 || echo 0)

# 3. two processes of 3 GiB in one container (one shared directory)
pair=$(mktemp -d -p "$work")
mkfifo "$work/hold.out"
# No timeout wrapper: $! must be the Python process itself, which gets the kill -9.
env $mem4 LD_PRELOAD="$lib" VGPU_SHARED_DIR="$pair" "$python" "$work/check.py" hold 3 \
    >"$work/hold.out" 2>>"$work/stderr" &
holder=$!
read -r -t 120 held <"$work/hold.out" || held=null
second=$(timeout -s KILL 120 env $mem4 LD_PRELOAD="$lib" VGPU_SHARED_DIR="$pair" "$python" "$work/check.py" try 3 2>>"$work/stderr" | tail -n 1 || echo null)
kill -9 "$holder" 2>/dev/null || true
wait "$holder" 2>/dev/null || true
after_kill=$(timeout -s KILL 120 env $mem4 LD_PRELOAD="$lib" VGPU_SHARED_DIR="$pair" "$python" "$work/check.py" try 3 2>>"$work/stderr" | tail -n 1 || echo null)

# 4. what the budget does not charge: NVML's figure for the process minus the budget's
over=$(mktemp -d -p "$work")
coproc OVER { timeout -s KILL 120 env $mem4 LD_PRELOAD="$lib" VGPU_SHARED_DIR="$over" VGPU_REPO="$repo" \
    "$python" "$work/check.py" overhead 2>>"$work/stderr"; }
read -r -t 100 overhead <&"${OVER[0]}" || overhead=null
opid=$("$python" -c 'import json,sys; print((json.loads(sys.argv[1]) or {}).get("pid", 0))' "$overhead")
nvml_mib=$(timeout 20 nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits \
    | awk -F', ' -v p="$opid" '$1 == p {print $2}' | head -1)
echo >&"${OVER[1]}" || true
wait "$OVER_PID" 2>/dev/null || true

# 5. compute at 30 %
base=$(run 90 -- matmul 10 3 kernels)
slow=$(run 120 VGPU_CORE_LIMIT=30 -- matmul 15 5 kernels)
gbase=$(run 90 -- matmul 10 3 graph)
gslow=$(run 120 VGPU_CORE_LIMIT=30 -- matmul 15 5 graph)

# 6. two tenants, each in its own PID namespace, at 30 and 60
tenant() {
    local core=$1 shared
    shared=$(mktemp -d -p "$work")
    local ns=(unshare --pid --fork --mount-proc)
    (($(id -u) == 0)) || ns=(unshare --user --map-root-user --pid --fork --mount-proc)
    timeout -s KILL 120 "${ns[@]}" env VGPU_CORE_LIMIT="$core" LD_PRELOAD="$lib" \
        VGPU_SHARED_DIR="$shared" "$python" "$work/check.py" matmul 20 8 kernels 2>>"$work/t$core.err" | tail -n 1
}
tenant 30 >"$work/t30" &
tenant 60 >"$work/t60" &
wait
tenant_log=$(cat "$work/t30.err" "$work/t60.err" 2>/dev/null | grep '^vgpu:' | head -n 8 || true)
t30=$(cat "$work/t30" 2>/dev/null || true)
t60=$(cat "$work/t60" 2>/dev/null || true)

# 7. the hook without limits costs nothing
nohook=$(bare 90 matmul 10 3 kernels)
hooked=$(run 90 -- matmul 10 3 kernels)

# 8. compute arbitration: the daemon's arbiter on the real NVML, matmul tenants
(cd "$repo" && timeout -s KILL 300 env PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" \
    "$python" -m bench.arbiter --real --tenant-command "$python $work/check.py" \
    --library "$lib" --out "$work/arbiter.json" >/dev/null 2>>"$work/stderr") || true
arbiter=$(cat "$work/arbiter.json" 2>/dev/null || echo null)

"$python" - "$info" "$driver" "$glibc" "$mem_default" "$mem_expandable" "$mem_async" "$smi_total" \
    "$held" "$second" "$after_kill" "$overhead" "${nvml_mib:-0}" "$base" "$slow" "$gbase" "$gslow" \
    "${t30:-null}" "${t60:-null}" "$nohook" "$hooked" "$tenant_log" "$arbiter" <<'PY'
import json, sys
a = sys.argv[1:]
j = lambda s: json.loads(s) if s and s != "null" else {}
info, driver, glibc = j(a[0]), a[1], a[2]
mems = [j(x) for x in a[3:6]]
smi_total = int(a[6] or 0)
held, second, after_kill, overhead = j(a[7]), j(a[8]), j(a[9]), j(a[10])
nvml_mib = int(a[11] or 0)
base, slow, gbase, gslow, t30, t60, nohook, hooked = (j(x) for x in a[12:20])
tenant_log = a[20].splitlines()
arbiter = j(a[21])
rate = lambda x, y: round(x.get("matmul_per_s", 0) / y.get("matmul_per_s", float("inf")), 3)
GIB = 1 << 30
checks = {}
for m in mems:
    name = m.get("allocator", "?")
    checks[f"memory[{name}]: total 4 GiB"] = m.get("total") == 4 * GIB
    checks[f"memory[{name}]: 3 GiB allocates"] = m.get("alloc_3gib_ok", False)
    checks[f"memory[{name}]: 5 GiB refused"] = m.get("alloc_5gib_refused", False)
checks["nvidia-smi total 4 GiB"] = smi_total == 4096
checks["second 3 GiB process refused"] = bool(held) and second.get("ok") is False
checks["it succeeds after the first is killed -9"] = after_kill.get("ok") is True
r30, g30 = rate(slow, base), rate(gslow, gbase)
checks["compute 30%: 0.25-0.35 of unlimited"] = 0.25 <= r30 <= 0.35
checks["compute 30% with CUDA graphs: 0.25-0.35"] = 0.25 <= g30 <= 0.35
s30, s60 = rate(t30, base), rate(t60, base)
checks["tenant at 30% gets its share"] = 0.22 <= s30 <= 0.38
checks["tenant at 60% gets its share"] = 0.5 <= s60 <= 0.7
checks["tenants told their host pids"] = not any("could not tell" in x for x in tenant_log)
free_cost = rate(hooked, nohook)
checks["no limits: within 3% of no hook"] = free_cost >= 0.97
charged = overhead.get("charged_mib")
report = {
    "driver": driver, "cuda": info.get("cuda"), "torch": info.get("torch"),
    "device": info.get("device"), "glibc_floor": glibc,
    "memory": mems, "nvidia_smi_total_mib": smi_total,
    "two_processes": {"first": held, "second": second, "after_kill_9": after_kill},
    "overhead": {"nvml_used_mib": nvml_mib, "charged_mib": charged,
                 "uncharged_mib": nvml_mib - charged if charged is not None else None},
    "compute": {"unlimited": base, "limit_30": slow, "ratio_30": r30,
                "graphs_unlimited": gbase, "graphs_limit_30": gslow, "graphs_ratio_30": g30,
                "tenant_30": t30, "tenant_60": t60, "share_30": s30, "share_60": s60,
                "tenant_log": tenant_log,
                "no_hook": nohook, "hook_no_limits": hooked, "hook_cost_ratio": free_cost},
    "arbiter": arbiter,
    "checks": checks, "ok": all(checks.values()),
}
print(json.dumps(report))
sys.exit(0 if report["ok"] else 1)
PY
