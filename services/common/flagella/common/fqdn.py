"""DNS names and toFQDNs / rules.dns patterns as Cilium compares them:
lowercase, without the root's trailing dot; in a pattern `*` is any run of
the characters a DNS label may hold (so `*.example.test` covers
`a.example.test`, not `a.b.example.test` nor `example.test`), and `*` alone
is every name. Shared by the policy service (selectors) and the datapath's
DNS proxy (which names a pod may look up)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

LABEL_CHARS = "[-a-z0-9_]"


def canonical_name(name: str) -> str:
    """A DNS name as compared: lowercase, without the trailing dot."""
    return name.lower().removesuffix(".")


@functools.lru_cache(maxsize=4096)
def matcher(key: str) -> Callable[[str], bool]:
    """Whether a canonical name matches a name or pattern (FQDNSelector.key)."""
    if key == "*":
        return bool
    if "*" not in key:
        return key.__eq__
    regex = re.compile(
        "".join(f"{LABEL_CHARS}*" if c == "*" else re.escape(c) for c in key) + r"\Z"
    )
    return lambda name: regex.match(name) is not None
