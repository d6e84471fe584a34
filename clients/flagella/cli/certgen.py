"""`flagella certs sync | k8s-sync | k8s-fetch`: keeping the cluster's
certificates issued, as Cilium's certgen does.

- sync: into a folder, one sub-folder per identity (compose's `certs` service).
- k8s-sync: into Secrets of one namespace through the Kubernetes API (the
  certgen Job and CronJob): the CA in `flagella-ca`, each leaf in a
  kubernetes.io/tls Secret `flagella-<kind>-<name>`, one per node found in
  the API; and the datapath's Role may read exactly the node Secrets.
- both, with --etcd-server/--etcd-client: etcd's certificates too, from the
  etcd CA (a folder of its own, --etcd-out; or the Secret `flagella-etcd-ca`
  and `flagella-etcd-server-tls`, `flagella-<svc>-etcd-tls`,
  `flagella-etcd-root-tls`).
- k8s-fetch: one Secret into a folder, once or every so often (the datapath
  pod's node certificate: a DaemonSet cannot mount a Secret named per node).
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import sys
import time
from pathlib import Path
from typing import Any

from flagella.cli import certs
from flagella.cli.certsync import (
    ETCD_KINDS,
    ETCD_SERVER,
    Bundle,
    FolderStore,
    Leaf,
    Store,
    etcd_plan,
    plan,
    sync,
)
from flagella.common import etcdauth, pki
from flagella.common.backoff import Backoff
from flagella.common.config import parse_ip

CA_SECRET = "flagella-ca"
ETCD_CA_SECRET = "flagella-etcd-ca"
ETCD_CA_NAME = "flagella etcd CA"
NODE_ROLE = "flagella-datapath-node-certs"
LABELS = {
    "app.kubernetes.io/part-of": "flagella",
    "app.kubernetes.io/managed-by": "flagella-certgen",
}
KIND_LABEL = "flagella.io/identity-kind"
IDENTITY_ANNOTATION = "flagella.io/identity"


def secret_name(identity: pki.Identity) -> str:
    return f"flagella-{identity.kind}-{identity.name}".lower()


def leaf_secret(leaf: Leaf) -> str:
    """A leaf's Secret: by identity, or etcd's (flagella-etcd-server-tls,
    flagella-etcd-root-tls, flagella-<svc>-etcd-tls)."""
    if leaf.place is None:
        return secret_name(leaf.identity)
    name = leaf.place[1]
    if name in (ETCD_SERVER, etcdauth.ROOT):
        return f"flagella-etcd-{name}-tls"
    return f"flagella-{name}-etcd-tls"


def kube_clients(kubeconfig: str | None) -> Any:
    """An ApiClient: from a kubeconfig, or in the pod's service account."""
    from kubernetes import client, config

    try:
        if kubeconfig:
            return config.new_client_from_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig
            )
        configuration = client.Configuration()
        config.load_incluster_config(  # type: ignore[no-untyped-call]
            client_configuration=configuration
        )
        return client.ApiClient(configuration)
    except (config.ConfigException, OSError, TypeError, ValueError) as exc:
        where = kubeconfig or "the pod's service account"
        raise certs.CertsError(f"cannot load {where}: {exc} (--kubeconfig)") from None


def _status(exc: Exception) -> int:
    return int(getattr(exc, "status", 0) or 0)


