"""Where the CLI finds the suite.

Each control-plane service's default address comes from the environment the
CLI runs in, so that inside any flagella container or pod it needs no flags;
the datapaths, one per node, come from the node registry (ipam), as the
`cilium` CLI finds its agents through the cluster rather than by address.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass

SERVICES = ("ipam", "policy", "endpoint", "lb")
LOCAL_PORTS = {
    "ipam": 50051, "policy": 50052, "endpoint": 50053, "lb": 50054, "datapath": 50055,
    "relay": 50056,
}  # fmt: skip
WILDCARDS = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "": "127.0.0.1"}


def local_address(listen: str) -> str:
    """Where a process on this host reaches a server listening on listen
    (a wildcard listener on loopback)."""
    if listen.startswith("unix:"):
        return listen
    host, sep, port = listen.rpartition(":")
    if not sep:
        return listen
    return f"{WILDCARDS.get(host, host)}:{port}"


def kubernetes_address(svc: str, environ: Mapping[str, str]) -> str | None:
    """The address of the Service named svc in the pod's namespace, from the
    variables the kubelet gives every pod (<SVC>_SERVICE_HOST/_PORT), else
    its name (in a pod)."""
    host = environ.get(f"{svc.upper()}_SERVICE_HOST", "")
    port = environ.get(f"{svc.upper()}_SERVICE_PORT", "")
    if not host or not port:
        # A headless Service (the control plane's: every replica's address
        # by DNS) gets no variables; in a pod, its name resolves.
        in_pod = bool(environ.get("KUBERNETES_SERVICE_HOST"))
        return f"{svc}:{LOCAL_PORTS[svc]}" if in_pod and svc in LOCAL_PORTS else None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def default_address(svc: str, environ: Mapping[str, str]) -> str | None:
    """svc's address from the environment, first found of: the operator's
    FLAGELLA_<SVC>_ADDRESS; the container's own service
    (FLAGELLA_<SVC>_LISTEN); the address another flagella service in this
    container was given for it (FLAGELLA_<OTHER>_<SVC>_ADDRESS); the
    Kubernetes Service's variables. Else the local bring-up's port, except
    for the datapath: None, found through the node registry."""
    name = svc.upper()
    if environ.get(f"FLAGELLA_{name}_ADDRESS"):
        return environ[f"FLAGELLA_{name}_ADDRESS"]
    if svc == "datapath":
        return None
    if environ.get(f"FLAGELLA_{name}_LISTEN"):
        return local_address(environ[f"FLAGELLA_{name}_LISTEN"])
    for other in (*SERVICES, "datapath"):
        peer = environ.get(f"FLAGELLA_{other.upper()}_{name}_ADDRESS")
        if peer:
            return peer
    return kubernetes_address(svc, environ) or f"127.0.0.1:{LOCAL_PORTS[svc]}"


def default_node(environ: Mapping[str, str]) -> str:
    """The node this runs on: a datapath container's node name, else this
    machine's host name (a datapath's default node name)."""
    return (
        environ.get("FLAGELLA_DATAPATH_NODE_NAME")
        or environ.get("FLAGELLA_NODE_NAME")
        or socket.gethostname()
    )


@dataclass(frozen=True)
class Datapath:
    """One node's datapath: node is "" when it was given by address."""

    node: str
    address: str

    @property
    def label(self) -> str:
        return f"datapath/{self.node}" if self.node else "datapath"


def pick_one(registered: Mapping[str, str], node: str, here: str) -> Datapath:
    """The datapath a one-node command talks to, from the registry's node ->
    datapath address: the named node; else the node this runs on; else the
    only node."""
    if node:
        if node not in registered:
            known = ", ".join(sorted(registered)) or "none"
            raise LookupError(f"no node {node!r} with a datapath in the registry (nodes: {known})")
        return Datapath(node, registered[node])
    if here in registered:
        return Datapath(here, registered[here])
    if len(registered) == 1:
        name, address = next(iter(registered.items()))
        return Datapath(name, address)
    if not registered:
        raise LookupError("no node has registered a datapath (give --datapath-address)")
    raise LookupError(
        f"{len(registered)} nodes ({', '.join(sorted(registered))}): name one with --node"
    )
