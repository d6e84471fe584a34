"""The datapath's host firewall options: --node-labels and the safety set
computed from the control-plane addresses it is configured with."""

from __future__ import annotations

import pytest

from flagella.common.config import load_config
from flagella.common.errors import ConfigError
from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf.tables import SafeEntry
from flagella.datapath.config import DatapathConfig
from flagella.datapath.hostfw import safety_entries


def config(*argv: str) -> DatapathConfig:
    return load_config(
        DatapathConfig, prog="datapath", env_prefix="FLAGELLA_DATAPATH_", argv=argv, environ={}
    )


def fake_resolve(host: str) -> list[str]:
    if host == "etcd.example":
        raise OSError("no such host")
    return {"policy.example": ["10.0.0.7", "fd00::7"]}.get(host, [host])


def test_node_labels_are_kubernetes_labels() -> None:
    cfg = config("--node-labels", "role=edge,topology.kubernetes.io/zone=a,empty=")
    assert cfg.labels == {"role": "edge", "topology.kubernetes.io/zone": "a", "empty": ""}
    for bad in ("role", "-x=1", "a=b c", "a=" + "v" * 64):
        with pytest.raises(ConfigError) as err:
            config(f"--node-labels={bad}")
        assert err.value.option == "--node-labels"


def test_the_safety_set_is_the_configured_control_plane() -> None:
    cfg = config(
        "--etcd-endpoints",
        "10.0.0.2:2379,etcd.example:2379",
        "--policy-address",
        "policy.example:50052",
        "--ipam-address",
        "10.0.0.3:50051",
        "--endpoint-address",
        "unix:/run/endpoint.sock",
        "--listen",
        "0.0.0.0:50055",
        "--health-port",
        "4240",
    )
    assert safety_entries(cfg, fake_resolve) == {
        SafeEntry(L.SAFE_REMOTE, 2379, L.PROTO_TCP, "10.0.0.2"),
        SafeEntry(L.SAFE_REMOTE, 50052, L.PROTO_TCP, "10.0.0.7"),
        SafeEntry(L.SAFE_REMOTE, 50052, L.PROTO_TCP, "fd00::7"),
        SafeEntry(L.SAFE_REMOTE, 50051, L.PROTO_TCP, "10.0.0.3"),
        SafeEntry(L.SAFE_LOCAL_PORT, 50055),
        SafeEntry(L.SAFE_LOCAL_PORT, 4240),
        SafeEntry(L.SAFE_ANY_PORT, 4240),
    }
    off = config("--host-policy-safety", "off", "--policy-address", "10.0.0.7:50052")
    assert safety_entries(off, fake_resolve) == set()
    with pytest.raises(ConfigError):
        config("--host-policy-safety", "maybe")
