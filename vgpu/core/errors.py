"""Domain errors of the placement core.

Each carries structured fields and a message that says what was asked, what
was wrong and what to do. The gRPC edge maps them to status codes
(see vgpu.adapters.kubelet.servicer.status_for).
"""

from __future__ import annotations


class VgpuError(Exception):
    """Base of every expected, explainable failure."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(VgpuError):
    """The request itself can never be satisfied as written (INVALID_ARGUMENT)."""


class UnknownDevice(VgpuError):
    """A device ID this plugin never advertised (INVALID_ARGUMENT)."""

    def __init__(self, message: str, device_ids: tuple[str, ...]) -> None:
        super().__init__(message)
        self.device_ids = device_ids


class InsufficientCapacity(VgpuError):
    """The request is valid but no card has room for it now (RESOURCE_EXHAUSTED)."""


class PlacementConflict(VgpuError):
    """The IDs contradict a placement already made (FAILED_PRECONDITION)."""


class ConfigError(VgpuError):
    """Invalid settings; the message names the key and what is allowed."""
