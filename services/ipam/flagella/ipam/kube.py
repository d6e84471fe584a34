"""host-scope mode: a node's pod CIDRs from its Kubernetes Node
(spec.podCIDRs, else spec.podCIDR), read with the kubernetes client.

The client is synchronous; reads run in a worker thread so the event loop
never blocks on the API server.
"""

from __future__ import annotations

import asyncio
from typing import Any

from flagella.common.errors import FailedPrecondition, NotFound, Unavailable


class KubeNodeCidrs:
    """Reads Node objects through one kubernetes ApiClient."""

    def __init__(self, api_client: Any, *, timeout: float = 5.0) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.timeout = timeout

    @classmethod
    def from_kubeconfig(cls, kubeconfig: str, *, timeout: float = 5.0) -> KubeNodeCidrs:
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
        return cls(api_client, timeout=timeout)

    async def pod_cidrs(self, name: str) -> list[str]:
        return await asyncio.to_thread(self._read, name)

    def _read(self, name: str) -> list[str]:
        import urllib3
        from kubernetes.client.exceptions import ApiException

        try:
            node = self.core.read_node(name, _request_timeout=self.timeout)
        except ApiException as exc:
            if exc.status == 404:
                raise NotFound(f"Kubernetes has no Node {name}", field="name") from None
            raise Unavailable(
                f"Kubernetes API answered {exc.status} {exc.reason} reading Node {name}",
                field="name",
            ) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise Unavailable(f"Kubernetes API unreachable: {exc}", field="name") from None
        spec = node.spec
        # spec.podCIDRs: pod_cidrs in this client; older clients generated pod_cid_rs.
        cidrs = list(getattr(spec, "pod_cidrs", None) or getattr(spec, "pod_cid_rs", None) or [])
        single = getattr(spec, "pod_cidr", None)
        if not cidrs and single:
            cidrs = [single]
        if not cidrs:
            raise FailedPrecondition(
                f"Kubernetes Node {name} has no spec.podCIDRs yet", field="name"
            )
        return [str(c) for c in cidrs]
