"""Request validation of the ipam servicer (proto -> domain): every bad
field is an InvalidArgument naming it; and the ipam configuration."""

from __future__ import annotations

import pytest

from flagella.api.ipam.v1 import ipam_pb2 as pb
from flagella.common.config import load_config
from flagella.common.errors import ConfigError, InvalidArgument
from flagella.ipam.config import IpamConfig
from flagella.ipam.model import AddressType, Family
from flagella.ipam.servicer import (
    family_of,
    ip_of,
    node_name,
    owner_of,
    registration_of,
    seconds_of,
)


def field_of(call: object) -> str:
    with pytest.raises(InvalidArgument) as info:
        call()  # type: ignore[operator]
    assert info.value.field is not None
    return info.value.field


@pytest.mark.parametrize("name", ["n1", "node-1.example.com", "a" * 253, "0"])
def test_good_node_names(name: str) -> None:
    assert node_name(name, "node") == name


@pytest.mark.parametrize("name", ["", "N1", "-n", "n-", "a_b", "a/b", "a" * 254, "a..b"])
def test_bad_node_names(name: str) -> None:
    assert field_of(lambda: node_name(name, "node")) == "node"


@pytest.mark.parametrize(
    ("cid", "ifname", "field"),
    [
        ("", "eth0", "owner.container_id"),
        ("-x", "eth0", "owner.container_id"),
        ("a/b", "eth0", "owner.container_id"),
        ("x" * 257, "eth0", "owner.container_id"),
        ("abc", "", "owner.ifname"),
        ("abc", "x" * 16, "owner.ifname"),
        ("abc", ".", "owner.ifname"),
        ("abc", "..", "owner.ifname"),
        ("abc", "a b", "owner.ifname"),
        ("abc", "a:b", "owner.ifname"),
        ("abc", "a/b", "owner.ifname"),
    ],
)
def test_bad_owners_name_the_field(cid: str, ifname: str, field: str) -> None:
    assert field_of(lambda: owner_of(pb.Owner(container_id=cid, ifname=ifname), "owner")) == field


def test_good_owner() -> None:
    o = owner_of(pb.Owner(container_id="0af3_c.d-e", ifname="net1", pod="ns/p"), "owner")
    assert (o.container_id, o.ifname, o.pod, o.ident) == (
        "0af3_c.d-e",
        "net1",
        "ns/p",
        ("0af3_c.d-e", "net1"),
    )


def test_ips_families_durations() -> None:
    assert str(ip_of("fd00::1", "ip")) == "fd00::1"
    assert field_of(lambda: ip_of("10.0.0.256", "ip")) == "ip"
    assert field_of(lambda: ip_of("", "ip")) == "ip"
    assert family_of(pb.FAMILY_IPV6, "families[0]") is Family.IPV6
    assert field_of(lambda: family_of(0, "families[2]")) == "families[2]"
    d = pb.AllocateRequest().expiration
    d.seconds, d.nanos = 1, 500_000_000
    assert seconds_of(d, "expiration") == 1.5
    d.seconds, d.nanos = -1, 0
    assert field_of(lambda: seconds_of(d, "expiration")) == "expiration"


def test_registration_conversion_and_errors() -> None:
    req = pb.RegisterNodeRequest(
        name="n1",
        addresses=[pb.NodeAddress(type=pb.NodeAddress.TYPE_EXTERNAL_IP, ip="2001:db8::1")],
        datapath_address="[::1]:7000",
        pod_cidrs=["10.0.0.0/24"],
        labels={"k": "v"},
    )
    req.lease_ttl.FromMilliseconds(2500)
    reg = registration_of(req)
    assert reg.addresses[0].type is AddressType.EXTERNAL_IP
    assert reg.lease_ttl == 3  # etcd leases are whole seconds: rounded up
    assert [str(c) for c in reg.pod_cidrs] == ["10.0.0.0/24"]

    def with_(**kw: object) -> object:
        r = pb.RegisterNodeRequest(name="n1")
        for k, v in kw.items():
            if k == "lease_ttl":
                r.lease_ttl.seconds = v  # type: ignore[assignment]
            elif isinstance(v, list):
                getattr(r, k).extend(v)
            else:
                setattr(r, k, v)
        return lambda: registration_of(r)

    assert field_of(with_(pod_cidrs=["10.0.0.1/24"])) == "pod_cidrs[0]"
    assert field_of(with_(pod_cidrs=["10.0.0.0/24", "x"])) == "pod_cidrs[1]"
    assert field_of(with_(datapath_address="nohost")) == "datapath_address"
    assert field_of(with_(datapath_address="h:99999")) == "datapath_address"
    assert field_of(with_(lease_ttl=1)) == "lease_ttl"
    assert field_of(with_(lease_ttl=86_401)) == "lease_ttl"
    assert field_of(with_(addresses=[pb.NodeAddress(type=1, ip="x")])) == "addresses[0].ip"
    assert field_of(with_(addresses=[pb.NodeAddress(ip="10.0.0.1")])) == "addresses[0].type"
    assert field_of(with_(name="")) == "name"
    internal = pb.NodeAddress.TYPE_INTERNAL_IP
    twice = [pb.NodeAddress(type=internal, ip=ip) for ip in ("10.0.0.1", "fd00::1", "10.0.0.2")]
    assert field_of(with_(addresses=twice)) == "addresses[2].ip"
    # An external IP of the same family is another matter.
    external = pb.NodeAddress(type=pb.NodeAddress.TYPE_EXTERNAL_IP, ip="10.0.0.2")
    assert (
        len(
            registration_of(
                pb.RegisterNodeRequest(name="n", addresses=[*twice[:2], external])
            ).addresses
        )
        == 3
    )


