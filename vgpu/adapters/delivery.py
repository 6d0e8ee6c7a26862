"""How a container's limit contract reaches the runtime: the device list
strategies (`device_list_strategy`). The contract is one value
(vgpu.core.contract); each strategy only hands it over:

    envvar          the Allocate answer carries the env, mounts and device nodes
                    (NVIDIA_VISIBLE_DEVICES names the cards);
    volume-mounts   the same, with the card list as /dev/null mounts under
                    /var/run/nvidia-container-devices (NVIDIA's convention);
    cdi             a CDI spec per container, written atomically into cdi_dir
                    before the answer, which names only `<domain>/vgpu=<key>`.
                    The spec writer is the DRA mode's (vgpu.adapters.dra.cdi).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Protocol

from vgpu.adapters.dra.cdi import CdiDir, spec_document
from vgpu.adapters.dra.state import sweep_temp_files
from vgpu.core.contract import ContainerEdits, as_cdi_reference, as_volume_mounts

log = logging.getLogger("vgpu")


class Delivery(Protocol):
    strategy: str

    def deliver(self, key: str, edits: ContainerEdits, cards: Sequence[str]) -> ContainerEdits:
        """The Allocate answer for placement `key` (writing what it names first)."""
        ...

    def forget(self, key: str) -> None:
        """The placement is released: remove what deliver() wrote for it."""
        ...

    def sweep(self, keep: Collection[str]) -> list[str]:
        """Remove what belongs to no placement in `keep`; returns what went."""
        ...


class EnvvarDelivery:
    strategy = "envvar"

    def deliver(self, key: str, edits: ContainerEdits, cards: Sequence[str]) -> ContainerEdits:
        return edits

    def forget(self, key: str) -> None:
        return None

    def sweep(self, keep: Collection[str]) -> list[str]:
        return []


class VolumeMountsDelivery(EnvvarDelivery):
    strategy = "volume-mounts"

    def deliver(self, key: str, edits: ContainerEdits, cards: Sequence[str]) -> ContainerEdits:
        return as_volume_mounts(edits, cards)


class CdiDelivery:
    """One spec file per placement (`<domain>-vgpu_<key>.json`, one device named
    after the key), rewritten only when its content changes."""

    strategy = "cdi"

    def __init__(self, cdi: CdiDir) -> None:
        self.cdi = cdi
        self._written: dict[str, object] = {}

    def deliver(self, key: str, edits: ContainerEdits, cards: Sequence[str]) -> ContainerEdits:
        name = self.cdi.file_name(key)
        document = spec_document(self.cdi.kind, {key: edits})
        if self._written.get(key) != document or not (self.cdi.directory / name).exists():
            self.cdi.write(name, document)
            self._written[key] = document
        return as_cdi_reference(edits, self.cdi.qualified(key))

    def forget(self, key: str) -> None:
        self._written.pop(key, None)
        self.cdi.remove(self.cdi.file_name(key))

    def sweep(self, keep: Collection[str]) -> list[str]:
        wanted = {self.cdi.file_name(k) for k in keep}
        gone = []
        for name in self.cdi.names():
            if name not in wanted:
                self.cdi.remove(name)
                gone.append(name)
        for key in [k for k in self._written if k not in keep]:
            del self._written[key]
        sweep_temp_files(self.cdi.directory, self.cdi.prefix)  # a crash mid-write
        return gone


def build_delivery(strategy: str, cdi: CdiDir) -> Delivery:
    if strategy == "cdi":
        return CdiDelivery(cdi)
    if strategy == "volume-mounts":
        return VolumeMountsDelivery()
    return EnvvarDelivery()
