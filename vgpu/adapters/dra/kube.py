"""The resource.k8s.io/v1 API for DRA mode, through the official client:

- SlicePublisher keeps this node's one ResourceSlice equal to the healthy
  cards: created at start, replaced (generation + 1) within moments of any card
  change, and re-created when someone else changes or deletes it (a starting
  kubelet deletes its node's slices);
- ClaimCache is a watch-based cache of the ResourceClaims allocated on this
  node's pool, with a GET as the fallback for a claim it has not seen yet.

Only this module (with vgpu.adapters.kube) imports `kubernetes`; its
exceptions never leak: callers see ClaimLookupError.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from vgpu.adapters.kube import api_client
from vgpu.adapters.kube_errors import api_error_text, api_status_message
from vgpu.core.dra import merge_device_status, resource_slice, slice_name
from vgpu.core.readiness import ApiHealth

log = logging.getLogger(__name__)

RESYNC_S = 60.0  # re-check the slice even without a change or an event
WATCH_TIMEOUT_S = 60
BACKOFF_MAX_S = 10.0


class ClaimLookupError(Exception):
    """A claim could not be read; the message says why and what to do."""


class ClaimSource(Protocol):
    def get(self, namespace: str, name: str, uid: str) -> dict[str, Any]:
        """The claim's API JSON; ClaimLookupError when it cannot be had."""
        ...

    def start(self, stop: threading.Event) -> None: ...


class SlicePort(Protocol):
    def publish(self, devices: list[dict[str, Any]]) -> None:
        """The devices the node's slice must list from now on."""
        ...

    def start(self, stop: threading.Event) -> None: ...


def resource_api(kubeconfig: Path | None) -> Any:
    """A ResourceV1Api on the kubeconfig, or on the in-cluster service account."""
    from kubernetes import client

    return client.ResourceV1Api(api_client(kubeconfig))


def _read_json(reply: Any) -> Any:
    try:
        return json.loads(reply.data)
    finally:
        reply.release_conn()


