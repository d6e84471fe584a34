"""toFQDNs selectors (matchName, matchPattern) as Cilium defines them:
names are compared lowercase and without the root's trailing dot; in a
pattern `*` stands for any run of the characters a DNS label may hold (so
`*.example.test` covers `a.example.test`, not `a.b.example.test` nor
`example.test`), and a pattern that is `*` alone matches every name."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

from flagella.policy.rules.fields import Doc
from flagella.policy.rules.model import FQDNSelector
from flagella.policy.rules.validate import fail

MAX_NAME_LEN = 253
_NAME_RE = re.compile(r"^[-a-z0-9_]+(\.[-a-z0-9_]+)*$")
_PATTERN_RE = re.compile(r"^[-a-z0-9_*]+(\.[-a-z0-9_*]+)*$")
_LABEL_CHARS = "[-a-z0-9_]"


def canonical_name(name: str) -> str:
    """A DNS name as compared: lowercase, without the trailing dot."""
    return name.lower().removesuffix(".")


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


@functools.lru_cache(maxsize=4096)
def matcher(key: str) -> Callable[[str], bool]:
    """Whether a canonical name matches a selector's key (FQDNSelector.key)."""
    if key == "*":
        return bool
    if "*" not in key:
        return key.__eq__
    regex = re.compile(
        "".join(f"{_LABEL_CHARS}*" if c == "*" else re.escape(c) for c in key) + r"\Z"
    )
    return lambda name: regex.match(name) is not None
