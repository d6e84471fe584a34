"""host-scope mode: a node's pod CIDRs from its Kubernetes Node, as
Cilium reads them: spec.podCIDRs (else spec.podCIDR), and when the spec has
none the node's annotations (io.cilium.network.ipv4-pod-cidr / ipv6-pod-cidr,
or flagella's flagella.io/ipv4-pod-cidr / ipv6-pod-cidr), one per family.
An annotation that is no CIDR of its family is logged, counted and ignored.

And the write-back Cilium calls AnnotateNode: the node's CIDRs and health
addresses patched into its annotations (annotate_node).

The client is synchronous; calls run in a worker thread so the event loop
never blocks on the API server.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable, Mapping
from typing import Any

from flagella.common.errors import FailedPrecondition, NotFound, Unavailable

log = logging.getLogger(__name__)

CILIUM_PREFIX = "io.cilium.network."
FLAGELLA_PREFIX = "flagella.io/"
# Per family, the annotations read when the spec has no CIDR, in order.
CIDR_ANNOTATIONS = {
    4: (CILIUM_PREFIX + "ipv4-pod-cidr", FLAGELLA_PREFIX + "ipv4-pod-cidr"),
    6: (CILIUM_PREFIX + "ipv6-pod-cidr", FLAGELLA_PREFIX + "ipv6-pod-cidr"),
}


def node_annotations(pod_cidrs: list[str], health_ips: list[str]) -> dict[str, str]:
    """What annotate_node writes for a node: each family's pod CIDR and
    health address, under Cilium's names and flagella's."""
    out: dict[str, str] = {}
    for kind, values in (("pod-cidr", pod_cidrs), ("health-ip", health_ips)):
        for value in values:
            version = ipaddress.ip_network(value, strict=False).version
            for prefix in (CILIUM_PREFIX, FLAGELLA_PREFIX):
                out.setdefault(f"{prefix}ipv{version}-{kind}", value)
    return out


def annotation_cidrs(
    annotations: Mapping[str, str], name: str, invalid: Callable[[str], None]
) -> list[str]:
    """The pod CIDRs a Node's annotations give: per family the first valid
    of CIDR_ANNOTATIONS; invalid(annotation) for each one ignored."""
    out = []
    for version, keys in CIDR_ANNOTATIONS.items():
        for key in keys:
            text = annotations.get(key)
            if text is None:
                continue
            try:
                net = ipaddress.ip_network(text, strict=True)
                if net.version != version:
                    raise ValueError(f"not an IPv{version} CIDR")
            except ValueError as exc:
                log.warning(
                    "ignoring an invalid pod CIDR annotation",
                    extra={
                        "node": name,
                        "annotation": key,
                        "value": text[:100],
                        "reason": str(exc),
                    },
                )
                invalid(key)
                continue
            out.append(str(net))
            break
    return out


class KubeNodeCidrs:
    """Reads Node objects through one kubernetes ApiClient."""

    def __init__(
        self,
        api_client: Any,
        *,
        timeout: float = 5.0,
        invalid: Callable[[str], None] = lambda annotation: None,
    ) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.timeout = timeout
        # Called with the annotation's name for each invalid one ignored.
        self.invalid = invalid

    @classmethod
    def from_kubeconfig(
        cls,
        kubeconfig: str,
        *,
        timeout: float = 5.0,
        invalid: Callable[[str], None] = lambda annotation: None,
    ) -> KubeNodeCidrs:
        """kubeconfig: a file path, or 'in-cluster' inside a pod. Raises
        ValueError with the reason when it cannot be loaded."""
        from kubernetes import client, config

        try:
            if kubeconfig == "in-cluster":
                configuration = client.Configuration()
                config.load_incluster_config(  # type: ignore[no-untyped-call]
                    client_configuration=configuration
                )
                api_client = client.ApiClient(configuration)
            else:
                api_client = config.new_client_from_config(  # type: ignore[no-untyped-call]
                    config_file=kubeconfig
                )
        except (config.ConfigException, OSError, TypeError, ValueError) as exc:
            raise ValueError(f"cannot load {kubeconfig}: {exc}") from exc
        return cls(api_client, timeout=timeout, invalid=invalid)

    async def pod_cidrs(self, name: str) -> list[str]:
        return await asyncio.to_thread(self._read, name)

    def _read(self, name: str) -> list[str]:
        node = self._call(
            name, "reading", lambda: self.core.read_node(name, _request_timeout=self.timeout)
        )
        spec = node.spec
        # spec.podCIDRs: pod_cidrs in this client; older clients generated pod_cid_rs.
        cidrs = list(getattr(spec, "pod_cidrs", None) or getattr(spec, "pod_cid_rs", None) or [])
        single = getattr(spec, "pod_cidr", None)
        if not cidrs and single:
            cidrs = [single]
        if not cidrs:
            annotations = (node.metadata.annotations if node.metadata else None) or {}
            cidrs = annotation_cidrs(annotations, name, self.invalid)
        if not cidrs:
            raise FailedPrecondition(
                f"Kubernetes Node {name} has no spec.podCIDRs yet (nor a pod CIDR annotation)",
                field="name",
            )
        return [str(c) for c in cidrs]

    async def annotate_node(self, name: str, annotations: dict[str, str]) -> None:
        """Merge annotations into the Node's (Cilium's AnnotateNode)."""
        body = {"metadata": {"annotations": annotations}}
        await asyncio.to_thread(
            self._call,
            name,
            "annotating",
            lambda: self.core.patch_node(name, body, _request_timeout=self.timeout),
        )

    @staticmethod
    def _call(name: str, doing: str, fn: Callable[[], Any]) -> Any:
        """fn(), its failures as NotFound or Unavailable naming the field."""
        import urllib3
        from kubernetes.client.exceptions import ApiException

        try:
            return fn()
        except ApiException as exc:
            if exc.status == 404:
                raise NotFound(f"Kubernetes has no Node {name}", field="name") from None
            raise Unavailable(
                f"Kubernetes API answered {exc.status} {exc.reason} {doing} Node {name}",
                field="name",
            ) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise Unavailable(f"Kubernetes API unreachable: {exc}", field="name") from None
