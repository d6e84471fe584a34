"""The endpoint as the endpoint service keeps it: one per CNI attachment
(container id, ifname), persisted in etcd as JSON, with its state machine and
a log of transitions (as Cilium's endpoint states)."""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field
from typing import Any

from flagella.common.portnames import NamedPort

# Transitions kept per endpoint for GetEndpointLog.
LOG_LIMIT = 64


class State(enum.Enum):
    WAITING_FOR_IDENTITY = "waiting-for-identity"
    REGENERATING = "regenerating"
    READY = "ready"
    DISCONNECTING = "disconnecting"
    DISCONNECTED = "disconnected"
    NOT_READY = "not-ready"
    RESTORING = "restoring"


# Which transitions the state machine allows (Cilium's, plus restore).
ALLOWED: dict[State, frozenset[State]] = {
    State.WAITING_FOR_IDENTITY: frozenset(
        {State.REGENERATING, State.DISCONNECTING, State.NOT_READY}
    ),
    State.REGENERATING: frozenset(
        {State.READY, State.WAITING_FOR_IDENTITY, State.DISCONNECTING, State.NOT_READY}
    ),
    State.READY: frozenset(
        {State.REGENERATING, State.WAITING_FOR_IDENTITY, State.DISCONNECTING, State.NOT_READY}
    ),
    State.NOT_READY: frozenset(
        {State.REGENERATING, State.WAITING_FOR_IDENTITY, State.DISCONNECTING, State.READY}
    ),
    State.RESTORING: frozenset(
        {State.REGENERATING, State.READY, State.DISCONNECTING, State.NOT_READY}
    ),
    State.DISCONNECTING: frozenset({State.DISCONNECTED}),
    State.DISCONNECTED: frozenset(),
}


class InvalidTransition(Exception):
    pass


@dataclass
class LogEntry:
    time: float
    from_state: str
    to_state: str
    reason: str


@dataclass
class Endpoint:
    id: int
    container_id: str
    ifname: str
    netns_path: str
    node: str
    pod_name: str = ""
    pod_namespace: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    # The labels were read from Kubernetes at ADD (its Pod and Namespace),
    # and follow them there while the endpoint lives (flagella.endpoint.kube).
    labels_from_kubernetes: bool = False
    identity: int = 0
    # The pod's named container ports (from its Pod spec when the labels
    # come from Kubernetes, and following it; from the CNI arguments
    # otherwise), sorted.
    named_ports: list[NamedPort] = field(default_factory=list)
    # CIDR notation (host routes: /32, /128).
    addresses: list[str] = field(default_factory=list)
    host_ifname: str = ""
    mac: str = ""
    mtu: int = 1500
    state: State = State.WAITING_FOR_IDENTITY
    policy_revision: int = 0
    # The CNI result returned by ADD, replayed for a repeated ADD.
    result: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    log: list[LogEntry] = field(default_factory=list)
    # Steps done so far, so a crash mid-create can be rolled back exactly.
    steps: list[str] = field(default_factory=list)
    # Per-endpoint runtime options (PatchEndpointConfig), given to its datapath.
    options: dict[str, str] = field(default_factory=dict)
    # Labels added through PatchEndpointLabels ("source:key" -> value), in
    # the identity; pod labels disabled for identity ("k8s:key"), shown.
    custom_labels: dict[str, str] = field(default_factory=dict)
    disabled_labels: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str]:
        return (self.container_id, self.ifname)

    def transition(self, to: State, reason: str) -> None:
        if to is not self.state and to not in ALLOWED[self.state]:
            raise InvalidTransition(f"{self.state.value} -> {to.value}")
        self.log.append(LogEntry(time.time(), self.state.value, to.value, reason))
        del self.log[:-LOG_LIMIT]
        self.state = to
        self.updated_at = time.time()

    def to_json(self) -> bytes:
        # What asdict() gives, without its deep copies: json only reads.
        data = dict(vars(self))
        data["state"] = self.state.value
        data["log"] = [vars(e) for e in self.log]
        data["named_ports"] = [
            {"name": p.name, "port": p.port, "protocol": p.protocol} for p in self.named_ports
        ]
        return json.dumps(data, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Endpoint:
        data = json.loads(raw)
        data["state"] = State(data["state"])
        data["log"] = [LogEntry(**e) for e in data.get("log", [])]
        data["named_ports"] = [NamedPort(**p) for p in data.get("named_ports", [])]
        return cls(**data)
