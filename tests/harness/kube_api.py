"""A local HTTP server that speaks the Kubernetes API's list/watch protocol
for a few collections (no real API server can run on these machines).

It serves, for the collections in COLLECTIONS (Services, EndpointSlices,
Pods, Namespaces, Nodes, NetworkPolicies, and the CiliumNetworkPolicy,
CiliumClusterwideNetworkPolicy, FlagellaNetworkPolicy, CiliumCIDRGroup,
FlagellaEndpoint, AdminNetworkPolicy, BaselineAdminNetworkPolicy,
CiliumLocalRedirectPolicy, CiliumLoadBalancerIPPool and CiliumBGPPeeringPolicy
custom resources, each at its all-namespaces path /api/v1/<plural> or
/apis/<group>/<version>/<plural>):
- LIST: GET -> {"kind": "<Kind>List", "metadata": {"resourceVersion"}, "items"}
  [&limit=N[&continue=T]]: pages of at most N items, all of the first
  page's resourceVersion, "continue" in the metadata while more follow; a
  continue token that expired (expire_watches) gets HTTP 410.
- WATCH: GET ?watch=true&resourceVersion=N[&timeoutSeconds=S] -> a chunked
  stream of newline-delimited {"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR,
  "object": ...} with every change after N, then the live ones, until S
  seconds passed; a resourceVersion older than the retained history gets an
  ERROR event carrying a Status with code 410 (Gone), as the real server
  answers an expired watch. With allowWatchBookmarks=true, bookmark() sends
  a BOOKMARK at the current resourceVersion.
- GET of one object at its own path (a Pod, a Namespace, a Lease, a
  FlagellaEndpoint, a Secret, a Role): the object, or 404.
It also takes the writes flagella makes (what a client may write is in
WRITABLE; Pods and Namespaces only tests write, with apply()):
- Leases (/apis/coordination.k8s.io/v1/namespaces/<ns>/leases[/<name>]) and
  FlagellaEndpoints (/apis/flagella.io/v1/namespaces/<ns>/flagellaendpoints
  [/<name>]): POST to create (409 AlreadyExists), PUT to update (404 when
  absent; 409 Conflict when the body's metadata.resourceVersion is not the
  stored one: optimistic concurrency, as the real server does), DELETE
  (FlagellaEndpoints; 404 when absent). Writes are watched like any change.
- Secrets (/api/v1/namespaces/<ns>/secrets[/<name>]): POST and PUT as
  above; Roles (/apis/rbac.authorization.k8s.io/v1/namespaces/<ns>/roles/
  <name>): PUT only (tests create them with apply()).
- Events (/api/v1/namespaces/<ns>/events): POST to create; kept in
  `events`, in order.
- Nodes (/api/v1/nodes/<name>): GET, and PATCH with a merge patch (as
  ipam's AnnotateNode writes annotations; 404 when absent).
- The status of Services (/api/v1/namespaces/<ns>/services/<name>/status)
  and of CiliumLoadBalancerIPPools (/apis/cilium.io/v2alpha1/
  ciliumloadbalancerippools/<name>/status): PATCH with a merge patch of the
  status alone (the lb's LoadBalancer addresses and pool conditions;
  refuse("PATCH", "services/status") makes the next one fail).
refuse(method, resource) makes the next such write fail (HTTP 500 unless
told), changing nothing: a client's retry can be tested.
One resourceVersion counter covers all objects, as etcd's revision does for
the real server; a new object gets a metadata.uid; a new Namespace gets the
kubernetes.io/metadata.name label, as the real server gives it. Deleting an
object deletes the objects whose ownerReferences name its uid, as the
garbage collector does (at once, here). Tests change objects with apply()
and delete(), can drop the history with compact(), and can take the server
down() and up() again on the same port (as an API server restarts; its
objects are kept).
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import json
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from harness.net import free_port

COLLECTIONS = {
    "/api/v1/services": ("services", "ServiceList", "v1"),
    "/apis/discovery.k8s.io/v1/endpointslices": (
        "endpointslices",
        "EndpointSliceList",
        "discovery.k8s.io/v1",
    ),
    "/apis/networking.k8s.io/v1/networkpolicies": (
        "networkpolicies",
        "NetworkPolicyList",
        "networking.k8s.io/v1",
    ),
    "/apis/cilium.io/v2/ciliumnetworkpolicies": (
        "ciliumnetworkpolicies",
        "CiliumNetworkPolicyList",
        "cilium.io/v2",
    ),
    "/apis/cilium.io/v2/ciliumclusterwidenetworkpolicies": (
        "ciliumclusterwidenetworkpolicies",
        "CiliumClusterwideNetworkPolicyList",
        "cilium.io/v2",
    ),
    "/apis/flagella.io/v1/flagellanetworkpolicies": (
        "flagellanetworkpolicies",
        "FlagellaNetworkPolicyList",
        "flagella.io/v1",
    ),
    "/apis/cilium.io/v2alpha1/ciliumcidrgroups": (
        "ciliumcidrgroups",
        "CiliumCIDRGroupList",
        "cilium.io/v2alpha1",
    ),
    "/apis/policy.networking.k8s.io/v1alpha1/adminnetworkpolicies": (
        "adminnetworkpolicies",
        "AdminNetworkPolicyList",
        "policy.networking.k8s.io/v1alpha1",
    ),
    "/apis/policy.networking.k8s.io/v1alpha1/baselineadminnetworkpolicies": (
        "baselineadminnetworkpolicies",
        "BaselineAdminNetworkPolicyList",
        "policy.networking.k8s.io/v1alpha1",
    ),
    "/api/v1/pods": ("pods", "PodList", "v1"),
    "/api/v1/namespaces": ("namespaces", "NamespaceList", "v1"),
    "/apis/flagella.io/v1/flagellaendpoints": (
        "flagellaendpoints",
        "FlagellaEndpointList",
        "flagella.io/v1",
    ),
    "/api/v1/nodes": ("nodes", "NodeList", "v1"),
    # The lb's local redirect policies.
    "/apis/cilium.io/v2/ciliumlocalredirectpolicies": (
        "ciliumlocalredirectpolicies",
        "CiliumLocalRedirectPolicyList",
        "cilium.io/v2",
    ),
    # The lb's LB-IPAM pools.
    "/apis/cilium.io/v2alpha1/ciliumloadbalancerippools": (
        "ciliumloadbalancerippools",
        "CiliumLoadBalancerIPPoolList",
        "cilium.io/v2alpha1",
    ),
    # The lb's BGP peering policies.
    "/apis/cilium.io/v2alpha1/ciliumbgppeeringpolicies": (
        "ciliumbgppeeringpolicies",
        "CiliumBGPPeeringPolicyList",
        "cilium.io/v2alpha1",
    ),
}
# The status subresources clients may merge-patch (the lb's LoadBalancer
# status, its pools' conditions): only the object's status changes.
STATUS_PATHS = (
    re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/(?P<res>services)/(?P<name>[^/]+)/status$"),
    re.compile(
        r"^/apis/cilium\.io/v2alpha1/(?P<res>ciliumloadbalancerippools)/(?P<name>[^/]+)/status$"
    ),
)
# One object's path (or a namespaced collection's, for POST): its resource,
# namespace ("" when cluster-scoped) and name (None: the collection).
OBJECT_PATHS = (
    re.compile(
        r"^/api/v1/namespaces/(?P<ns>[^/]+)/(?P<res>pods|events|secrets)(?:/(?P<name>[^/]+))?$"
    ),
    re.compile(r"^/api/v1/(?P<res>namespaces|nodes)/(?P<name>[^/]+)$"),
    re.compile(
        r"^/apis/(?:coordination\.k8s\.io|flagella\.io)/v1/namespaces/(?P<ns>[^/]+)/"
        r"(?P<res>leases|flagellaendpoints)(?:/(?P<name>[^/]+))?$"
    ),
    re.compile(
        r"^/apis/rbac\.authorization\.k8s\.io/v1/namespaces/(?P<ns>[^/]+)/"
        r"(?P<res>roles)(?:/(?P<name>[^/]+))?$"
    ),
)
# What clients may create, update and delete: resource -> (kind, apiVersion,
# the methods allowed).
WRITABLE = {
    "leases": ("Lease", "coordination.k8s.io/v1", ("POST", "PUT")),
    "flagellaendpoints": ("FlagellaEndpoint", "flagella.io/v1", ("POST", "PUT", "DELETE")),
    "secrets": ("Secret", "v1", ("POST", "PUT")),
    "roles": ("Role", "rbac.authorization.k8s.io/v1", ("PUT",)),
    # Nodes: a merge patch (ipam's AnnotateNode); tests create them with apply().
    "nodes": ("Node", "v1", ("PATCH",)),
}
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def object_path(path: str) -> tuple[str, str, str | None] | None:
    """(resource, namespace, name or None) of an object's path, or None."""
    for pattern in OBJECT_PATHS:
        m = pattern.match(path)
        if m is not None:
            groups = m.groupdict()
            return groups["res"], groups.get("ns") or "", groups["name"]
    return None


