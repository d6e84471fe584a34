"""Configuration of the policy service."""

from __future__ import annotations

from dataclasses import dataclass

from flagella.common.addresses import address_option
from flagella.common.config import option, parse_host_port
from flagella.common.errors import ConfigError
from flagella.common.kubeapi import KubeConfig
from flagella.policy.labels import DEFAULT_LABEL_FILTER, LabelFilter

POLICY_KIND_NAMES = (
    "NetworkPolicy",
    "CiliumNetworkPolicy",
    "CiliumClusterwideNetworkPolicy",
    "FlagellaNetworkPolicy",
    "AdminNetworkPolicy",
    "BaselineAdminNetworkPolicy",
    "CiliumCIDRGroup",
)


@dataclass(frozen=True)
class PolicyConfig(KubeConfig):
    """flagella policy service: security identities, the ipcache, network policy
    rules and their resolution (with --kubeconfig: also NetworkPolicies and the
    Cilium and Flagella policy custom resources of the Kubernetes API)."""

    listen: str = option("127.0.0.1:50052", "gRPC address to serve on", parse=parse_host_port)
    metrics_listen: str = option(
        "127.0.0.1:9962",
        "serve Prometheus metrics (GET /metrics, HTTP) here; empty: off",
        parse=parse_host_port,
    )
    lb_address: str = address_option(
        "127.0.0.1:50054",
        "lb service, whose services toServices rules follow (empty: none; toServices then "
        "selects nothing)",
    )
    node_lease_ttl: int = option(
        900,
        "seconds a node's identity references and ipcache entries outlive the last sign "
        "of the node (its WatchPolicy stream or a call naming it)",
    )
    keys_per_lease: int = option(
        1000, "keys attached to one etcd lease before a node gets another lease"
    )
    identity_gc_interval: float = option(
        15.0,
        "seconds between garbage-collection rounds; an identity no node references is "
        "freed after two rounds",
    )
    policy_map_max_entries: int = option(
        16384, "per-endpoint budget of policy-map entries (RESOURCE_EXHAUSTED beyond it)"
    )
    allow_localhost: str = option(
        "always",
        "always: ingress from the local host is allowed (Cilium's default); "
        "policy: only when a rule allows it",
        choices=("always", "policy"),
    )
    k8s_ipblock_mode: str = option(
        "kubernetes",
        "kubernetes: a Kubernetes NetworkPolicy ipBlock matches every address inside it "
        "(pods and nodes too, address by address, minus except); cilium: only addresses "
        "outside the cluster (CIDR identities), as Cilium",
        choices=("kubernetes", "cilium"),
    )
    identity_label_filter: tuple[str, ...] = option(
        DEFAULT_LABEL_FILTER,
        "label-key patterns deciding which labels are identity-relevant, first match "
        "wins: REGEX keeps, !REGEX drops, no match keeps",
    )
    watch_heartbeat: float = option(
        30.0, "seconds between SYNCED heartbeats on an idle watch stream"
    )
    watch_quiet_sync_rate: float = option(
        1000.0,
        "SYNCEDs per second, all WatchPolicy streams together, announcing revisions that "
        "touch nothing of a stream's node (a quiet stream still announces one at once; "
        "a revision touching the node is always sent at once)",
    )
    kubernetes_policy_kinds: tuple[str, ...] = option(
        POLICY_KIND_NAMES,
        "with --kubeconfig: the policy kinds to follow (leave out a kind whose CRD the "
        "cluster does not have)",
        choices=POLICY_KIND_NAMES,
    )

    def validate(self) -> None:
        super().validate()
        if self.node_lease_ttl < 2:
            raise ConfigError("--node-lease-ttl", "must be at least 2 seconds")
        if self.keys_per_lease < 2:
            raise ConfigError("--keys-per-lease", "must be at least 2")
        if self.identity_gc_interval <= 0:
            raise ConfigError("--identity-gc-interval", "must be positive")
        if self.policy_map_max_entries < 1:
            raise ConfigError("--policy-map-max-entries", "must be positive")
        if self.watch_heartbeat <= 0:
            raise ConfigError("--watch-heartbeat", "must be positive")
        if self.watch_quiet_sync_rate <= 0:
            raise ConfigError("--watch-quiet-sync-rate", "must be positive")
        if self.kubeconfig and not self.kubernetes_policy_kinds:
            raise ConfigError("--kubernetes-policy-kinds", "name at least one kind")
        try:
            LabelFilter(self.identity_label_filter)
        except ValueError as exc:
            raise ConfigError("--identity-label-filter", str(exc)) from None
