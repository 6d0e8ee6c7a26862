"""`vgpu demo`: the daemon on mock GPUs against the built-in kubelet simulator
and fake API server, admitting a handful of sample pods. No GPU, no cluster."""

from __future__ import annotations

import shutil
import sys
import time
from typing import Any

from vgpu.cli.status import collect, render
from vgpu.sim.harness import SimNode


def _say(text: str = "") -> None:
    print(text, flush=True)


def run_demo(gpus: str = "preset:2xH200", keep: bool = False) -> int:
    started = time.monotonic()
    node = SimNode(gpus=gpus, node="demo-node")
    core, mem = node.core, node.memory
    try:
        _say(f"vgpu demo: mock GPUs ({gpus}), the kubelet simulator and a fake API server")
        _say(f"  working directory {node.root}")
        node.start()
        _say(
            f"  daemon registered: {core} x{node.kubelet.capacity(core)}, "
            f"{mem} x{node.kubelet.capacity(mem)} (1 unit = 256 MiB)\n"
        )
        samples: list[tuple[str, dict[str, Any], str]] = [
            ("trainer", {core: 100}, "one whole card, exclusive"),
            ("notebook", {core: 30, mem: 40}, "30% of a card, 10 GiB"),
            ("inference", {core: 40, mem: 160}, "40% of a card, 40 GiB, packed on the same card"),
            ("ci-job-a", {core: 10, mem: 16}, "identical pods A..."),
            ("ci-job-b", {core: 10, mem: 16}, "...and B: each keeps its own config"),
            ("embeddings", {mem: 32}, "memory only, best-effort compute"),
            ("no-memory", {core: 10}, "fractional core without memory: refused with the fix"),
            ("too-big", {core: 10, mem: 300}, "75 GiB: the node has room in total, no card alone"),
        ]
        pods = {}
        for name, requests, note in samples:
            requests = {k: v for k, v in requests.items() if v}
            pod = node.pod(name, requests)
            pods[name] = pod
            result = node.submit(pod)
            asked = ", ".join(f"{k.split('/')[1]}={v}" for k, v in requests.items())
            if result.ok:
                envs = result.containers[0].envs
                card = envs.get("NVIDIA_VISIBLE_DEVICES", "?")
                limits = []
                if "VGPU_CORE_LIMIT" in envs:
                    limits.append(f"core {envs['VGPU_CORE_LIMIT']}%")
                if "VGPU_MEMORY_LIMIT_MIB" in envs:
                    limits.append(f"memory {int(envs['VGPU_MEMORY_LIMIT_MIB']) // 1024} GiB")
                shown = ", ".join(limits) or "no limits"
                _say(f"  admitted {name:<11} ({asked}) -> {card}  [{shown}]")
            else:
                _say(f"  REFUSED  {name:<11} ({asked}): {result.error}")
            _say(f"           {note}")
        # Let the daemon learn who owns each placement from the kubelet.
        node.wait(lambda: all(c["pod"] for c in collect(node.state_dir)["containers"]), 5.0)
        _say("\nPer-card summary (what `vgpu status` shows):\n")
        _say(render(collect(node.state_dir)))
        by_pod = {c["pod"]: c for c in collect(node.state_dir)["containers"]}
        _say("The identical CI pods got separate config directories (keyed by device IDs):")
        for name in ("ci-job-a", "ci-job-b"):
            if name in by_pod:
                _say(f"  {name}: {by_pod[name]['config_path']}")
        _say("\nDeleting 'inference' frees its slice; 'too-big' is retried:")
        node.delete(pods["inference"])
        again = node.submit(node.pod("too-big-retry", {core: 10, mem: 300}))
        outcome = (
            f"admitted on {again.containers[0].envs.get('NVIDIA_VISIBLE_DEVICES')}"
            if again.ok
            else f"refused: {again.error}"
        )
        _say(f"  too-big-retry {outcome}")
        rc = node.stop_daemon()
        _say(f"\ndaemon stopped with exit code {rc}; demo took {time.monotonic() - started:.1f}s")
        return 0 if rc == 0 else 1
    except Exception as exc:
        print(f"vgpu demo failed: {exc}\n--- daemon log ---\n{node.log()[-4000:]}", file=sys.stderr)
        return 1
    finally:
        node.close()
        if not keep:
            shutil.rmtree(node.root, ignore_errors=True)
