"""Kubernetes ipBlocks: CIDRs with host bits masked (with warnings naming
the field), and the flattened prefix entries of resolved policies (nested
blocks and excepts), only for Kubernetes NetworkPolicies and only in the
kubernetes ipBlock mode."""

from __future__ import annotations

import ipaddress
import random

import pytest
from policy_world import World

from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.common.errors import InvalidArgument
from flagella.policy.convert import rule_from_pb
from flagella.policy.prefixes import ALL_PORTS, PrefixEntry, flatten
from flagella.policy.rules import (
    Clause,
    Direction,
    PortKey,
    Protocol,
    Verdict,
    parse_document,
)

TCP, UDP = Protocol.TCP, Protocol.UDP
IN, OUT = Direction.INGRESS, Direction.EGRESS


def knp(spec: str, name: str = "np") -> str:
    return (
        "---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n"
        f"metadata: {{name: {name}, namespace: default}}\nspec:\n{spec}"
    )


def cnp(spec: str, name: str = "cnp") -> str:
    return (
        "---\napiVersion: cilium.io/v2\nkind: CiliumNetworkPolicy\n"
        f"metadata: {{name: {name}, namespace: default}}\nspec:\n{spec}"
    )


# --- host bits ---


def test_kubernetes_ipblock_with_host_bits_is_masked_with_a_warning() -> None:
    warnings: list[str] = []
    (rule,) = parse_document(
        knp(
            """  podSelector: {}
  egress:
  - to:
    - ipBlock: {cidr: 10.244.0.108/4, except: [10.244.0.108/24]}
    - ipBlock: {cidr: 192.0.2.0/24}
  ingress:
  - from:
    - ipBlock: {cidr: "fd00::1:5/64"}
"""
        ),
        warnings=warnings,
    )
    assert [(c.cidr, c.excepts) for c in rule.egress[0].cidrs] == [
        ("0.0.0.0/4", ("10.244.0.0/24",)),
        ("192.0.2.0/24", ()),
    ]
    assert rule.ingress[0].cidrs[0].cidr == "fd00::/64"
    assert warnings == [
        "spec.ingress[0].from[0].ipBlock.cidr: fd00::1:5/64 has host bits set; read as fd00::/64",
        "spec.egress[0].to[0].ipBlock.cidr: 10.244.0.108/4 has host bits set; read as 0.0.0.0/4",
        "spec.egress[0].to[0].ipBlock.except[0]: 10.244.0.108/24 has host bits set; "
        "read as 10.244.0.0/24",
    ]


def test_cilium_cidrs_with_host_bits_are_masked_with_a_warning() -> None:
    warnings: list[str] = []
    (rule,) = parse_document(
        cnp(
            """  endpointSelector: {}
  ingress:
  - fromCIDR: [10.0.0.1/8, 192.0.2.7]
    fromCIDRSet: [{cidr: 172.16.1.1/12, except: [172.16.5.5/24]}]
"""
        ),
        warnings=warnings,
    )
    assert [(c.cidr, c.excepts) for c in rule.ingress[0].cidrs] == [
        ("10.0.0.0/8", ()),
        ("192.0.2.7", ()),
        ("172.16.0.0/12", ("172.16.5.0/24",)),
    ]
    assert [w.split(":")[0] for w in warnings] == [
        "spec.ingress[0].fromCIDR[0]",
        "spec.ingress[0].fromCIDRSet[0].cidr",
        "spec.ingress[0].fromCIDRSet[0].except[0]",
    ]


def test_proto_rules_are_masked_with_proto_paths() -> None:
    cidr = pb.CIDRRule(cidr="10.1.2.3/16")
    getattr(cidr, "except").append("10.1.2.3/24")
    rule = pb.Rule(
        name="r", endpoint_selector=pb.EndpointSelector(), ingress=[pb.PeerRule(cidrs=[cidr])]
    )
    warnings: list[str] = []
    out = rule_from_pb(rule, "rules.rules[0]", warnings)
    assert out.ingress[0].cidrs[0].cidr == "10.1.0.0/16"
    assert out.ingress[0].cidrs[0].excepts == ("10.1.2.0/24",)
    assert [w.split(":")[0] for w in warnings] == [
        "rules.rules[0].ingress[0].cidrs[0].cidr",
        "rules.rules[0].ingress[0].cidrs[0].except[0]",
    ]


def test_unmasked_cidrs_give_no_warning() -> None:
    warnings: list[str] = []
    parse_document(
        knp("  podSelector: {}\n  ingress:\n  - from: [ipBlock: {cidr: 10.0.0.0/8}]\n"),
        warnings=warnings,
    )
    assert warnings == []


