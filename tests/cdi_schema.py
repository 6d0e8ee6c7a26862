"""A strict CDI spec validator, written for these tests from the CDI
specification: a spec must be valid for the cdiVersion it declares.

What each version allows (the fields and rules vgpu can meet):

* 0.3.0 - 0.4.0: cdiVersion, kind, devices[] {name, containerEdits}, top-level
  containerEdits; containerEdits {env, deviceNodes, hooks, mounts};
  deviceNodes {path, type, major, minor, fileMode, permissions, uid, gid};
  mounts {hostPath, containerPath, options, type}; hooks {hookName, path,
  args, env, timeout}. Device names must start with a letter.
* 0.5.0: deviceNodes gain hostPath; device names may start with a digit.
* 0.6.0: annotations (spec and device level); dots in the kind's class.
* 0.7.0: containerEdits gain intelRdt and additionalGIDs.

Unknown fields are errors (the runtimes' parsers reject them), so a spec
that uses a later version's field under an earlier cdiVersion fails here.
"""

from __future__ import annotations

import re
from typing import Any

VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0")
_NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
_VENDOR_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")
_CLASS_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
HOOK_NAMES = {
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
}


def _at_least(version: str, minimum: str) -> bool:
    return tuple(map(int, version.split("."))) >= tuple(map(int, minimum.split(".")))


class CdiSpecError(AssertionError):
    pass


def _only(where: str, obj: Any, allowed: set[str], required: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    if not isinstance(obj, dict):
        raise CdiSpecError(f"{where}: must be an object")
    extra = set(obj) - allowed
    if extra:
        raise CdiSpecError(f"{where}: field(s) {sorted(extra)} not allowed in this cdiVersion")
    missing = required - set(obj)
    if missing:
        raise CdiSpecError(f"{where}: required field(s) {sorted(missing)} missing")


def _strings(where: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CdiSpecError(f"{where}: must be a list of strings")
    return value


def _abs(where: str, value: Any) -> None:
    if not isinstance(value, str) or not value.startswith("/"):
        raise CdiSpecError(f"{where}: must be an absolute path, got {value!r}")


def validate_edits(where: str, edits: Any, version: str) -> None:
    allowed = {"env", "deviceNodes", "hooks", "mounts"}
    if _at_least(version, "0.7.0"):
        allowed |= {"intelRdt", "additionalGIDs"}
    _only(where, edits, allowed)
    for i, entry in enumerate(_strings(f"{where}.env", edits.get("env", []))):
        if not _ENV_RE.match(entry):
            raise CdiSpecError(f"{where}.env[{i}]: {entry!r} is not NAME=VALUE")
    node_fields = {"path", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"}
    if _at_least(version, "0.5.0"):
        node_fields.add("hostPath")
    for i, node in enumerate(edits.get("deviceNodes", [])):
        w = f"{where}.deviceNodes[{i}]"
        _only(w, node, node_fields, {"path"})
        _abs(f"{w}.path", node["path"])
        if "hostPath" in node:
            _abs(f"{w}.hostPath", node["hostPath"])
        perms = node.get("permissions", "")
        if not isinstance(perms, str) or set(perms) - set("rwm"):
            raise CdiSpecError(f"{w}.permissions: {perms!r} is not a subset of 'rwm'")
        if node.get("type", "c") not in ("b", "c", "u", "p"):
            raise CdiSpecError(f"{w}.type: {node['type']!r} is not b, c, u or p")
    for i, mount in enumerate(edits.get("mounts", [])):
        w = f"{where}.mounts[{i}]"
        _only(
            w,
            mount,
            {"hostPath", "containerPath", "options", "type"},
            {"hostPath", "containerPath"},
        )
        _abs(f"{w}.hostPath", mount["hostPath"])
        _abs(f"{w}.containerPath", mount["containerPath"])
        _strings(f"{w}.options", mount.get("options", []))
    for i, hook in enumerate(edits.get("hooks", [])):
        w = f"{where}.hooks[{i}]"
        _only(w, hook, {"hookName", "path", "args", "env", "timeout"}, {"hookName", "path"})
        if hook["hookName"] not in HOOK_NAMES:
            raise CdiSpecError(f"{w}.hookName: {hook['hookName']!r} unknown")
        _abs(f"{w}.path", hook["path"])


def validate_spec(spec: Any) -> None:
    """Raise CdiSpecError naming the first problem; None when valid."""
    _only("spec", spec, {"cdiVersion", "kind", "devices", "containerEdits", "annotations"})
    version = spec.get("cdiVersion")
    if version not in VERSIONS:
        raise CdiSpecError(f"cdiVersion {version!r} is not a released CDI version")
    if "annotations" in spec and not _at_least(version, "0.6.0"):
        raise CdiSpecError("spec: annotations need cdiVersion 0.6.0")
    kind = spec.get("kind")
    if not isinstance(kind, str) or kind.count("/") != 1:
        raise CdiSpecError(f"kind {kind!r} is not vendor/class")
    vendor, klass = kind.split("/")
    if not _VENDOR_RE.match(vendor) or not _CLASS_RE.match(klass) or len(klass) > 63:
        raise CdiSpecError(f"kind {kind!r}: bad vendor or class")
    if "." in klass and not _at_least(version, "0.6.0"):
        raise CdiSpecError(f"kind {kind!r}: a dot in the class needs cdiVersion 0.6.0")
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        raise CdiSpecError("devices: at least one device is required")
    names = set()
    for i, device in enumerate(devices):
        w = f"devices[{i}]"
        allowed = {"name", "containerEdits"}
        if _at_least(version, "0.6.0"):
            allowed.add("annotations")
        _only(w, device, allowed, {"name", "containerEdits"})
        name = device["name"]
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise CdiSpecError(f"{w}.name: {name!r} is not a valid device name")
        if not name[0].isalpha() and not _at_least(version, "0.5.0"):
            raise CdiSpecError(f"{w}.name: a leading digit needs cdiVersion 0.5.0")
        if name in names:
            raise CdiSpecError(f"{w}.name: {name} appears twice")
        names.add(name)
        validate_edits(f"{w}.containerEdits", device["containerEdits"], version)
    if "containerEdits" in spec:
        validate_edits("containerEdits", spec["containerEdits"], version)
