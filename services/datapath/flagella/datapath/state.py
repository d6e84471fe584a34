"""Endpoint records of this node's datapath, on disk (as Cilium's endpoint
state folder), so a restarted datapath knows its endpoints before the control
plane says anything. One JSON file per endpoint, written atomically."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flagella.common.portnames import NamedPort


@dataclass
class EndpointRecord:
    endpoint_id: int
    container_id: str
    netns_path: str
    ifname: str
    host_ifname: str
    host_ifindex: int
    host_mac: str
    mac: str
    addresses: list[str]
    identity: int
    mtu: int
    pod_cidrs: list[str] = field(default_factory=list)
    # The pod's named ports (ingress rules naming a port resolve against them).
    named_ports: list[NamedPort] = field(default_factory=list)
    # Per-endpoint runtime options (flagella.common.runtimeconfig).
    options: dict[str, str] = field(default_factory=dict)


class StateDir:
    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def _path(self, endpoint_id: int) -> Path:
        return self.root / "endpoints" / f"{endpoint_id}.json"

    def save(self, record: EndpointRecord) -> None:
        path = self._path(record.endpoint_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(record), f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def remove(self, endpoint_id: int) -> None:
        self._path(endpoint_id).unlink(missing_ok=True)

    def load_all(self) -> list[EndpointRecord]:
        folder = self.root / "endpoints"
        records = []
        for path in sorted(folder.glob("*.json")) if folder.exists() else []:
            try:
                data = json.loads(path.read_text())
                data["named_ports"] = [NamedPort(**p) for p in data.get("named_ports", [])]
                records.append(EndpointRecord(**data))
            except (ValueError, TypeError):
                # A torn or foreign file: not ours to trust; drop it.
                path.unlink(missing_ok=True)
        return records


@dataclass(frozen=True)
class HostPolicyState:
    """What the host firewall enforces now (flagella.datapath.hostfw)."""

    present: bool = False
    revision: int = 0
    ingress_enforced: bool = False
    egress_enforced: bool = False
    entries: int = 0
    rules: tuple[str, ...] = ()
    node_labels: tuple[tuple[str, str], ...] = ()
    error: str = ""
    safety_entries: int = 0