class SecretStore:
    """The CA and leaves as Secrets in one namespace."""

    def __init__(
        self, api: Any, namespace: str, *, external_ca: bool = False, ca_secret: str = CA_SECRET
    ) -> None:
        """external_ca: the CA Secret is kept by someone else (cert-manager,
        as a TLS Secret: tls.crt, tls.key): read it, never write it."""
        from kubernetes import client

        self.core: Any = client.CoreV1Api(api)
        self.namespace = namespace
        self.external_ca = external_ca
        self.ca_secret = ca_secret

    def _read(self, name: str) -> dict[str, bytes] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            secret = self.core.read_namespaced_secret(name, self.namespace)
        except ApiException as exc:
            if _status(exc) == 404:
                return None
            raise
        return {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}

    def _write(self, name: str, kind: str, data: dict[str, bytes], meta: dict[str, Any]) -> None:
        from kubernetes.client.exceptions import ApiException

        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": kind,
            "metadata": {"name": name, "namespace": self.namespace, **meta},
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
        }
        try:
            current = self.core.read_namespaced_secret(name, self.namespace)
        except ApiException as exc:
            if _status(exc) != 404:
                raise
            self.core.create_namespaced_secret(self.namespace, body)
            return
        # Optimistic concurrency: a concurrent writer makes this fail (409),
        # and the next pass starts over from what is stored.
        body["metadata"]["resourceVersion"] = current.metadata.resource_version
        self.core.replace_namespaced_secret(name, self.namespace, body)

    def read_ca(self) -> tuple[bytes, bytes] | None:
        data = self._read(self.ca_secret)
        cert, key = (
            (pki.CERT_FILE, pki.KEY_FILE) if self.external_ca else (pki.CA_FILE, certs.CA_KEY)
        )
        if data is None or cert not in data or key not in data:
            return None
        return data[cert], data[key]

    def write_ca(self, cert: bytes, key: bytes) -> None:
        if self.external_ca:
            raise certs.CertsError(
                f"the CA in Secret {self.namespace}/{self.ca_secret} is kept elsewhere "
                "(--external-ca) and is missing, unusable or about to expire"
            )
        data = {pki.CA_FILE: cert, certs.CA_KEY: key}
        self._write(self.ca_secret, "Opaque", data, {"labels": LABELS})

    def read_leaf(self, leaf: Leaf) -> Bundle | None:
        data = self._read(leaf_secret(leaf))
        files = (pki.CERT_FILE, pki.KEY_FILE, pki.CA_FILE)
        if data is None or any(f not in data for f in files):
            return None
        return Bundle(data[pki.CERT_FILE], data[pki.KEY_FILE], data[pki.CA_FILE])

    def write_leaf(self, leaf: Leaf, bundle: Bundle) -> None:
        meta = {
            "labels": {**LABELS, KIND_LABEL: leaf.kind},
            "annotations": {IDENTITY_ANNOTATION: leaf.identity.uri},
        }
        data = {pki.CERT_FILE: bundle.cert, pki.KEY_FILE: bundle.key, pki.CA_FILE: bundle.ca}
        self._write(leaf_secret(leaf), "kubernetes.io/tls", data, meta)


def api_nodes(api: Any) -> dict[str, list[str]]:
    """Every Node's name -> its InternalIPs (where its datapath listens)."""
    from kubernetes import client

    core: Any = client.CoreV1Api(api)
    return {
        n.metadata.name: sorted(
            a.address
            for a in (n.status.addresses if n.status else None) or []
            if a.type == "InternalIP"
        )
        for n in core.list_node().items
    }


def parse_nodes(values: list[str], flag: str = "--node") -> dict[str, list[str]]:
    """NAME[=IP,IP...] -> {name: ips}."""
    nodes: dict[str, list[str]] = {}
    for value in values:
        name, _, ips = value.partition("=")
        for ip in filter(None, ips.split(",")):
            try:
                parse_ip(ip)
            except ValueError as exc:
                raise certs.CertsError(f"invalid {flag} {value!r}: {exc}") from None
        nodes[name] = [ip for ip in ips.split(",") if ip]
    return nodes


def grant_node_secrets(api: Any, namespace: str, role: str, names: list[str]) -> bool:
    """Limit the datapath's Role to reading exactly these Secrets (a Role
    cannot name Secrets by pattern, and must never reach the CA's or a
    service's). Whether it changed."""
    from kubernetes import client

    rbac: Any = client.RbacAuthorizationV1Api(api)
    current = rbac.read_namespaced_role(role, namespace)
    wanted = [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": names}
    ]
    rules = [
        {
            "apiGroups": list(r.api_groups or []),
            "resources": list(r.resources or []),
            "verbs": list(r.verbs or []),
            "resourceNames": list(r.resource_names or []),
        }
        for r in current.rules or []
    ]
    if rules == wanted:
        return False
    body = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {
            "name": role,
            "namespace": namespace,
            "resourceVersion": current.metadata.resource_version,
            "labels": current.metadata.labels or {},
        },
        "rules": wanted,
    }
    rbac.replace_namespaced_role(role, namespace, body)
    return True


# --- the commands ---