def load(*argv: str) -> IpamConfig:
    return load_config(
        IpamConfig, prog="flagella-ipam", env_prefix="FLAGELLA_IPAM_", argv=argv, environ={}
    )


def test_config_defaults_and_errors() -> None:
    cfg = load()
    assert (cfg.mode, cfg.cluster_cidr, cfg.node_mask_size_v4) == (
        "cluster-pool",
        ("10.244.0.0/16",),
        24,
    )
    assert load("--cluster-cidr", "10.0.0.0/8,fd00::/104").cluster_cidr == (
        "10.0.0.0/8",
        "fd00::/104",
    )
    cases = [
        (["--cluster-cidr", "10.0.0.0/24", "--node-mask-size-v4", "16"], "--node-mask-size-v4"),
        (["--cluster-cidr", "10.0.0.0/8", "--node-mask-size-v4", "31"], "--node-mask-size-v4"),
        (["--cluster-cidr", "fd00::/120", "--node-mask-size-v6", "112"], "--node-mask-size-v6"),
        (["--node-lease-ttl", "1"], "--node-lease-ttl"),
        (["--expiry-check-interval", "0"], "--expiry-check-interval"),
        (["--mode", "kubernetes"], "--mode"),
        (["--cluster-cidr", "10.0.0.1/8"], "--cluster-cidr"),
        (["--cluster-cidr", "10.0.0.0/8,10.1.0.0/16"], "--cluster-cidr"),
        (["--cluster-cidr", "fd00::/104,10.0.0.0/16,fd00::/112"], "--cluster-cidr"),
    ]
    for argv, option in cases:
        with pytest.raises(ConfigError) as info:
            load(*argv)
        assert info.value.option == option, (argv, info.value)
    with pytest.raises(ConfigError, match=r"--cluster-cidr: 10.1.0.0/16 overlaps 10.0.0.0/8"):
        load("--cluster-cidr", "10.0.0.0/8,10.1.0.0/16")
    # host-scope ignores the cluster CIDRs
    assert load("--mode", "host-scope", "--cluster-cidr", "10.0.0.0/30").mode == "host-scope"


async def test_watch_nodes_messages_are_built_once_for_every_stream() -> None:
    """Every WatchNodes stream gets the same UPSERT message of a node at a
    revision (1,000 nodes joining each got every node's built anew); a new
    revision is a new message."""
    from flagella.common.sync import Change, MessageCache
    from flagella.ipam.model import Node, NodeAddress
    from flagella.ipam.servicer import NodeEvents, node_pb

    cache: MessageCache[tuple[str, int], pb.NodeEvent] = MessageCache()
    one, two = NodeEvents(cache), NodeEvents(cache)
    node = Node(
        name="n1",
        addresses=(NodeAddress(AddressType.INTERNAL_IP, "192.0.2.1"),),
        datapath_address="",
        pod_cidrs=(),
        labels={},
        lease_ttl=30,
        registered_at=1.0,
        id=3,
        revision=7,
    )
    first = await one.upsert(Change("n1", node, None, 7))
    assert await two.upsert(Change("n1", node, None, 7)) is first
    assert first.node == node_pb(node)
    assert first.revision == 7
    later = await two.upsert(Change("n1", node, None, 9))
    assert later is not first
    assert later.revision == 9
