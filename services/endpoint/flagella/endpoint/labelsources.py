"""An endpoint's labels by source, as Cilium splits them (pkg/labels and the
endpoint's OpLabels):

- orchestration-identity: the pod's labels its identity is made of;
- orchestration-info: the pod's labels not relevant to identity (the policy
  service's label filter leaves them out, e.g. pod-template-hash);
- custom: labels added through PatchEndpointLabels ("source:key", source
  k8s, container or unspec), part of the identity;
- disabled: pod labels disabled for identity, still shown.

Pure logic: the endpoint service asks the policy service which labels its
identity has, and changes the record with LabelPatch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from flagella.common.errors import InvalidArgument
from flagella.endpoint.model import Endpoint

# Sources a custom label may have (Cilium's, without those only the agent sets).
CUSTOM_SOURCES = ("k8s", "container", "unspec")
NAMESPACE_LABEL = "io.kubernetes.pod.namespace"

Label = tuple[str, str, str]  # (source, key, value)


def custom_key(text: str, field: str) -> str:
    """ "source:key" of a custom label (a bare key: unspec)."""
    source, sep, key = text.partition(":")
    if not sep:
        source, key = "unspec", text
    if source not in CUSTOM_SOURCES:
        raise InvalidArgument(
            f"source {source!r} is not one of {', '.join(CUSTOM_SOURCES)}", field=field
        )
    if not key:
        raise InvalidArgument("empty label key", field=field)
    return f"{source}:{key}"


def pod_label_key(text: str, field: str) -> str:
    """ "k8s:key" of a pod label named by a disable or enable."""
    key = text.removeprefix("k8s:")
    if not key or ":" in key:
        raise InvalidArgument(f"{text!r} is not a pod label (k8s:key)", field=field)
    if key == NAMESPACE_LABEL:
        raise InvalidArgument("the namespace label stays in the identity", field=field)
    return f"k8s:{key}"


@dataclass(frozen=True)
class LabelPatch:
    """PatchEndpointLabels' custom and disabled changes, validated."""

    add_custom: Mapping[str, str] = field(default_factory=dict)
    delete_custom: tuple[str, ...] = ()
    disable: tuple[str, ...] = ()
    enable: tuple[str, ...] = ()

    def applied(
        self, ep: Endpoint, pod_labels: Mapping[str, str]
    ) -> tuple[dict[str, str], list[str]]:
        """The endpoint's custom and disabled labels after the patch; a
        disabled label must be one of the pod's (pod_labels: after the
        patch)."""
        custom = {k: v for k, v in ep.custom_labels.items() if k not in self.delete_custom}
        custom.update(self.add_custom)
        for i, key in enumerate(self.disable):
            if key.removeprefix("k8s:") not in pod_labels:
                raise InvalidArgument(f"the pod has no label {key}", field=f"disable[{i}]")
        disabled = (set(ep.disabled_labels) | set(self.disable)) - set(self.enable)
        # A label the pod no longer has is no longer disabled.
        return custom, sorted(k for k in disabled if k.removeprefix("k8s:") in pod_labels)


@dataclass(frozen=True)
class LabelSources:
    identity: int
    orchestration_identity: list[Label]
    orchestration_info: list[Label]
    custom: list[Label]
    disabled: list[Label]


def label_sources(ep: Endpoint, in_identity: Iterable[Label]) -> LabelSources:
    """Splits the endpoint's labels; in_identity: its identity's labels."""
    have = set(in_identity)
    disabled = set(ep.disabled_labels)
    pod = dict(ep.labels)
    if ep.pod_namespace:
        pod.setdefault(NAMESPACE_LABEL, ep.pod_namespace)
    enabled = [("k8s", k, v) for k, v in sorted(pod.items()) if f"k8s:{k}" not in disabled]
    custom = []
    for key, value in sorted(ep.custom_labels.items()):
        source, _, name = key.partition(":")
        custom.append((source, name, value))
    return LabelSources(
        identity=ep.identity,
        orchestration_identity=[lb for lb in enabled if lb in have],
        orchestration_info=[lb for lb in enabled if lb not in have],
        custom=custom,
        disabled=[("k8s", k, v) for k, v in sorted(pod.items()) if f"k8s:{k}" in disabled],
    )