def _owners(values: list[str]) -> dict[str, tuple[int, int]]:
    owners = {}
    for value in values:
        kind, sep, ids = value.partition("=")
        uid, sep2, gid = ids.partition(":")
        known = (*pki.KINDS, *ETCD_KINDS)
        if not sep or kind not in known or not uid.isdigit() or (sep2 and not gid.isdigit()):
            raise certs.CertsError(f"invalid --owner {value!r}: want KIND=UID[:GID]")
        owners[kind] = (int(uid), int(gid or uid))
    return owners


def _leaves(args: argparse.Namespace, nodes: dict[str, list[str]]) -> list[Leaf]:
    try:
        return plan(args.service, nodes, args.operator, names=certs.default_names)
    except ValueError as exc:
        raise certs.CertsError(str(exc)) from None


def _etcd_leaves(args: argparse.Namespace) -> list[Leaf]:
    """etcd's leaves the flags ask for (none without --etcd-server/--etcd-client)."""
    server = None
    if args.etcd_server:
        [(name, ips)] = parse_nodes([args.etcd_server], "--etcd-server").items()
        server = (name, ips)
    return etcd_plan(server, args.etcd_client, names=certs.etcd_server_names)


def _sync(
    args: argparse.Namespace, store: Store, leaves: list[Leaf], *, etcd: bool = False
) -> None:
    """One pass over a store; etcd: the etcd CA's store (its lines say so)."""
    prefix = "etcd: " if etcd else ""
    try:
        changes = sync(
            store,
            leaves,
            lifetime=dt.timedelta(hours=args.hours),
            renew_before=dt.timedelta(hours=args.renew_before),
            ca_name=ETCD_CA_NAME if etcd else "flagella cluster CA",
        )
    except ValueError as exc:
        raise certs.CertsError(str(exc)) from None
    for change in changes:
        print(f"{prefix}issued {change}")
    print(f"{prefix}{len(leaves)} certificates, {len(changes)} written")


def cmd_sync(args: argparse.Namespace) -> int:
    owners = _owners(args.owner)
    etcd_leaves = _etcd_leaves(args)
    if etcd_leaves and not args.etcd_out:
        raise certs.CertsError("--etcd-server/--etcd-client: --etcd-out (their folder) is required")
    try:
        _sync(args, FolderStore(args.out, owners), _leaves(args, parse_nodes(args.node)))
        if etcd_leaves:
            _sync(args, FolderStore(args.etcd_out, owners), etcd_leaves, etcd=True)
    except OSError as exc:
        raise certs.CertsError(f"{exc.filename}: {exc.strerror or exc}") from None
    return 0


def cmd_k8s_sync(args: argparse.Namespace) -> int:
    from kubernetes.client.exceptions import ApiException

    api = kube_clients(args.kubeconfig)
    try:
        nodes = {**(api_nodes(api) if args.nodes_from_api else {}), **parse_nodes(args.node)}
        leaves = _leaves(args, nodes)
        etcd_leaves = _etcd_leaves(args)
        _sync(args, SecretStore(api, args.namespace, external_ca=args.external_ca), leaves)
        if etcd_leaves:
            # Its own CA, always kept here (cert-manager or not).
            etcd_store = SecretStore(api, args.namespace, ca_secret=ETCD_CA_SECRET)
            _sync(args, etcd_store, etcd_leaves, etcd=True)
        if args.node_role:
            names = sorted(secret_name(pki.node(n)) for n in nodes)
            if grant_node_secrets(api, args.namespace, args.node_role, names):
                print(f"role {args.node_role}: may read {len(names)} node Secrets")
    except ApiException as exc:
        raise certs.CertsError(f"Kubernetes API: {_status(exc)} {exc.reason}") from None
    return 0


def fetch_once(api: Any, namespace: str, secret: str, out: Path) -> bool:
    """Write the Secret's tls.crt, tls.key and ca.crt into out when they
    differ from what is there; whether it wrote. LookupError: no such Secret
    (yet)."""
    data = SecretStore(api, namespace)._read(secret)
    if data is None or any(f not in data for f in (pki.CERT_FILE, pki.KEY_FILE, pki.CA_FILE)):
        raise LookupError(f"Secret {namespace}/{secret} does not exist (yet) or is not TLS")
    current = {f: (out / f).read_bytes() if (out / f).exists() else None for f in data}
    if all(current.get(f) == data[f] for f in (pki.CERT_FILE, pki.KEY_FILE, pki.CA_FILE)):
        return False
    issued = pki.Issued(data[pki.CERT_FILE], data[pki.KEY_FILE])
    pki.write_bundle(out, issued, data[pki.CA_FILE], overwrite=True)
    return True


