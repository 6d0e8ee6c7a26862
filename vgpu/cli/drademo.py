"""`vgpu demo --dra`: the DRA driver on mock GPUs, with the fake API server, a
scheduler stand-in that fits claims by consumable capacity, and the kubelet's
DRA side. No GPU, no cluster."""

from __future__ import annotations

import shutil
import sys
import time
from typing import Any

from vgpu.cli.status import collect, render
from vgpu.sim.allocator import Unschedulable
from vgpu.sim.draharness import DraSimNode


def _say(text: str = "") -> None:
    print(text, flush=True)


def run_dra_demo(gpus: str = "preset:2xH200", keep: bool = False) -> int:
    started = time.monotonic()
    try:
        node = DraSimNode(gpus=gpus, node="demo-node")
    except RuntimeError as exc:  # cel-python missing
        print(f"vgpu demo --dra: {exc}", file=sys.stderr)
        return 1
    driver = node.driver
    model = f'device.attributes["{driver}"].model == "NVIDIA H200"'
    try:
        _say(f"vgpu demo --dra: mock GPUs ({gpus}), a fake API server (resource.k8s.io/v1),")
        _say("  a scheduler stand-in (consumable capacity) and the kubelet's DRA side")
        _say(f"  working directory {node.root}")
        node.start()
        _say(f"  driver {driver} registered; ResourceSlice devices: {', '.join(node.published())}")
        _say("  each: cores 100 (min 1, step 1), memory 143616Mi (min = step = 256Mi)\n")
        samples: list[tuple[str, dict[str, str] | None, list[str], str]] = [
            ("notebook", {"cores": "30", "memory": "10Gi"}, [], "30% of a card, 10 GiB"),
            ("inference", {"cores": "40", "memory": "40Gi"}, [], "packed on the same card"),
            ("trainer", {"cores": "100"}, [], "a whole card"),
            ("h200-job", {"cores": "10", "memory": "4Gi"}, [model], "an H200, chosen by CEL"),
            ("cores-only", {"cores": "20"}, [], "no memory asked: takes the memory default"),
            ("too-big", {"cores": "10", "memory": "200Gi"}, [], "more memory than any card"),
        ]
        runs: dict[str, Any] = {}
        for name, capacity, selectors, note in samples:
            node.claim(f"{name}-gpu", capacity, selectors=selectors)
            asked = ", ".join(f"{k}={v}" for k, v in (capacity or {}).items()) or "nothing"
            try:
                run = node.run_pod(name, [f"{name}-gpu"])
            except Unschedulable as exc:
                _say(f"  PENDING  {name:<11} ({asked}): {exc}")
                _say(f"           {note}")
                continue
            runs[name] = run
            if run.ok:
                env = run.edits[f"{name}-gpu"].env
                device = run.reply.claims[run.claims[0][1]].devices[0].device_name
                limits = []
                if "VGPU_CORE_LIMIT" in env:
                    limits.append(f"core {env['VGPU_CORE_LIMIT']}%")
                if "VGPU_MEMORY_LIMIT_MIB" in env:
                    limits.append(f"memory {int(env['VGPU_MEMORY_LIMIT_MIB']) / 1024:g} GiB")
                shown = ", ".join(limits) or "whole card, no limits"
                _say(f"  prepared {name:<11} ({asked}) -> {device}  [{shown}]")
            else:
                _say(f"  FAILED   {name:<11} ({asked}): {run.error(f'{name}-gpu')}")
            _say(f"           {note}")
        _say("\nPer-card summary (what `vgpu status` shows):\n")
        _say(render(collect(node.state_dir)))
        notebook = runs.get("notebook")
        if notebook is not None:
            edits = notebook.edits["notebook-gpu"]
            _say("What the runtime gives notebook's container (from its CDI device):")
            for key in ("NVIDIA_VISIBLE_DEVICES", "VGPU_CORE_LIMIT", "VGPU_MEMORY_LIMIT_MIB"):
                _say(f"  env {key}={edits.env.get(key)}")
            for path, mount in edits.mounts.items():
                _say(f"  mount {path} <- {mount['hostPath']} ({mount['options'][0]})")
            _say(f"  devices {', '.join(edits.device_nodes)}")
        if "inference" in runs:
            _say("\nThe inference pod ends: its claim is unprepared and deallocated;")
            node.end_pod(runs["inference"])
            try:
                again = node.run_pod("cores-only-retry", ["cores-only-gpu"])
                _say(f"  cores-only still pending? no: prepared ({again.ok})")
            except Unschedulable:
                _say("  cores-only stays pending: notebook and h200-job still hold memory on gpu-0")
        rc = node.stop_daemon()
        _say(f"\ndriver stopped with exit code {rc}; demo took {time.monotonic() - started:.1f}s")
        return 0 if rc == 0 else 1
    except Exception as exc:
        print(
            f"vgpu demo --dra failed: {exc}\n--- driver log ---\n{node.log()[-4000:]}",
            file=sys.stderr,
        )
        return 1
    finally:
        node.close()
        if not keep:
            shutil.rmtree(node.root, ignore_errors=True)