@pytest.mark.parametrize(
    ("cidr", "excepts", "field", "message"),
    [
        ("10.0.0.0/33", [], "spec.ingress[0].from[0].ipBlock.cidr", "not a valid CIDR"),
        ("10.0.0.x/8", [], "spec.ingress[0].from[0].ipBlock.cidr", "not a valid CIDR"),
        (
            "10.0.0.0/8",
            ["11.0.0.0/16"],
            "spec.ingress[0].from[0].ipBlock.except[0]",
            "is not inside 10.0.0.0/8",
        ),
        (
            "10.1.2.3/16",
            ["10.2.0.1/24"],
            "spec.ingress[0].from[0].ipBlock.except[0]",
            "is not inside 10.1.0.0/16",
        ),
    ],
)
def test_bad_ipblocks_name_the_field(
    cidr: str, excepts: list[str], field: str, message: str
) -> None:
    spec = f"  podSelector: {{}}\n  ingress:\n  - from: [ipBlock: {{cidr: {cidr}, except: {excepts}}}]\n"
    with pytest.raises(InvalidArgument) as exc:
        parse_document(knp(spec))
    assert exc.value.field == field
    assert message in str(exc.value)


# --- flattening ---


def _net(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(text)


def _clause(
    blocks: list[tuple[str, list[str]]], ports: tuple[PortKey, ...], name: str, d: Direction = IN
) -> Clause:
    return Clause(
        rule=name,
        direction=d,
        verdict=Verdict.ALLOW,
        selectors=(),
        ports=ports,
        blocks=tuple((_net(c), tuple(_net(e) for e in ex)) for c, ex in blocks),
    )


def _by_prefix(entries: tuple[PrefixEntry, ...]) -> dict[tuple[str, Direction], tuple]:
    return {(str(e.prefix), e.direction): (e.ports, e.derived_from) for e in entries}


def test_nested_blocks_and_excepts_are_flattened() -> None:
    # a: 10/8 except 10.1/16 on 80; b: 10.1/16 except 10.1.2/24 on 443;
    # c: 10.1.2.128/25 everything.
    entries = flatten(
        [
            _clause([("10.0.0.0/8", ["10.1.0.0/16"])], ((80, 0, TCP),), "a"),
            _clause([("10.1.0.0/16", ["10.1.2.0/24"])], ((443, 0, TCP),), "b"),
            _clause([("10.1.2.128/25", [])], (ALL_PORTS,), "c"),
            _clause([("10.0.0.0/8", [])], ((53, 0, UDP),), "d", OUT),
        ]
    )
    assert _by_prefix(entries) == {
        ("10.0.0.0/8", IN): (((80, 0, TCP),), ("a",)),
        ("10.1.0.0/16", IN): (((443, 0, TCP),), ("b",)),
        ("10.1.2.0/24", IN): ((), ()),  # b's except, a's except: nothing
        ("10.1.2.128/25", IN): ((ALL_PORTS,), ("c",)),
        ("10.0.0.0/8", OUT): (((53, 0, UDP),), ("d",)),
    }


def test_an_except_keeps_what_another_block_allows_there() -> None:
    entries = flatten(
        [
            _clause([("10.0.0.0/8", ["10.1.0.0/16"])], ((80, 0, TCP),), "a"),
            _clause([("10.0.0.0/8", [])], ((8080, 8090, TCP), (443, 0, TCP)), "b"),
        ]
    )
    assert _by_prefix(entries) == {
        ("10.0.0.0/8", IN): (((80, 0, TCP), (443, 0, TCP), (8080, 8090, TCP)), ("a", "b")),
        ("10.1.0.0/16", IN): (((443, 0, TCP), (8080, 8090, TCP)), ("b",)),
    }


def _lookup(entries: tuple[PrefixEntry, ...], addr: str, d: Direction) -> tuple:
    a = ipaddress.ip_address(addr)
    best: PrefixEntry | None = None
    for e in entries:
        inside = e.direction == d and a.version == e.prefix.version and a in e.prefix
        if inside and (best is None or e.prefix.prefixlen > best.prefix.prefixlen):
            best = e
    return best.ports if best is not None else ()


def _normalized(ports: set[PortKey]) -> tuple[PortKey, ...]:
    if ALL_PORTS in ports:
        return (ALL_PORTS,)
    return tuple(sorted(ports))


@pytest.mark.parametrize("seed", range(20))
def test_flattened_longest_match_is_exact_for_every_address(seed: int) -> None:
    """Random nested blocks with excepts over a small IPv4 space: the
    longest prefix matching each address allows exactly the union of the
    ports of the blocks that hold the address."""
    rnd = random.Random(seed)
    specs = []
    for i in range(rnd.randint(1, 6)):
        plen = rnd.randint(24, 29)
        net = ipaddress.ip_network(f"10.0.0.{rnd.randrange(0, 256)}/{plen}", strict=False)
        excepts = []
        for _ in range(rnd.randint(0, 3)):
            eplen = rnd.randint(plen, 32)
            sub = ipaddress.ip_network(
                f"{net.network_address + rnd.randrange(net.num_addresses)}/{eplen}", strict=False
            )
            excepts.append(str(sub))
        ports = rnd.choice([(ALL_PORTS,), ((80, 0, TCP),), ((53, 0, UDP), (80, 90, TCP))])
        specs.append((str(net), excepts, ports, f"r{i}"))
    entries = flatten(_clause([(c, ex)], ports, name) for c, ex, ports, name in specs)
    for host in range(256):
        addr = f"10.0.0.{host}"
        a = ipaddress.ip_address(addr)
        want: set[PortKey] = set()
        for c, ex, ports, _ in specs:
            if a in _net(c) and not any(a in _net(e) for e in ex):
                want.update(ports)
        assert _lookup(entries, addr, IN) == _normalized(want), addr


# --- resolution ---

KNP_IPBLOCK = knp(
    """  podSelector: {matchLabels: {app: web}}
  policyTypes: [Ingress, Egress]
  ingress:
  - from: [ipBlock: {cidr: 10.244.0.0/16, except: [10.244.1.0/24]}]
    ports: [{port: 80}]
  egress:
  - to: [ipBlock: {cidr: "fd00::/64"}]
"""
)


def _world() -> tuple[World, int]:
    w = World()
    web = w.pod("web", "default", app="web")
    w.pod("client", "default", app="client")
    return w, web


def test_kubernetes_policy_ipblocks_resolve_to_prefix_entries() -> None:
    w, web = _world()
    w.rules(KNP_IPBLOCK)
    content = w.content(web)
    assert _by_prefix(content.prefix_entries) == {
        ("10.244.0.0/16", IN): (((80, 0, TCP),), ("default/np",)),
        ("10.244.1.0/24", IN): ((), ()),
        ("fd00::/64", OUT): ((ALL_PORTS,), ("default/np",)),
    }
    # Its prefixes get no CIDR identities: the prefix entries match every
    # address of the block, outside ones too.
    assert w.state.ipcache_entry("10.244.0.0/16") is None
    assert w.state.ipcache_entry("10.244.1.0/24") is None


def test_strict_cidr_selectors_select_other_rules_cidr_identities_inside_the_block() -> None:
    """The identity path stays sound without the block's own identities: it
    selects a CIDR identity (of another rule's prefix) only when all of it
    is in the block, none of it in an except; the prefix entries do the
    rest."""
    w, web = _world()
    w.rules(
        cnp(
            """  endpointSelector: {matchLabels: {app: client}}
  egress:
  - toCIDR: [10.244.0.0/16, 10.244.5.0/24, 10.244.1.128/25, 10.245.0.0/16]
"""
        )
    )
    w.rules(KNP_IPBLOCK)
    ingress = {(e[0], e[1]) for e in w.entries(web) if e[4] == "INGRESS"}
    assert (w.cidr("10.244.5.0/24"), 80) in ingress
    assert (w.cidr("10.244.0.0/16"), 80) not in ingress  # holds the except
    assert (w.cidr("10.244.1.128/25"), 80) not in ingress  # in the except
    assert (w.cidr("10.245.0.0/16"), 80) not in ingress  # outside
    assert (2, 80) not in ingress  # never world


def test_cilium_policies_keep_ciliums_semantics() -> None:
    w, web = _world()
    w.rules(
        cnp(
            """  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromCIDRSet: [{cidr: 10.244.0.0/16, except: [10.244.1.0/24]}]
"""
        )
    )
    assert w.content(web).prefix_entries == ()


def test_cilium_mode_gives_kubernetes_policies_ciliums_semantics() -> None:
    w, web = _world()
    w.state.k8s_ipblocks = False
    w.rules(KNP_IPBLOCK)
    content = w.content(web)
    assert content.prefix_entries == ()
    assert content.ingress_enforced
    assert content.egress_enforced
    # Cilium's semantics: the prefixes are CIDR identities, selected as such.
    assert (w.cidr("10.244.0.0/16"), 80, 0, "TCP", "INGRESS", "ALLOW") in w.entries(web)
    assert w.cidr("10.244.1.0/24")


def test_prefix_entries_count_against_the_budget() -> None:
    w = World(budget=3)
    web = w.pod("web", "default", app="web")
    w.rules(KNP_IPBLOCK)
    content = w.content(web)
    assert "budget" in content.error
    assert content.entries == ()
    assert content.prefix_entries == ()