def cmd_k8s_fetch(args: argparse.Namespace) -> int:
    from kubernetes.client.exceptions import ApiException

    api = kube_clients(args.kubeconfig)
    out = Path(args.out)
    backoff = Backoff(1.0, 30.0)
    deadline = time.monotonic() + args.wait
    fetched = False
    while True:
        try:
            if fetch_once(api, args.namespace, args.secret, out):
                print(f"wrote {args.secret} into {out}", flush=True)
            fetched = True
            backoff.reset()
        except (LookupError, ApiException, OSError) as exc:
            problem = f"{_status(exc)} {exc.reason}" if isinstance(exc, ApiException) else exc
            print(f"flagella certs k8s-fetch: {problem}", file=sys.stderr, flush=True)
            if not args.every and time.monotonic() >= deadline:
                raise certs.CertsError(f"{args.secret}: {problem}") from None
            time.sleep(backoff.next())
            continue
        if not args.every:
            return 0 if fetched else 1
        time.sleep(args.every)


def _issue_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--service", action="append", default=[], help="a service (repeat)")
    p.add_argument(
        "--node",
        action="append",
        default=[],
        help="a node, NAME or NAME=IP[,IP...] with the addresses its datapath serves on (repeat)",
    )
    p.add_argument("--operator", action="append", default=[], help="an operator (repeat)")
    p.add_argument(
        "--etcd-server",
        default="",
        help="etcd's server certificate, NAME or NAME=IP[,IP...] (from the etcd CA)",
    )
    p.add_argument(
        "--etcd-client",
        action="append",
        default=[],
        help=f"an etcd client certificate, CN = the etcd user: {', '.join(etcdauth.SERVICES)} "
        f"or {etcdauth.ROOT} (repeat)",
    )
    p.add_argument("--hours", type=float, default=24, help="leaf lifetime (default 24 hours)")
    p.add_argument(
        "--renew-before",
        type=float,
        default=8,
        help="re-issue a leaf with less than this many hours left (default 8)",
    )


def _kube_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", default=certs.NAMESPACE, help="namespace of the Secrets")
    p.add_argument("--kubeconfig", help="default: the pod's service account")


def add_parsers(csub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = csub.add_parser("sync", help="keep a CA and every leaf issued in a folder (idempotent)")
    p.add_argument("--out", required=True, help="folder: ca/ and <kind>/<name>/ under it")
    p.add_argument(
        "--etcd-out",
        default="",
        help="folder of the etcd CA and certificates: ca/, server/, <user>/ under it",
    )
    p.add_argument(
        "--owner",
        action="append",
        default=[],
        help="KIND=UID[:GID]: who owns that kind's files (e.g. service=65532); kinds: "
        f"{', '.join((*pki.KINDS, *ETCD_KINDS))} (etcd-service: the services' etcd certificates)",
    )
    _issue_flags(p)
    p.set_defaults(func=lambda args, clients: cmd_sync(args))

    p = csub.add_parser("k8s-sync", help="keep a CA and every leaf issued in Secrets")
    _kube_flags(p)
    _issue_flags(p)
    p.add_argument(
        "--nodes-from-api",
        action="store_true",
        help="a node certificate for every Node, naming its InternalIPs",
    )
    p.add_argument(
        "--external-ca",
        action="store_true",
        help=f"{CA_SECRET} is kept by cert-manager (tls.crt, tls.key): use it, never write it",
    )
    p.add_argument(
        "--node-role",
        default="",
        help="a Role whose one rule is set to reading exactly the node Secrets",
    )
    p.set_defaults(func=lambda args, clients: cmd_k8s_sync(args))

    p = csub.add_parser("k8s-fetch", help="copy one TLS Secret into a folder")
    _kube_flags(p)
    p.add_argument("--secret", required=True, help="the Secret's name")
    p.add_argument("--out", required=True, help="folder for tls.crt, tls.key, ca.crt")
    p.add_argument("--wait", type=float, default=300, help="seconds to wait for the Secret")
    p.add_argument("--every", type=float, default=0, help="keep fetching, every this many s")
    p.set_defaults(func=lambda args, clients: cmd_k8s_fetch(args))