def _status_of(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def _list_watch(
    name: str,
    list_fn: Callable[..., Any],
    on_list: Callable[[list[dict[str, Any]]], None],
    on_event: Callable[[str, dict[str, Any]], None],
    stop: threading.Event,
    health: ApiHealth | None = None,
    **selectors: str,
) -> None:
    """List, then watch from that resourceVersion; resume or re-list after
    errors with backoff (0.5 s to BACKOFF_MAX_S). Runs until `stop`. `health`
    records each contact and failure (the daemon's /readyz)."""
    from vgpu.adapters.kube import _raw_watch

    backoff = 0.5
    version: str | None = None
    while not stop.is_set():
        try:
            if version is None:
                data = _read_json(list_fn(_preload_content=False, _request_timeout=10, **selectors))
                on_list(list(data.get("items") or []))
                version = str(data["metadata"]["resourceVersion"])
                if health is not None:
                    health.ok()
            watch = _raw_watch()
            for event in watch.stream(
                list_fn,
                resource_version=version,
                timeout_seconds=WATCH_TIMEOUT_S,
                allow_watch_bookmarks=True,
                _request_timeout=WATCH_TIMEOUT_S + 15,
                **selectors,
            ):
                if stop.is_set():
                    watch.stop()
                    break
                if health is not None:
                    health.ok()
                raw = event.get("raw_object") or {}
                kind = str(event.get("type"))
                if kind == "ERROR":
                    if raw.get("code") == 410:
                        version = None
                        break
                    raise RuntimeError(f"watch error {raw.get('message')}")
                version = (raw.get("metadata") or {}).get("resourceVersion", version)
                if kind != "BOOKMARK":
                    on_event(kind, raw)
            if health is not None:
                health.ok()
            backoff = 0.5
        except Exception as exc:  # urllib3, socket and client errors alike
            if _status_of(exc) == 410:
                version = None
                continue
            owner = getattr(list_fn, "__self__", None)
            config = getattr(getattr(owner, "api_client", None), "configuration", None)
            address = str(getattr(config, "host", "(unknown address)"))
            if health is not None:
                health.failed(time.monotonic(), api_error_text(exc, address))
            log.warning("%s: %s; retrying in %.1fs", name, api_error_text(exc, address), backoff)
            version = None
            if stop.wait(backoff):
                return
            backoff = min(backoff * 2, BACKOFF_MAX_S)


# --------------------------------------------------------------------- claims


def _allocated_here(obj: dict[str, Any], driver: str, pool: str) -> bool:
    allocation = (obj.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    return any(
        isinstance(r, dict) and r.get("driver") == driver and r.get("pool") == pool for r in results
    )


class ClaimCache:
    """ResourceClaims allocated with this driver on this node's pool, by (namespace, name)."""

    def __init__(
        self,
        driver: str,
        pool: str,
        kubeconfig: Path | None,
        fetch_timeout_s: float = 5.0,
        api: Any = None,
    ) -> None:
        self.driver = driver
        self.pool = pool
        self.kubeconfig = kubeconfig
        self.fetch_timeout_s = fetch_timeout_s
        self._api = api
        self._api_lock = threading.Lock()
        self._claims: dict[tuple[str, str], dict[str, Any]] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.fetches = 0
        self.health = ApiHealth()  # the daemon's /readyz reads it

    def _client(self) -> Any:
        with self._api_lock:
            if self._api is None:
                self._api = resource_api(self.kubeconfig)
            return self._api

    def _key(self, obj: dict[str, Any]) -> tuple[str, str]:
        meta = obj.get("metadata") or {}
        return str(meta.get("namespace", "")), str(meta.get("name", ""))

    def _on_list(self, items: list[dict[str, Any]]) -> None:
        kept = {self._key(o): o for o in items if _allocated_here(o, self.driver, self.pool)}
        with self._lock:
            self._claims = kept
        log.info("claim cache synced: %d claim(s) allocated on pool %s", len(kept), self.pool)

    def _on_event(self, kind: str, obj: dict[str, Any]) -> None:
        key = self._key(obj)
        with self._lock:
            if kind == "DELETED" or not _allocated_here(obj, self.driver, self.pool):
                self._claims.pop(key, None)
            else:
                self._claims[key] = obj

    def start(self, stop: threading.Event) -> None:
        def loop() -> None:
            api = self._client()
            _list_watch(
                "claim watch",
                api.list_resource_claim_for_all_namespaces,
                self._on_list,
                self._on_event,
                stop,
                self.health,
            )

        threading.Thread(target=loop, name="claim-watch", daemon=True).start()

    def get(self, namespace: str, name: str, uid: str) -> dict[str, Any]:
        with self._lock:
            cached = self._claims.get((namespace, name))
        if cached is not None and (cached.get("metadata") or {}).get("uid") == uid:
            self.hits += 1
            return cached
        self.fetches += 1
        try:
            obj = _read_json(
                self._client().read_namespaced_resource_claim(
                    name,
                    namespace,
                    _preload_content=False,
                    _request_timeout=self.fetch_timeout_s,
                )
            )
        except Exception as exc:
            if _status_of(exc) == 404:
                raise ClaimLookupError(
                    f"ResourceClaim {namespace}/{name} does not exist (deleted?)"
                ) from None
            raise ClaimLookupError(
                f"cannot read ResourceClaim {namespace}/{name} from the API server "
                f"({type(exc).__name__}: {str(exc)[:200]}); the kubelet will retry"
            ) from None
        found = str((obj.get("metadata") or {}).get("uid", ""))
        if found != uid:
            raise ClaimLookupError(
                f"ResourceClaim {namespace}/{name} has UID {found or 'none'}, not {uid}: it was "
                "deleted and re-created; the kubelet's claim is gone"
            )
        return dict(obj)


# ---------------------------------------------------- claim users and status


class ClaimUsers(Protocol):
    def pod(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def write(self, namespace: str, name: str, uid: str, entries: list[dict[str, Any]]) -> bool: ...


class ClaimStatusWriter:
    """Reads a claim's pod (which containers use it) and writes the claim's
    status.devices entries of this driver (read, replace ours, write back with
    the resourceVersion read: other drivers' entries are kept)."""

    def __init__(
        self, driver: str, kubeconfig: Path | None, timeout_s: float = 5.0, client: Any = None
    ) -> None:
        self.driver = driver
        self.kubeconfig = kubeconfig
        self.timeout_s = timeout_s
        self._client = client
        self._lock = threading.Lock()

    def _api(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = api_client(self.kubeconfig)
            return self._client

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod's API JSON, None when it cannot be read (logged)."""
        from kubernetes import client

        try:
            return dict(
                _read_json(
                    client.CoreV1Api(self._api()).read_namespaced_pod(
                        name, namespace, _preload_content=False, _request_timeout=self.timeout_s
                    )
                )
            )
        except Exception as exc:
            log.warning("cannot read pod %s/%s: %s", namespace, name, str(exc)[:200])
            return None

    def write(self, namespace: str, name: str, uid: str, entries: list[dict[str, Any]]) -> bool:
        """Make this driver's entries of the claim's status.devices `entries`."""
        from kubernetes import client

        api = client.ResourceV1Api(self._api())
        for _ in range(3):
            try:
                obj = _read_json(
                    api.read_namespaced_resource_claim(
                        name, namespace, _preload_content=False, _request_timeout=self.timeout_s
                    )
                )
                if str((obj.get("metadata") or {}).get("uid", "")) != uid:
                    return False  # deleted and re-created: not ours to write
                status = obj.get("status") or {}
                current = status.get("devices") or []
                devices = merge_device_status(current, self.driver, entries)
                if devices == current:
                    return True
                status["devices"] = devices
                obj["status"] = status
                api.replace_namespaced_resource_claim_status(
                    name, namespace, obj, _preload_content=False, _request_timeout=self.timeout_s
                )
                return True
            except Exception as exc:
                if _status_of(exc) == 409:
                    continue  # changed meanwhile: read again
                if _status_of(exc) == 404:
                    return False  # the claim is gone: nothing to write
                host = str(getattr(getattr(self._client, "configuration", None), "host", "?"))
                log.warning(
                    "cannot write the device status of claim %s/%s: %s%s",
                    namespace,
                    name,
                    api_error_text(exc, host),
                    f" ({detail})" if (detail := api_status_message(exc)) else "",
                )
                return False
        return False


# --------------------------------------------------------------------- slices


class SlicePublisher:
    """Keeps the node's one ResourceSlice equal to the desired devices."""

    def __init__(
        self,
        driver: str,
        node: str,
        kubeconfig: Path | None,
        api: Any = None,
        resync_s: float = RESYNC_S,
        on_published: Callable[[int], None] | None = None,
    ) -> None:
        self.driver = driver
        self.node = node
        self.name = slice_name(node, driver)
        self.kubeconfig = kubeconfig
        self.resync_s = resync_s
        self.on_published = on_published
        self._api = api
        self._api_lock = threading.Lock()
        self._desired: list[dict[str, Any]] | None = None
        self._written: tuple[list[dict[str, Any]], str] | None = None  # devices, resourceVersion
        self._generation = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()

    def _client(self) -> Any:
        with self._api_lock:
            if self._api is None:
                self._api = resource_api(self.kubeconfig)
            return self._api

    def publish(self, devices: list[dict[str, Any]]) -> None:
        with self._lock:
            self._desired = devices
        self._wake.set()

    def start(self, stop: threading.Event) -> None:
        threading.Thread(
            target=self._publish_loop, args=(stop,), name="slice-publish", daemon=True
        ).start()
        threading.Thread(
            target=self._watch_loop, args=(stop,), name="slice-watch", daemon=True
        ).start()

    # ---------------------------------------------------------- watching

    def _watch_loop(self, stop: threading.Event) -> None:
        selector = f"spec.nodeName={self.node},spec.driver={self.driver}"

        def on_list(items: list[dict[str, Any]]) -> None:
            if any(self._foreign(o) for o in items) or not items:
                self._wake.set()

        def on_event(kind: str, obj: dict[str, Any]) -> None:
            if kind == "DELETED" or self._foreign(obj):
                self._wake.set()

        _list_watch(
            "slice watch",
            self._client().list_resource_slice,
            on_list,
            on_event,
            stop,
            field_selector=selector,
        )

    def _foreign(self, obj: dict[str, Any]) -> bool:
        """A slice state we did not write (changed, deleted or someone else's)."""
        meta = obj.get("metadata") or {}
        with self._lock:
            written = self._written
        return (
            written is None
            or meta.get("name") != self.name
            or (meta.get("resourceVersion") != written[1])
        )

    # --------------------------------------------------------- publishing

    def _publish_loop(self, stop: threading.Event) -> None:
        backoff = 0.5
        while not stop.is_set():
            self._wake.wait(self.resync_s)
            if stop.is_set():
                return
            self._wake.clear()
            with self._lock:
                desired = self._desired
            if desired is None:
                continue
            try:
                self._reconcile(desired)
                backoff = 0.5
            except Exception as exc:
                log.warning(
                    "publishing ResourceSlice %s failed (%s: %s); retrying in %.1fs",
                    self.name,
                    type(exc).__name__,
                    str(exc)[:200],
                    backoff,
                )
                self._wake.set()
                if stop.wait(backoff):
                    return
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    def _reconcile(self, desired: list[dict[str, Any]]) -> None:
        """List this node's slices of the driver; make ours say `desired`, delete others."""
        api = self._client()
        data = _read_json(
            api.list_resource_slice(
                field_selector=f"spec.nodeName={self.node},spec.driver={self.driver}",
                _preload_content=False,
                _request_timeout=10,
            )
        )
        items: list[dict[str, Any]] = list(data.get("items") or [])
        generations = [
            int(((o.get("spec") or {}).get("pool") or {}).get("generation") or 0) for o in items
        ]
        self._generation = max([self._generation, *generations])
        ours = next((o for o in items if (o.get("metadata") or {}).get("name") == self.name), None)
        for other in items:
            other_name = str((other.get("metadata") or {}).get("name"))
            if other_name != self.name:
                self._delete(api, other_name)
        with self._lock:
            written = self._written
        current_rv = str((ours or {}).get("metadata", {}).get("resourceVersion", ""))
        if ours is not None and written == (desired, current_rv):
            return  # the server holds exactly what we last wrote
        generation = self._generation + 1
        body = resource_slice(self.node, self.driver, desired, generation)
        if ours is None:
            reply = _read_json(
                api.create_resource_slice(body, _preload_content=False, _request_timeout=10)
            )
            action = "created"
        else:
            body["metadata"]["resourceVersion"] = current_rv
            reply = _read_json(
                api.replace_resource_slice(
                    self.name, body, _preload_content=False, _request_timeout=10
                )
            )
            action = "updated"
        version = str(reply["metadata"]["resourceVersion"])
        with self._lock:
            self._written = (desired, version)
        self._generation = generation
        log.info(
            "%s ResourceSlice %s: generation %d, %d device(s): %s",
            action,
            self.name,
            generation,
            len(desired),
            ", ".join(_names(desired)) or "none",
        )
        if self.on_published is not None:
            self.on_published(generation)

    def _delete(self, api: Any, name: str) -> None:
        try:
            api.delete_resource_slice(name, _preload_content=False, _request_timeout=10)
            log.info("deleted stale ResourceSlice %s of this node", name)
        except Exception as exc:
            if _status_of(exc) != 404:
                raise


def _names(devices: Iterable[dict[str, Any]]) -> list[str]:
    return [str(d.get("name")) for d in devices]
