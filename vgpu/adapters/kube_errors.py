"""One wording for every failed Kubernetes API call: the address, the HTTP
status or OS error, and what to check. No SDK import: the exception is read
through its attributes (the kubernetes client's ApiException has `status` and
`reason`; urllib3 wraps the OS error in `reason` or the exception chain)."""

from __future__ import annotations

import errno
import json

_CHECKS = {
    401: "the service account token is missing or expired: check the pod's token mount",
    403: "the service account lacks a permission: check the ClusterRole and its binding",
    404: "the object or API is absent: check the name and that the API group is served",
    409: "another writer changed the object first: it is read again",
    422: "the API server refused the object as invalid",
    429: "the API server is throttling this client: check API priority and fairness",
}


def _os_error(exc: BaseException) -> OSError | None:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno is not None:
            return cur
        reason = getattr(cur, "reason", None)
        if isinstance(reason, BaseException) and id(reason) not in seen:
            cur = reason
            continue
        cur = cur.__cause__ or cur.__context__
    return None


def _transport(exc: BaseException) -> bool:
    """A network-side failure (urllib3's errors, timeouts, OSError)."""
    for cls in type(exc).__mro__:
        if cls.__module__.startswith(("urllib3", "http.client", "ssl")) or issubclass(
            cls, OSError | TimeoutError
        ):
            return True
    return "Timeout" in type(exc).__name__


def api_error_text(exc: BaseException, address: str) -> str:
    """e.g. 'API server https://10.96.0.1:443: HTTP 403 Forbidden; the service account
    lacks a permission: check the ClusterRole and its binding'."""
    status = getattr(exc, "status", None)
    if isinstance(status, int) and status > 0:
        reason = getattr(exc, "reason", "") or ""
        check = _CHECKS.get(status) or (
            "the API server is failing or restarting: check its health and logs"
            if status >= 500
            else "check the request"
        )
        return f"API server {address}: HTTP {status} {reason}".rstrip() + f"; {check}"
    oserr = _os_error(exc)
    if oserr is not None:
        name = errno.errorcode.get(oserr.errno or 0, str(oserr.errno))
        what = f"{name} ({oserr.strerror or oserr})"
    elif _transport(exc):
        what = f"{type(exc).__name__}: {str(exc)[:200]}"
    else:  # raised on this side: a client or configuration problem, not the network
        return (
            f"API server {address}: the request failed in the client "
            f"({type(exc).__name__}: {str(exc)[:300]}); check the kubeconfig and the object sent"
        )
    return (
        f"API server {address} unreachable: {what}; check that the API server is up and "
        "that this pod can reach it (Service kubernetes.default, network policies, "
        "firewalls, the kubeconfig's server address)"
    )


def api_status_message(exc: BaseException) -> str:
    """The `message` of the API server's Status answer carried by `exc` (its
    `body`), e.g. what a 422 found invalid; "" when there is none."""
    body = getattr(exc, "body", None)
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if not isinstance(body, str) or not body:
        return ""
    try:
        status = json.loads(body)
    except ValueError:
        return ""
    return str(status.get("message") or "") if isinstance(status, dict) else ""
