"""Labels as Cilium writes them (``source:key=value``), label sets, their
canonical string (the etcd key of an identity) and the identity label filter.

No gRPC here: the servicer converts proto labels into these.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Sources a label may carry. "any" is for selectors only (matches every
# source); it never appears on an identity.
SOURCE_K8S = "k8s"
SOURCE_RESERVED = "reserved"
SOURCE_CIDR = "cidr"
# fqdn:<name or pattern>: an address a toFQDNs selector selects (as Cilium).
SOURCE_FQDN = "fqdn"
SOURCE_CONTAINER = "container"
SOURCE_UNSPEC = "unspec"
SOURCE_ANY = "any"
DEFAULT_SOURCE = SOURCE_K8S

# The namespace label Kubernetes pods carry (as Cilium names it), and the
# prefix under which a pod's namespace's labels are copied onto it.
NAMESPACE_KEY = "io.kubernetes.pod.namespace"
NAMESPACE_LABELS_PREFIX = "io.cilium.k8s.namespace.labels."

_SOURCE_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$")
# Keys: a Kubernetes qualified name (optionally prefix/name), plus ':' for
# IPv6 CIDR labels. No '=', ';', whitespace or control characters.
_KEY_RE = re.compile(r"^[A-Za-z0-9:]([A-Za-z0-9._/:-]{0,315}[A-Za-z0-9])?$")
_VALUE_FORBIDDEN = re.compile(r"[;\s\x00-\x1f\x7f]")
MAX_VALUE_LEN = 255


class LabelError(ValueError):
    """A malformed label; the message says what is wrong."""


@dataclass(frozen=True, slots=True, order=True)
class Label:
    """One label. Ordered by (key, source, value) like Cilium's sorted list."""

    key: str
    source: str = DEFAULT_SOURCE
    value: str = ""

    def __str__(self) -> str:
        """As Cilium writes it: ``source:key=value``, ``source:key`` when the
        value is empty."""
        if self.value:
            return f"{self.source}:{self.key}={self.value}"
        return f"{self.source}:{self.key}"

    @classmethod
    def make(cls, source: str, key: str, value: str = "") -> Label:
        """A validated label; an empty source means k8s."""
        source = source or DEFAULT_SOURCE
        if not _SOURCE_RE.match(source):
            raise LabelError(f"invalid label source {source!r}")
        if source == SOURCE_ANY:
            raise LabelError('source "any" is only valid in selectors')
        check_key(key)
        check_value(value)
        return cls(key=key, source=source, value=value)

    @classmethod
    def parse(cls, text: str) -> Label:
        """``source:key=value``, ``key=value`` (k8s) or ``source:key``."""
        source, key, value = split_label(text)
        return cls.make(source, key, value)


@functools.lru_cache(maxsize=8192)
def check_key(key: str) -> None:
    if not key:
        raise LabelError("empty label key")
    if not _KEY_RE.match(key):
        raise LabelError(f"invalid label key {key!r}")


@functools.lru_cache(maxsize=8192)
def check_value(value: str) -> None:
    if len(value) > MAX_VALUE_LEN:
        raise LabelError(f"label value longer than {MAX_VALUE_LEN} characters")
    if _VALUE_FORBIDDEN.search(value):
        raise LabelError(f"invalid label value {value!r}")


def split_label(text: str) -> tuple[str, str, str]:
    """(source, key, value) of ``source:key=value``; the source is the part
    before the first ':' when that part is a plain word (so IPv6 CIDR keys
    keep their colons), else empty."""
    key_part, _, value = text.partition("=")
    source, sep, key = key_part.partition(":")
    if not sep or not _SOURCE_RE.match(source) or source.isdigit():
        source, key = "", key_part
    return source, key, value


LabelSet = tuple[Label, ...]


def label_set(labels: Iterable[Label]) -> LabelSet:
    """Sorted, without duplicates. Raises LabelError when one (source, key)
    carries two values."""
    seen: dict[tuple[str, str], str] = {}
    for label in labels:
        prev = seen.get((label.source, label.key))
        if prev is not None and prev != label.value:
            raise LabelError(f"label {label.source}:{label.key} given twice with different values")
        seen[(label.source, label.key)] = label.value
    return tuple(sorted(Label(key=k, source=s, value=v) for (s, k), v in seen.items()))


def parse_labels(texts: Sequence[str]) -> LabelSet:
    return label_set(Label.parse(t) for t in texts)


def format_labels(labels: LabelSet) -> str:
    """Cilium's sorted label string: ``k8s:a=1;k8s:b=2;``."""
    return "".join(f"{label};" for label in labels)


def labels_from_string(text: str) -> LabelSet:
    return parse_labels([p for p in text.split(";") if p])


# --- label filter: which labels are relevant to identity ---

DEFAULT_LABEL_FILTER: tuple[str, ...] = (
    # Kept first (first match wins): the namespace, the namespace's labels
    # and the app.kubernetes.io labels.
    r"io\.kubernetes\.pod\.namespace$",
    r"io\.cilium\.k8s\.namespace\.labels\.",
    r"io\.cilium\.k8s\.policy\.",
    r"app\.kubernetes\.io",
    # Dropped: labels that change per pod or carry no meaning for policy.
    r"!io\.kubernetes",
    r"!.*kubernetes\.io",
    r"!.*k8s\.io",
    r"!pod-template-generation$",
    r"!pod-template-hash$",
    r"!controller-revision-hash$",
    r"!annotation\.",
    r"!etcd_node$",
)


class LabelFilter:
    """Ordered patterns over label keys, ``regex`` to keep or ``!regex`` to
    drop; the first pattern matching (re.match, from the start of the key)
    decides and a key no pattern matches is kept. Reserved and CIDR labels
    are always kept."""

    def __init__(self, patterns: Sequence[str] = DEFAULT_LABEL_FILTER) -> None:
        self.patterns = tuple(patterns)
        self._compiled: list[tuple[bool, re.Pattern[str]]] = []
        self._decided: dict[str, bool] = {}
        for pattern in self.patterns:
            keep = not pattern.startswith("!")
            body = pattern if keep else pattern[1:]
            try:
                self._compiled.append((keep, re.compile(body)))
            except re.error as exc:
                raise ValueError(f"invalid label filter pattern {pattern!r}: {exc}") from None

    def relevant(self, label: Label) -> bool:
        if label.source in (SOURCE_RESERVED, SOURCE_CIDR):
            return True
        decided = self._decided.get(label.key)
        if decided is None:
            decided = next((keep for keep, regex in self._compiled if regex.match(label.key)), True)
            if len(self._decided) > 8192:
                self._decided.clear()
            self._decided[label.key] = decided
        return decided

    def filter(self, labels: LabelSet) -> LabelSet:
        return tuple(label for label in labels if self.relevant(label))
