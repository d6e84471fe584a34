"""Least-privilege etcd: one etcd user per service, whose role reaches only
the key ranges that service reads and writes.

etcd runs with TLS and --client-cert-auth: it takes the user from the client
certificate's common name (`flagella-<service>`), so no password exists to
leak. The certificates come from their own CA (`flagella certs etcd-ca`): were
it the cluster CA, any node certificate whose CN happened to be a user's name
would be that user in etcd.

`ROLES` is the one table; `apply()` makes etcd match it (idempotent) and
turns authentication on; `python -m flagella.common.etcdauth` prints the
table docs/SECURITY.md shows.
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass
from typing import Any

import aetcd.rpc as etcd_rpc
import grpc

from flagella.common.errors import Unavailable
from flagella.common.etcd import REVISION_KEY, Etcd, prefix_end

ROOT = "root"
#: The services that keep state in etcd. The datapath never connects to it.
SERVICES = ("ipam", "policy", "endpoint", "lb")


class Perm(enum.Enum):
    READ = etcd_rpc.Permission.READ
    WRITE = etcd_rpc.Permission.WRITE
    READWRITE = etcd_rpc.Permission.READWRITE


@dataclass(frozen=True)
class Grant:
    """perm on every key starting with key (a prefix), on [key, end) when
    end is given, or on key alone when exact."""

    key: str
    perm: Perm
    why: str
    end: str = ""
    exact: bool = False

    def range_end(self) -> bytes:
        if self.exact:
            return b""
        return self.end.encode() if self.end else prefix_end(self.key)

    def describe(self) -> str:
        if self.exact:
            where = f"the key `{self.key}`"
        elif self.end:
            where = f"[`{self.key}`, `{self.end}`)"
        else:
            where = f"`{self.key}*`"
        return f"{self.perm.name.lower()} {where}"


def user_of(service: str) -> str:
    """The etcd user (and client certificate CN) of a service."""
    return f"flagella-{service}"


# The policy mirror reads its prefixes in one transaction and watches them
# as one key range from its CIDR groups and rules to the end of the ipcache;
# nothing of another service's lies in between (ipam, endpoint and lb sort
# before).
_POLICY_SPAN = Grant(
    "flagella/policy/v1/cidrgroups/",
    Perm.READ,
    "the mirror watches CIDR groups, rules, the FQDN cache, identities and ipcache as one range",
    end=prefix_end("flagella/state/ip/v1/").decode(),
)
# Every user reads this one never-written key: a linearizable "what is the
# revision now" (flagella.common.etcd.REVISION_KEY).
_REVISION = Grant(REVISION_KEY, Perm.READ, "reading the current revision", exact=True)

ROLES: dict[str, tuple[Grant, ...]] = {
    "ipam": (
        Grant("flagella/ipam/v1/", Perm.READWRITE, "nodes, blocks, pool, owners"),
        _REVISION,
    ),
    "policy": (
        Grant("flagella/policy/v1/", Perm.READWRITE, "CIDR groups, rules"),
        Grant("flagella/state/identities/v1/", Perm.READWRITE, "identities, references"),
        Grant("flagella/state/ip/v1/", Perm.READWRITE, "ipcache"),
        Grant("flagella/state/fqdn/v1/", Perm.READWRITE, "the FQDN cache"),
        _POLICY_SPAN,
        _REVISION,
    ),
    "endpoint": (
        Grant("flagella/endpoint/v1/", Perm.READWRITE, "endpoints, ids"),
        _REVISION,
    ),
    "lb": (
        Grant(
            "flagella/lb/v1/",
            Perm.READWRITE,
            "services, frontends, ids, hash seed, local redirect policies, LB-IPAM, "
            "BGP peering policies (bgp/)",
        ),
        _REVISION,
    ),
}


#: No role grants this key: read as a service's user, it is refused exactly
#: when etcd enforces authentication (root may read it).
PROBE_KEY = "flagella/etcd-auth/probe"


class EtcdAuthError(Exception):
    """etcd refused to be set up (one line)."""


async def _auth(etcd: Etcd, method: str, request: Any) -> Any:
    client = etcd.client
    await etcd._call(client.connect)
    stub = etcd_rpc.AuthStub(client.channel)
    try:
        return await getattr(stub, method)(request, timeout=etcd.timeout)
    except grpc.aio.AioRpcError as exc:
        raise EtcdAuthError(f"etcd {method}: {exc.code().name} {exc.details()}") from exc


async def _ensure(etcd: Etcd, method: str, request: Any, exists: str) -> None:
    """An Add call that tolerates "already exists"."""
    try:
        await _auth(etcd, method, request)
    except EtcdAuthError as exc:
        if exists not in str(exc):
            raise


async def apply(etcd: Etcd) -> list[str]:
    """Make etcd's users and roles match ROLES and enable authentication.
    Run as root (a client certificate with CN `root`) or against an etcd
    whose auth is still off. Idempotent: a grant no longer in the table is
    revoked. Returns what it did, one line each."""
    done: list[str] = []
    no_password = etcd_rpc.UserAddOptions(no_password=True)
    await _ensure(
        etcd, "UserAdd", etcd_rpc.AuthUserAddRequest(name=ROOT, options=no_password), "exists"
    )
    await _ensure(etcd, "RoleAdd", etcd_rpc.AuthRoleAddRequest(name=ROOT), "exists")
    await _auth(etcd, "UserGrantRole", etcd_rpc.AuthUserGrantRoleRequest(user=ROOT, role=ROOT))
    for service, grants in ROLES.items():
        user = role = user_of(service)
        await _ensure(
            etcd, "UserAdd", etcd_rpc.AuthUserAddRequest(name=user, options=no_password), "exists"
        )
        await _ensure(etcd, "RoleAdd", etcd_rpc.AuthRoleAddRequest(name=role), "exists")
        have = await _auth(etcd, "RoleGet", etcd_rpc.AuthRoleGetRequest(role=role))
        wanted = {(g.key.encode(), g.range_end(), g.perm.value) for g in grants}
        for p in have.perm:
            if (p.key, p.range_end, p.permType) not in wanted:
                await _auth(
                    etcd,
                    "RoleRevokePermission",
                    etcd_rpc.AuthRoleRevokePermissionRequest(
                        role=role, key=p.key, range_end=p.range_end
                    ),
                )
                done.append(f"{role}: revoked {p.key!r}..{p.range_end!r}")
        for g in grants:
            perm = etcd_rpc.Permission(
                permType=g.perm.value, key=g.key.encode(), range_end=g.range_end()
            )
            await _auth(
                etcd,
                "RoleGrantPermission",
                etcd_rpc.AuthRoleGrantPermissionRequest(name=role, perm=perm),
            )
        await _auth(etcd, "UserGrantRole", etcd_rpc.AuthUserGrantRoleRequest(user=user, role=role))
        done.append(f"user {user}: role {role}: {'; '.join(g.describe() for g in grants)}")
    await _auth(etcd, "AuthEnable", etcd_rpc.AuthEnableRequest())
    done.append("authentication enabled")
    return done


async def enabled(etcd: Etcd) -> bool:
    try:
        status = await _auth(etcd, "AuthStatus", etcd_rpc.AuthStatusRequest())
    except EtcdAuthError as exc:
        raise Unavailable(str(exc)) from exc
    return bool(status.enabled)


async def enforced(etcd: Etcd) -> bool:
    """Whether etcd enforces its users' roles, asked as a service's user by
    reading PROBE_KEY (a user's AuthStatus call may itself be refused).
    Unavailable when etcd cannot be asked."""
    try:
        await etcd.get(PROBE_KEY)
    except Unavailable as exc:
        if "PERMISSION_DENIED" in exc.message:
            return True
        raise
    return False


def table() -> str:
    """ROLES as the Markdown table of docs/SECURITY.md."""
    lines = ["| service | etcd user | may | because |", "|---|---|---|---|"]
    for service, grants in ROLES.items():
        for g in grants:
            lines.append(f"| {service} | `{user_of(service)}` | {g.describe()} | {g.why} |")
    lines.append("| datapath | none | nothing: it never connects to etcd | |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(table() + "\n")
