"""The host's device nodes, as the daemon sees them through `host_dev_dir`.

The DaemonSet mounts the host's /dev read-only at `host_dev_dir` (default
/dev, right for a daemon running on the host). A node is named in an Allocate
answer or a CDI spec only if it is a character device there now: the
container runtime refuses a container whose answer names a node the host
lacks (`lstat /dev/nvidia0: no such file or directory`). One stat per node,
no more: this runs on the admission path.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Iterable
from pathlib import Path

from vgpu.core.contract import card_node, judge_nodes
from vgpu.core.model import Card

log = logging.getLogger("vgpu")

UVM_NODES = ("/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


class HostDevices:
    """Which of some /dev paths exist on the host (as character devices)."""

    def __init__(self, host_dev_dir: Path) -> None:
        self.root = host_dev_dir
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    def host_path(self, node: str) -> Path:
        """Where /dev/<name> of the host is seen from here."""
        return self.root / node.removeprefix("/dev/").lstrip("/")

    def judge(self, card: Card) -> Card:
        """The card with its own device node's presence applied (see
        vgpu.core.contract.judge_nodes): one stat."""
        own = card_node(card)
        return judge_nodes(card, self.present([own] if own else []))

    def present(self, nodes: Iterable[str]) -> frozenset[str]:
        """The nodes among `nodes` that exist now; each missing one logged once
        (the uvm nodes appear only once a CUDA program loaded the module)."""
        out = set()
        for node in nodes:
            why = self._problem(node)
            if why is None:
                out.add(node)
                with self._lock:
                    self._warned.discard(node)
                continue
            with self._lock:
                first = node not in self._warned
                self._warned.add(node)
            if first:
                hint = (
                    " (it appears once a CUDA program loaded the nvidia-uvm module; containers "
                    "get it from then on)"
                    if node in UVM_NODES
                    else ""
                )
                log.warning("device node %s not handed to containers: %s%s", node, why, hint)
        return frozenset(out)

    def _problem(self, node: str) -> str | None:
        if not node.startswith("/dev/") or ".." in node.split("/"):
            return "not a path under /dev"
        path = self.host_path(node)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return f"{path} does not exist"
        except OSError as exc:
            return f"{path}: {exc.strerror}"
        if not stat.S_ISCHR(st.st_mode):
            return f"{path} is not a character device"
        return None
