"""A peer's address option: one address or its replicas', as the gRPC
target and TLS name a channel is made with; the service config that fails
over and retries only reads."""

from __future__ import annotations

import json

import pytest

from flagella.common.addresses import Target, host_ports, parse_addresses, service_config, target
from flagella.common.config import load_config
from flagella.common.errors import ConfigError
from flagella.datapath.config import DatapathConfig
from flagella.endpoint.config import EndpointConfig


def test_targets_of_one_address_and_of_replicas() -> None:
    assert target("127.0.0.1:50051", "ipam") == Target("127.0.0.1:50051")
    assert target("dns:///ipam.flagella:50051", "ipam") == Target("dns:///ipam.flagella:50051")
    assert target("unix:/run/a.sock") == Target("unix:/run/a.sock", "localhost")
    # Replicas by IP: verified against the service's name, as certgen issues it.
    assert target("10.0.0.1:50051, 10.0.0.2:50051", "ipam") == Target(
        "ipv4:10.0.0.1:50051,10.0.0.2:50051", "ipam"
    )
    assert target("[fd00::1]:1,[fd00::2]:1", "lb") == Target("ipv6:[fd00::1]:1,[fd00::2]:1", "lb")
    assert target("unix:/a.sock,unix:/b.sock") == Target("unix:/a.sock,/b.sock", "localhost")
    assert target("ipv4:10.0.0.1:1,10.0.0.2:1", "policy").tls_name == "policy"
    for bad in ("", "10.0.0.1:1,[fd00::1]:1", "a.example:1,b.example:1", "unix:/a,10.0.0.1:1"):
        with pytest.raises(ValueError, match="address"):
            target(bad, "ipam")


def test_address_options_take_lists_and_name_the_option_when_bad() -> None:
    def endpoint(*argv: str) -> EndpointConfig:
        return load_config(
            EndpointConfig, prog="e", env_prefix="FLAGELLA_ENDPOINT_", argv=argv, environ={}
        )

    cfg = endpoint("--ipam-address", "127.0.0.1:1, 127.0.0.1:2")
    assert cfg.ipam_address == "127.0.0.1:1,127.0.0.1:2"
    env = {"FLAGELLA_DATAPATH_LB_ADDRESS": "unix:/a.sock,unix:/b.sock"}
    dp = load_config(
        DatapathConfig, prog="d", env_prefix="FLAGELLA_DATAPATH_", argv=[], environ=env
    )
    assert dp.lb_address == "unix:/a.sock,unix:/b.sock"
    assert dp.ipam_address == ""  # empty: the feature is off
    for flag, value in (
        ("--policy-address", "a.example:1,b.example:1"),
        ("--ipam-address", "127.0.0.1:99999"),
        ("--policy-address", "127.0.0.1"),
        ("--ipam-address", "unix:,unix:/a.sock"),
    ):
        with pytest.raises(ConfigError) as err:
            endpoint(flag, value)
        assert err.value.option == flag
    assert parse_addresses(" 127.0.0.1:1 ,") == "127.0.0.1:1"


def test_the_service_config_fails_over_and_retries_reads_only() -> None:
    config = json.loads(service_config())
    assert config["loadBalancingConfig"] == [{"pick_first": {"shuffleAddressList": True}}]
    [method] = config["methodConfig"]
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    names = {(n["service"].rsplit(".", 1)[1], n["method"]) for n in method["name"]}
    for read in (
        ("IpamService", "WatchNodes"),
        ("IpamService", "GetNode"),
        ("PolicyService", "WatchPolicy"),
        ("LoadBalancerService", "ListServices"),
        ("EndpointService", "GetEndpoint"),
        ("DatapathService", "WaitForPolicy"),
    ):
        assert read in names
    writes = {"Allocate", "AllocateIdentity", "Cni", "PutRules", "UpsertService", "RegisterNode"}
    assert not writes & {m for _, m in names}


def test_every_replica_is_in_the_host_firewalls_safety_set() -> None:
    from flagella.datapath.bpf import layout as L
    from flagella.datapath.bpf.tables import SafeEntry
    from flagella.datapath.hostfw import safety_entries

    assert host_ports("dns:///ipam.example:50051") == [("ipam.example", 50051)]
    assert host_ports("ipv6:[fd00::1]:1,[fd00::2]:1") == [("fd00::1", 1), ("fd00::2", 1)]
    assert host_ports("unix:/a.sock,unix:/b.sock") == []
    env = {
        "FLAGELLA_DATAPATH_LB_ADDRESS": "10.0.0.4:50054,10.0.0.5:50054",
        "FLAGELLA_DATAPATH_IPAM_ADDRESS": "dns:///ipam.example:50051",
        "FLAGELLA_DATAPATH_ETCD_ENDPOINTS": "10.0.0.2:2379",
        "FLAGELLA_DATAPATH_LISTEN": "unix:/run/dp.sock",
        "FLAGELLA_DATAPATH_HEALTH_PORT": "0",
    }
    cfg = load_config(
        DatapathConfig, prog="d", env_prefix="FLAGELLA_DATAPATH_", argv=[], environ=env
    )
    resolved = {"ipam.example": ["10.0.0.8", "10.0.0.9"]}
    assert safety_entries(cfg, lambda host: resolved.get(host, [host])) == {
        SafeEntry(L.SAFE_REMOTE, port, L.PROTO_TCP, ip)
        for ip, port in (
            ("10.0.0.2", 2379),
            ("10.0.0.4", 50054),
            ("10.0.0.5", 50054),
            ("10.0.0.8", 50051),
            ("10.0.0.9", 50051),
        )
    }
