"""Domain errors of the placement core.

Each carries structured fields and a message that says what was asked, what
was wrong and what to do. The gRPC edge maps them to status codes
(see vgpu.adapters.kubelet.servicer.status_for).
"""

from __future__ import annotations

import errno as _errno


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


class UnknownCard(VgpuError):
    """IDs of a card this node had but no longer has (FAILED_PRECONDITION): it fell
    off the bus or was removed, and the kubelet has not seen the new list yet."""

    def __init__(self, message: str, card: str) -> None:
        super().__init__(message)
        self.card = card


class ApiUnavailable(VgpuError):
    """A decision needs an API that cannot be reached now (UNAVAILABLE): the
    kubelet's pod-resources API or the Kubernetes API server."""


class HandedOver(VgpuError):
    """This daemon handed the node over, and the new one could not answer a
    call in its place (UNAVAILABLE)."""


class StateUnwritable(VgpuError):
    """The daemon cannot write a container's state; nothing was placed.

    `errno_name` is the OS error (ENOSPC, EROFS, ...) and `path` the file or
    directory it failed on. Subclasses pick the status code.
    """

    def __init__(self, message: str, errno_name: str, path: str) -> None:
        super().__init__(message)
        self.errno_name = errno_name
        self.path = path


class DiskFull(StateUnwritable):
    """ENOSPC or EDQUOT on the state disk (RESOURCE_EXHAUSTED)."""


class TooManyOpenFiles(StateUnwritable):
    """EMFILE or ENFILE: no file descriptor left (RESOURCE_EXHAUSTED)."""


class StateReadOnly(StateUnwritable):
    """EROFS: the state directory is on a read-only file system (FAILED_PRECONDITION)."""


class StateIOError(StateUnwritable):
    """Any other OS error writing state, e.g. EIO or EACCES (UNAVAILABLE)."""


_RESUMES = "admissions resume by themselves once it is fixed"


def state_error(code: int | None, path: str, doing: str, strerror: str = "") -> StateUnwritable:
    """The named refusal for an OS error met while `doing` something to `path`."""
    name = _errno.errorcode.get(code or 0, "EIO")
    what = strerror or name
    if code in (_errno.ENOSPC, _errno.EDQUOT):
        kind = "full" if code == _errno.ENOSPC else "over its quota"
        return DiskFull(
            f"cannot {doing}: the file system holding {path} is {kind} ({name}). Free space "
            f"there (each container needs a few KiB); {_RESUMES}",
            name,
            path,
        )
    if code in (_errno.EMFILE, _errno.ENFILE):
        whose = "the vgpu daemon" if code == _errno.EMFILE else "the node"
        return TooManyOpenFiles(
            f"cannot {doing}: {whose} has no file descriptor left ({name}) opening {path}. "
            "Raise the daemon's open-file limit (RLIMIT_NOFILE) or find what holds them "
            f"(ls /proc/<pid>/fd); {_RESUMES}",
            name,
            path,
        )
    if code == _errno.EROFS:
        return StateReadOnly(
            f"cannot {doing}: {path} is on a read-only file system ({name}). Check the node's "
            f"disk and remount the state directory read-write; {_RESUMES}",
            name,
            path,
        )
    return StateIOError(
        f"cannot {doing}: {what} ({name}) on {path}. Check the node's disk and the "
        f"permissions of the state directory; {_RESUMES}",
        name,
        path,
    )


class ConfigError(VgpuError):
    """Invalid settings; the message names the key and what is allowed."""