@dataclass
class _Change:
    rv: int
    resource: str
    type: str
    obj: dict[str, Any]


class KubeListWatchServer:
    def __init__(self, *, without: tuple[str, ...] = ()) -> None:
        """without: resources not served (404), as a kind whose CRD a cluster
        lacks."""
        self.without = without
        self.port = free_port()
        self._lock = threading.Condition()
        self._rv = 100
        self._objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {
            resource: {} for resource, _, _ in COLLECTIONS.values()
        }
        for resource in WRITABLE:
            self._objects.setdefault(resource, {})
        self.events: list[dict[str, Any]] = []
        self._history: list[_Change] = []
        self._oldest = self._rv  # watches from before this get 410
        self.requests: list[str] = []
        self.gone_sent = 0
        self.garbage_collected = 0  # objects deleted with their owner
        self._generation = 0
        self._closing = False
        self._bookmarks = 0
        # Pages of lists still to be read, by continue token.
        self._continues: dict[str, tuple[int, list[dict[str, Any]]]] = {}
        self._tokens = 0
        self._connections: set[socket.socket] = set()
        self.httpd: _QuietServer | None = None
        # (method, resource) -> HTTP codes the next such writes get (refuse()).
        self._refusals: dict[tuple[str, str], list[int]] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> KubeListWatchServer:
        return self.up()

    def stop(self) -> None:
        with self._lock:
            self._closing = True
        self.down()

    def __enter__(self) -> KubeListWatchServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def up(self) -> KubeListWatchServer:
        """Serve (again) on the same port."""
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def address_string(self) -> str:
                return str(self.client_address[0])

            def setup(self) -> None:
                super().setup()
                with server._lock:
                    server._connections.add(self.connection)

            def finish(self) -> None:
                with server._lock:
                    server._connections.discard(self.connection)
                super().finish()

            def do_GET(self) -> None:
                server._handle(self)

            def do_POST(self) -> None:
                server._write(self, "POST")

            def do_PUT(self) -> None:
                server._write(self, "PUT")

            def do_DELETE(self) -> None:
                server._write(self, "DELETE")

            def do_PATCH(self) -> None:
                server._write(self, "PATCH")

        self.httpd = _QuietServer(("127.0.0.1", self.port), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def down(self) -> None:
        """Stop serving and drop every connection (watches and kept-alive
        ones), as a restarting API server does; objects and history stay."""
        with self._lock:
            self._generation += 1
            self._lock.notify_all()
            connections = list(self._connections)
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def write_kubeconfig(self, path: Path) -> Path:
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "local", "cluster": {"server": self.url}}],
                    "users": [{"name": "tester", "user": {"token": "test-token"}}],
                    "contexts": [
                        {"name": "local", "context": {"cluster": "local", "user": "tester"}}
                    ],
                    "current-context": "local",
                }
            )
        )
        return path

    # --- what tests do ---

    def apply(self, resource: str, obj: dict[str, Any]) -> int:
        """Create or replace an object; returns its new resourceVersion."""
        with self._lock:
            return self._store(resource, copy.deepcopy(obj))

    def delete(self, resource: str, namespace: str, name: str) -> int:
        """Delete an object, and what it owns; returns the resourceVersion
        of its deletion."""
        with self._lock:
            return self._delete(resource, namespace, name)

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The stored object, or None."""
        with self._lock:
            obj = self._objects[resource].get((namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def list(self, resource: str) -> list[dict[str, Any]]:
        """Every stored object of a resource, by (namespace, name)."""
        with self._lock:
            return [copy.deepcopy(o) for _, o in sorted(self._objects[resource].items())]

    def _store(self, resource: str, obj: dict[str, Any]) -> int:
        """Store obj (the lock held): a new resourceVersion, the uid it had
        or a new one, a watch event."""
        self._rv += 1
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = str(self._rv)
        key = (meta.get("namespace", ""), meta["name"])
        if resource == "namespaces":
            meta["labels"] = {**(meta.get("labels") or {}), NAMESPACE_NAME_LABEL: meta["name"]}
        old = self._objects[resource].get(key)
        if old is not None:
            meta["uid"] = old["metadata"]["uid"]
            meta["creationTimestamp"] = old["metadata"].get("creationTimestamp")
        else:
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        kind = "MODIFIED" if old is not None else "ADDED"
        self._objects[resource][key] = obj
        self._history.append(_Change(self._rv, resource, kind, copy.deepcopy(obj)))
        self._lock.notify_all()
        return self._rv

    def _delete(self, resource: str, namespace: str, name: str) -> int:
        """Delete (the lock held), then what the object owned (the garbage
        collector's cascade)."""
        obj = self._objects[resource].pop((namespace, name))
        self._rv += 1
        rv = self._rv
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(rv)
        self._history.append(_Change(rv, resource, "DELETED", obj))
        uid = obj["metadata"].get("uid")
        for other, objects in self._objects.items():
            for key, owned in list(objects.items()):
                owners = (owned.get("metadata") or {}).get("ownerReferences") or []
                if uid and any(o.get("uid") == uid for o in owners) and key in objects:
                    self.garbage_collected += 1
                    self._delete(other, *key)
        self._lock.notify_all()
        return rv

    def compact(self) -> None:
        """Forget the history: watches from an older resourceVersion get 410."""
        with self._lock:
            self._history.clear()
            self._oldest = self._rv

    def expire_watches(self) -> None:
        """End every open watch and make every resourceVersion handed out so
        far too old (as after the API server's watch cache moved on): the
        next watch gets 410 Gone and the client must list again."""
        with self._lock:
            self._rv += 1
            self._history.clear()
            self._oldest = self._rv
            self._generation += 1
            self._continues.clear()
            self._lock.notify_all()

    def lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The stored Lease, or None."""
        with self._lock:
            obj = self._objects["leases"].get((namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def events_about(self, kind: str, namespace: str, name: str) -> builtins.list[dict[str, Any]]:
        """The Events created so far whose involvedObject is this object."""
        with self._lock:
            return [
                copy.deepcopy(e)
                for e in self.events
                if (e.get("involvedObject") or {}).get("kind") == kind
                and (e.get("involvedObject") or {}).get("namespace", "") == namespace
                and (e.get("involvedObject") or {}).get("name") == name
            ]

    def refuse(self, method: str, resource: str, code: int = 500, times: int = 1) -> None:
        """The next `times` writes (method, e.g. PATCH) of resource are
        answered `code` and change nothing, as an API server that is
        overloaded or restarting refuses them."""
        with self._lock:
            self._refusals.setdefault((method, resource), []).extend([code] * times)

    def bookmark(self) -> int:
        """A BOOKMARK at the current resourceVersion on every open watch that
        allows them (after the changes before it); returns that version."""
        with self._lock:
            self._bookmarks += 1
            self._lock.notify_all()
            return self._rv

    # --- the protocol ---

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        url = urlparse(h.path)
        self.requests.append(h.path)
        coll = COLLECTIONS.get(url.path)
        if coll is not None and coll[0] in self.without:
            coll = None
        one = object_path(url.path) if coll is None else None
        if one is not None and one[2] is not None:
            self._get_one(h, one[0], one[1], one[2])
            return
        if coll is None:
            self._send_json(h, 404, _status(404, "NotFound", f"{url.path} not served here"))
            return
        resource, list_kind, api_version = coll
        kind = list_kind.removesuffix("List")
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if query.get("watch") in ("true", "1", "True"):
            self._watch(h, resource, kind, api_version, query)
            return
        limit = int(query.get("limit") or 0)
        with self._lock:
            token = query.get("continue")
            if token:
                if token not in self._continues:
                    self._send_json(h, 410, _status(410, "Expired", "continue token expired"))
                    return
                rv, items = self._continues.pop(token)
            else:
                rv = self._rv
                items = [copy.deepcopy(o) for _, o in sorted(self._objects[resource].items())]
            metadata: dict[str, Any] = {"resourceVersion": str(rv)}
            if limit and len(items) > limit:
                self._tokens += 1
                token = f"page-{self._tokens}"
                self._continues[token] = (rv, items[limit:])
                items = items[:limit]
                metadata["continue"] = token
            body = {
                "kind": list_kind,
                "apiVersion": api_version,
                "metadata": metadata,
                "items": items,
            }
        self._send_json(h, 200, body)

    def _write(self, h: BaseHTTPRequestHandler, method: str) -> None:
        """POST/PUT/DELETE of what WRITABLE allows, POST of an Event."""
        url = urlparse(h.path)
        self.requests.append(f"{method} {h.path}")
        length = int(h.headers.get("Content-Length") or 0)
        try:
            body = json.loads(h.rfile.read(length) or b"{}")
        except ValueError:
            self._send_json(h, 400, _status(400, "BadRequest", "body is not JSON"))
            return
        for pattern in STATUS_PATHS:
            m = pattern.match(url.path)
            if m is not None and method == "PATCH":
                key = (m.groupdict().get("ns") or "", m["name"])
                with self._lock:
                    refusals = self._refusals.get((method, m["res"] + "/status"))
                    if refusals:
                        code = refusals.pop(0)
                        self._send_json(h, code, _status(code, "InternalError", "refused (test)"))
                        return
                    current = self._objects[m["res"]].get(key)
                    self._patch(h, m["res"], key, current, {"status": body.get("status")})
                return
        where = object_path(url.path)
        if where is not None and where[0] == "events" and where[2] is None and method == "POST":
            with self._lock:
                self._rv += 1
                meta = body.setdefault("metadata", {})
                meta.update(namespace=where[1], resourceVersion=str(self._rv))
                meta.setdefault("uid", str(uuid.uuid4()))
                self.events.append(body)
            self._send_json(h, 201, body)
            return
        if (
            where is None
            or where[0] not in WRITABLE
            or method not in WRITABLE[where[0]][2]
            or (method == "POST") != (where[2] is None)
        ):
            self._send_json(h, 405, _status(405, "MethodNotAllowed", f"{method} {url.path}"))
            return
        resource, namespace, name = where
        kind, api_version, _ = WRITABLE[resource]
        meta = body.setdefault("metadata", {})
        name = name or meta.get("name", "")
        key = (namespace, name)
        with self._lock:
            refusals = self._refusals.get((method, resource))
            if refusals:
                code = refusals.pop(0)
                self._send_json(h, code, _status(code, "InternalError", "refused (test)"))
                return
            current = self._objects[resource].get(key)
            if method == "PATCH":
                self._patch(h, resource, key, current, body)
                return
            if method == "POST" and current is not None:
                self._send_json(h, 409, _status(409, "AlreadyExists", f"{resource} {name} exists"))
                return
            if method != "POST" and current is None:
                self._send_json(h, 404, _status(404, "NotFound", f"{resource} {name} not found"))
                return
            if method == "DELETE":
                self._delete(resource, namespace, name)
                self._send_json(h, 200, _status(200, "", "deleted") | {"status": "Success"})
                return
            if (
                method == "PUT"
                and current is not None
                and meta.get("resourceVersion") != current["metadata"]["resourceVersion"]
            ):
                message = f"the object has been modified; {resource} {name}"
                self._send_json(h, 409, _status(409, "Conflict", message))
                return
            meta.update(name=name, namespace=namespace)
            meta.pop("uid", None)
            body.update(kind=kind, apiVersion=api_version)
            self._store(resource, body)
            stored = copy.deepcopy(body)
        self._send_json(h, 201 if method == "POST" else 200, stored)

    def _patch(
        self,
        h: BaseHTTPRequestHandler,
        resource: str,
        key: tuple[str, str],
        current: dict[str, Any] | None,
        patch: dict[str, Any],
    ) -> None:
        """A JSON merge patch (RFC 7386; also how a strategic merge patch of
        plain fields such as annotations applies), the lock held."""
        if h.headers.get("Content-Type", "").split(";")[0] not in (
            "application/merge-patch+json",
            "application/strategic-merge-patch+json",
        ):
            self._send_json(h, 415, _status(415, "UnsupportedMediaType", "merge patches only"))
            return
        if current is None:
            self._send_json(h, 404, _status(404, "NotFound", f"{resource} {key[1]} not found"))
            return
        patch.get("metadata", {}).pop("resourceVersion", None)
        merged = _merge_patch(copy.deepcopy(current), patch)
        self._store(resource, merged)
        self._send_json(h, 200, copy.deepcopy(merged))

    def _get_one(self, h: BaseHTTPRequestHandler, resource: str, namespace: str, name: str) -> None:
        obj = self.get(resource, namespace, name) if resource in self._objects else None
        if obj is None:
            self._send_json(h, 404, _status(404, "NotFound", f"{resource} {name} not found"))
        else:
            self._send_json(h, 200, obj)

    def _send_json(self, h: BaseHTTPRequestHandler, code: int, body: Any) -> None:
        raw = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(raw)))
        h.end_headers()
        h.wfile.write(raw)

    def _watch(
        self,
        h: BaseHTTPRequestHandler,
        resource: str,
        kind: str,
        api_version: str,
        query: dict[str, str],
    ) -> None:
        since = int(query.get("resourceVersion") or 0)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1", "True")
        timeout = float(query.get("timeoutSeconds") or 1800)
        deadline = time.monotonic() + timeout
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def chunk(event: dict[str, Any]) -> None:
            data = json.dumps(event).encode() + b"\n"
            h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            h.wfile.flush()

        try:
            with self._lock:
                if since and since < self._oldest:
                    expired = _status(
                        410, "Expired", f"too old resource version: {since} ({self._oldest})"
                    )
                    self.gone_sent += 1
                    chunk({"type": "ERROR", "object": expired})
                    h.wfile.write(b"0\r\n\r\n")
                    return
                cursor = since or self._rv
                generation = self._generation
                bookmarks_seen = self._bookmarks
            while True:
                with self._lock:
                    if self._closing or generation != self._generation:
                        break
                    pending = [c for c in self._history if c.rv > cursor and c.resource == resource]
                    mark = None
                    if bookmarks and bookmarks_seen != self._bookmarks:
                        bookmarks_seen = self._bookmarks
                        mark = {
                            "kind": kind,
                            "apiVersion": api_version,
                            "metadata": {"resourceVersion": str(self._rv)},
                        }
                    if not pending and mark is None:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            break
                        self._lock.wait(min(remaining, 1.0))
                        continue
                for c in pending:
                    chunk({"type": c.type, "object": c.obj})
                    cursor = c.rv
                if mark is not None:
                    chunk({"type": "BOOKMARK", "object": mark})
            h.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client went away
            pass


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """Clients going away mid-request are normal here."""


def _merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            target[k] = _merge_patch(target[k], v)
        else:
            target[k] = copy.deepcopy(v)
    return target


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def k8s_service(
    namespace: str,
    name: str,
    cluster_ip: str,
    ports: list[dict[str, Any]],
    *,
    type: str = "ClusterIP",
    annotations: dict[str, str] | None = None,
    session_affinity_timeout: int | None = None,
    source_ranges: list[str] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "type": type,
        "clusterIP": cluster_ip,
        "clusterIPs": [cluster_ip],
        "ports": ports,
        "sessionAffinity": "None",
    }
    if session_affinity_timeout is not None:
        spec["sessionAffinity"] = "ClientIP"
        spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": session_affinity_timeout}}
    if source_ranges:
        spec["loadBalancerSourceRanges"] = source_ranges
    return {
        "kind": "Service",
        "apiVersion": "v1",
        "metadata": {"namespace": namespace, "name": name, "annotations": annotations or {}},
        "spec": spec,
    }


def k8s_endpoint_slice(
    namespace: str,
    name: str,
    service: str,
    ports: list[dict[str, Any]],
    endpoints: list[dict[str, Any]],
    *,
    address_type: str = "IPv4",
) -> dict[str, Any]:
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {
            "namespace": namespace,
            "name": name,
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": address_type,
        "ports": ports,
        "endpoints": endpoints,
    }


# The policy kinds: kind -> (collection, apiVersion).
POLICY_KINDS = {
    "NetworkPolicy": ("networkpolicies", "networking.k8s.io/v1"),
    "CiliumNetworkPolicy": ("ciliumnetworkpolicies", "cilium.io/v2"),
    "CiliumClusterwideNetworkPolicy": ("ciliumclusterwidenetworkpolicies", "cilium.io/v2"),
    "FlagellaNetworkPolicy": ("flagellanetworkpolicies", "flagella.io/v1"),
}


# The admin tiers' kinds (cluster-scoped), kept apart from POLICY_KINDS,
# whose tests make one object of every kind there.
ADMIN_POLICY_KINDS = {
    "AdminNetworkPolicy": ("adminnetworkpolicies", "policy.networking.k8s.io/v1alpha1"),
    "BaselineAdminNetworkPolicy": (
        "baselineadminnetworkpolicies",
        "policy.networking.k8s.io/v1alpha1",
    ),
}


def k8s_policy(
    kind: str,
    namespace: str,
    name: str,
    spec: dict[str, Any],
    *,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A policy object of one of POLICY_KINDS, as the API server holds it
    (namespace "" for the cluster-wide kind)."""
    _, api_version = POLICY_KINDS[kind]
    meta: dict[str, Any] = {"name": name, "creationTimestamp": "2025-01-01T00:00:00Z"}
    if namespace:
        meta["namespace"] = namespace
    if labels:
        meta["labels"] = labels
    return {"apiVersion": api_version, "kind": kind, "metadata": meta, "spec": spec}
