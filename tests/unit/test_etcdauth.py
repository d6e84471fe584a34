"""The etcd roles table against the code: every prefix a service's store
writes is in its role, and docs/SECURITY.md prints the table."""

from __future__ import annotations

import ast
from pathlib import Path

from flagella.common import etcdauth
from flagella.common.etcdauth import Perm
from flagella.endpoint import store as endpoint_store
from flagella.ipam import store as ipam_store
from flagella.lb import store as lb_store
from flagella.policy import keys as policy_keys

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "SECURITY.md"

# What each service's store writes, from the stores themselves.
WRITTEN = {
    "ipam": [ipam_store.PREFIX],
    "endpoint": [endpoint_store.PREFIX],
    "lb": [lb_store.PREFIX],
    "policy": [*policy_keys.MIRRORED_PREFIXES, policy_keys.CONFIG_PREFIX],
}


def covered(service: str, prefix: str, perm: Perm) -> bool:
    return any(
        g.perm in (perm, Perm.READWRITE) and not g.exact and not g.end and prefix.startswith(g.key)
        for g in etcdauth.ROLES[service]
    )


def test_every_prefix_a_store_writes_is_in_its_role_and_no_one_elses() -> None:
    assert set(WRITTEN) == set(etcdauth.ROLES) == set(etcdauth.SERVICES)
    for service, prefixes in WRITTEN.items():
        for prefix in prefixes:
            assert covered(service, prefix, Perm.READWRITE), (service, prefix)
            for other in set(WRITTEN) - {service}:
                assert not covered(other, prefix, Perm.READ), (other, prefix)


def test_the_policy_mirror_range_spans_its_prefixes_only() -> None:
    [span] = [g for g in etcdauth.ROLES["policy"] if g.end]
    first, *_, last = sorted(policy_keys.MIRRORED_PREFIXES)
    assert span.key == first
    assert span.range_end() == b"flagella/state/ip/v10"
    assert last == policy_keys.IP_PREFIX
    for service in ("ipam", "endpoint", "lb"):
        [own] = [g.key for g in etcdauth.ROLES[service] if g.perm is Perm.READWRITE]
        assert not span.key <= own < span.end, service


def test_the_datapath_never_imports_the_etcd_client() -> None:
    for path in (ROOT / "services" / "datapath" / "flagella" / "datapath").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any(n.startswith(("flagella.common.etcd", "aetcd")) for n in names), path


def test_security_md_prints_the_roles_table_from_the_code() -> None:
    assert etcdauth.table() in DOCS.read_text(), "run python -m flagella.common.etcdauth"
