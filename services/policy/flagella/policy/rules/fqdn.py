"""toFQDNs selectors (matchName, matchPattern) as Cilium defines them:
names are compared lowercase and without the root's trailing dot; in a
pattern `*` stands for any run of the characters a DNS label may hold (so
`*.example.test` covers `a.example.test`, not `a.b.example.test` nor
`example.test`), and a pattern that is `*` alone matches every name."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from flagella.common.fqdn import canonical_name
from flagella.policy.rules.fields import Doc
from flagella.policy.rules.model import FQDNSelector, PortSpec, Protocol
from flagella.policy.rules.validate import fail

MAX_NAME_LEN = 253
_NAME_RE = re.compile(r"^[-a-z0-9_]+(\.[-a-z0-9_]+)*$")
_PATTERN_RE = re.compile(r"^[-a-z0-9_*]+(\.[-a-z0-9_*]+)*$")


def _check(value: str, path: str, form: re.Pattern[str], what: str) -> str:
    text = canonical_name(value)
    if not text:
        raise fail(path, "required")
    if len(text) > MAX_NAME_LEN:
        raise fail(path, f"longer than {MAX_NAME_LEN} characters")
    if not form.match(text) or any(len(label) > 63 for label in text.split(".")):
        raise fail(path, f"{value!r} is not {what}")
    return text


def check_name(value: str, path: str) -> str:
    """A matchName (or a name looked up): canonical, or InvalidArgument."""
    return _check(
        value, path, _NAME_RE, "a DNS name (labels of up to 63 letters, digits, '-' or '_')"
    )


def check_pattern(value: str, path: str) -> str:
    """A matchPattern: canonical, or InvalidArgument."""
    return _check(
        value,
        path,
        _PATTERN_RE,
        "a name pattern (DNS labels whose characters are letters, digits, '-', '_' or '*')",
    )


def check_selector(name: str, pattern: str, path: str) -> FQDNSelector:
    """Exactly one of matchName and matchPattern, each checked."""
    if bool(name) == bool(pattern):
        raise fail(path, "give exactly one of matchName and matchPattern")
    if name:
        return FQDNSelector(match_name=check_name(name, f"{path}.matchName"))
    return FQDNSelector(match_pattern=check_pattern(pattern, f"{path}.matchPattern"))


def parse_selectors(value: Any, path: str) -> tuple[FQDNSelector, ...]:
    """toFQDNs of a policy document."""
    out: list[FQDNSelector] = []
    for i, raw in enumerate(Doc.seq(value, path)):
        p = f"{path}[{i}]"
        obj: Mapping[str, Any] = Doc.mapping(raw, p)
        Doc.only(obj, p, ("matchName", "matchPattern"))
        out.append(
            check_selector(
                Doc.string(obj.get("matchName") or "", f"{p}.matchName"),
                Doc.string(obj.get("matchPattern") or "", f"{p}.matchPattern"),
                p,
            )
        )
    return tuple(dict.fromkeys(out))


DNS_PORT = 53
DNS_PORT_ONLY = "DNS rules need the clause's ports to include port 53 (UDP or TCP)"
DNS_EGRESS_ONLY = "L7 rules are not supported here: DNS rules only in egress allow rules"


def has_dns_port(ports: tuple[PortSpec, ...]) -> bool:
    """Whether a toPorts entry names port 53 (alone or in a range) over
    UDP, TCP or any protocol: where DNS rules apply, as Cilium."""
    return any(
        p.port
        and p.port <= DNS_PORT <= max(p.port, p.end_port)
        and p.protocol in (Protocol.ANY, Protocol.UDP, Protocol.TCP)
        for p in ports
    )


def parse_dns_rules(value: Any, path: str) -> tuple[FQDNSelector, ...]:
    """A toPorts entry's `rules`: only `dns` (matchName / matchPattern)."""
    obj: Mapping[str, Any] = Doc.mapping(value, path)
    Doc.only(
        obj,
        path,
        ("dns",),
        http="HTTP rules are not supported",
        kafka="Kafka rules are not supported",
        l7proto="L7 protocols other than DNS are not supported",
        l7="L7 protocols other than DNS are not supported",
    )
    return parse_selectors(obj.get("dns"), f"{path}.dns")
