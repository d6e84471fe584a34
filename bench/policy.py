"""Benchmark of the policy service: identity allocation (new and cached),
references held by many owners (endpoints) of one identity on one node,
cached lookups, resolution of 1,000 identities under 200 rules, and the
recompute after one rule changes.

Sets up its own etcd and policy process on free loopback ports and stops
them by PID at the end.

    python bench/policy.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import grpc  # noqa: E402
from harness import tls  # noqa: E402
from harness.etcd import EtcdServer  # noqa: E402
from harness.procs import ServiceProcess  # noqa: E402

from flagella.api.policy.v1 import policy_pb2 as pb  # noqa: E402
from flagella.api.policy.v1 import policy_pb2_grpc as pbg  # noqa: E402
from flagella.common import pki  # noqa: E402
from flagella.common.sync import Table  # noqa: E402
from flagella.policy.keys import RULES_PREFIX  # noqa: E402
from flagella.policy.labels import Label, LabelFilter, label_set  # noqa: E402
from flagella.policy.rules import parse_document, rule_to_json  # noqa: E402
from flagella.policy.state import PolicyState  # noqa: E402
from flagella.policy.store import PolicyStore  # noqa: E402

NAMESPACES = 50
APPS_PER_NAMESPACE = 20
TIERS = ("web", "api", "db", "cache")


def pod(ns: int, app: int, extra: str = "") -> list[pb.Label]:
    return [
        pb.Label(source="k8s", key="io.kubernetes.pod.namespace", value=f"ns-{ns}"),
        pb.Label(source="k8s", key="app", value=f"app-{app}{extra}"),
        pb.Label(source="k8s", key="tier", value=TIERS[app % 4]),
        pb.Label(source="k8s", key="team", value=f"team-{ns % 5}"),
        pb.Label(source="k8s", key="pod-template-hash", value="5d8f7c9b4"),
    ]


def _ipblocks(ns: int) -> str:
    """ipBlocks over the pods' addresses (nested, with excepts, host bits as
    upstream writes them) for the NetworkPolicy of the ipBlock mix."""
    return f"""
    - ipBlock: {{cidr: 10.{ns}.3.7/16, except: [10.{ns}.1.0/24, 10.{ns}.2.0/24]}}
    - ipBlock: {{cidr: 10.{ns}.1.0/24, except: [10.{ns}.1.128/25]}}
    - ipBlock: {{cidr: "fd00:{ns}::/64", except: ["fd00:{ns}::/112"]}}"""


def named_ports_mix(doc: str, ns: int) -> str:
    """rules_document with named ports mixed in, in every other namespace:
    the api port and the NetworkPolicy's db port by name, and a deny of a
    named port beside the baseline's deny (same rules otherwise)."""
    if ns % 2:
        return doc
    return (
        doc.replace('{port: "8080", protocol: TCP}', "{port: api-http, protocol: TCP}")
        .replace("ports: [{port: 5432}]", "ports: [{port: db-port}]")
        .replace(
            "  - fromEndpoints: [{matchLabels: {app: app-13}}]\n",
            "  - fromEndpoints: [{matchLabels: {app: app-13}}]\n"
            "  - fromEndpoints: [{matchLabels: {app: app-14}}]\n"
            "    toPorts: [{ports: [{port: admin, protocol: TCP}]}]\n",
        )
    )


def rules_document(ns: int, api_port: int = 8080, *, ipblocks: bool = False) -> str:
    """Four rules per namespace (50 namespaces: 200 rules); with ipblocks,
    the NetworkPolicy also takes ingress from ipBlocks over pods and sends
    egress to one (Kubernetes' meaning: prefix entries)."""
    blocks = _ipblocks(ns) if ipblocks else ""
    egress = (
        f"""
  egress:
  - to: [ipBlock: {{cidr: 10.{(ns + 1) % NAMESPACES}.0.0/16, except: [10.{(ns + 1) % NAMESPACES}.9.0/24]}}]
    ports: [{{port: 443}}]"""
        if ipblocks
        else ""
    )
    return f"""
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {{name: web, namespace: ns-{ns}}}
spec:
  endpointSelector: {{matchLabels: {{tier: web}}}}
  ingress:
  - fromEntities: [world]
    toPorts: [{{ports: [{{port: "80", protocol: TCP}}, {{port: "443", protocol: TCP}}]}}]
  egress:
  - toEndpoints: [{{matchLabels: {{tier: api}}}}]
    toPorts: [{{ports: [{{port: "{api_port}", protocol: TCP}}]}}]
---
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {{name: api, namespace: ns-{ns}}}
spec:
  endpointSelector: {{matchLabels: {{tier: api}}}}
  ingress:
  - fromEndpoints: [{{matchLabels: {{tier: web}}}}]
    toPorts: [{{ports: [{{port: "{api_port}", protocol: TCP}}]}}]
  - fromEndpoints:
    - matchLabels: {{k8s:io.kubernetes.pod.namespace: ns-0}}
      matchExpressions: [{{key: app, operator: In, values: [app-1, app-5]}}]
    toPorts: [{{ports: [{{port: "9090", endPort: 9099, protocol: TCP}}]}}]
  egress:
  - toEndpoints: [{{matchLabels: {{tier: db}}}}]
    toPorts: [{{ports: [{{port: "5432", protocol: TCP}}]}}]
  - toEndpoints: [{{matchLabels: {{tier: cache}}}}]
    toPorts: [{{ports: [{{port: "6379", protocol: TCP}}]}}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {{name: db, namespace: ns-{ns}}}
spec:
  podSelector: {{matchLabels: {{tier: db}}}}
  ingress:
  - from:
    - podSelector: {{matchLabels: {{tier: api}}}}
    - namespaceSelector: {{matchLabels: {{kubernetes.io/metadata.name: ns-{(ns + 1) % NAMESPACES}}}}}
      podSelector: {{matchExpressions: [{{key: tier, operator: NotIn, values: [web]}}]}}{blocks}
    ports: [{{port: 5432}}]{egress}
---
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {{name: baseline, namespace: ns-{ns}}}
spec:
  endpointSelector: {{}}
  egress:
  - toEndpoints: [{{matchLabels: {{k8s:io.kubernetes.pod.namespace: ns-0, app: app-0}}}}]
    toPorts: [{{ports: [{{port: "53", protocol: ANY}}]}}]
  - toCIDRSet: [{{cidr: 10.0.0.0/8, except: [10.96.0.0/12, 10.{ns}.0.0/16]}}]
    toPorts: [{{ports: [{{port: "443", protocol: TCP}}]}}]
  ingressDeny:
  - fromEndpoints: [{{matchLabels: {{app: app-13}}}}]
"""


async def run_concurrently(
    items: list[Any], fn: Callable[[Any], Awaitable[None]], concurrency: int
) -> float:
    """Runs fn over items with a bounded number in flight; returns seconds."""
    queue = list(reversed(items))

    async def worker() -> None:
        while queue:
            await fn(queue.pop())

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start


async def bench(quick: bool, etcd_server: EtcdServer, address: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    # Identities are the endpoint service's to ask for; rules an operator's.
    session = tls.session()
    channels = [session.aio_channel(address, pki.service("endpoint")) for _ in range(4)]
    stubs = [pbg.PolicyServiceStub(ch) for ch in channels]
    operator_channel = session.aio_channel(address)
    channels.append(operator_channel)
    ops = pbg.PolicyServiceStub(operator_channel)
    try:
        # 1. new identities: the 1,000 of the resolution benchmark, then more
        everyone = [(ns, app) for ns in range(NAMESPACES) for app in range(APPS_PER_NAMESPACE)]
        extra = 0 if quick else 1000
        counter = 0

        async def allocate(item: tuple[int, int, str, str]) -> None:
            nonlocal counter
            ns, app, suffix, node = item
            counter += 1
            await stubs[counter % 4].AllocateIdentity(
                pb.AllocateIdentityRequest(labels=pod(ns, app, suffix), node=node), timeout=30
            )

        new_items = [(ns, app, "", "node-1") for ns, app in everyone]
        new_items += [(i % NAMESPACES, i, "-x", "node-2") for i in range(extra)]
        seconds = await run_concurrently(new_items, allocate, 32)
        results["new_identities_count"] = len(new_items)
        results["new_identities_per_s"] = round(len(new_items) / seconds)

        # 2. cached allocations: known labels, a new reference on another node
        cached_items = [(ns, app, "", "node-3") for ns, app in everyone]
        seconds = await run_concurrently(cached_items, allocate, 32)
        results["cached_allocations_per_s"] = round(len(cached_items) / seconds)

        # 2b. owned references: many endpoints (owners "<container id>/eth0")
        # of one identity on one node, all 32 in flight; then the same owners
        # again (idempotent repeats); then every owner releases its reference.
        n_owners = 200 if quick else 500
        owners = [hashlib.sha256(b"%d" % i).hexdigest() + "/eth0" for i in range(n_owners)]
        owned_node = "node-4"
        owned_labels = pod(1, 2)
        retried = 0
        owned_id = 0

        async def retrying(call: Callable[[], Awaitable[Any]]) -> Any:
            nonlocal retried
            for _ in range(100):
                try:
                    return await call()
                except grpc.aio.AioRpcError as exc:
                    # "kept conflicting; retry": contention on one key
                    if exc.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    retried += 1
            raise RuntimeError("too many retries")

        async def take(owner: str) -> None:
            nonlocal counter, owned_id
            counter += 1
            s = stubs[counter % 4]
            req = pb.AllocateIdentityRequest(labels=owned_labels, node=owned_node, owner=owner)
            resp = await retrying(lambda: s.AllocateIdentity(req, timeout=30))
            owned_id = resp.identity.id

        async def drop(owner: str) -> None:
            nonlocal counter
            counter += 1
            s = stubs[counter % 4]
            req = pb.ReleaseIdentityRequest(id=owned_id, node=owned_node, owner=owner)
            await retrying(lambda: s.ReleaseIdentity(req, timeout=30))

        seconds = await run_concurrently(owners, take, 32)
        results["owned_allocations_per_s"] = round(n_owners / seconds)
        etcd = etcd_server.client()
        try:
            kvs, _ = await etcd.get_prefix("flagella/state/identities/v1/value/")
        finally:
            await etcd.close()
        held = [kv for kv in kvs if f"/{owned_node}" in kv.key]
        results["owned_reference_keys_count"] = len(held)
        results["owned_reference_etcd_bytes"] = sum(len(kv.key) + len(kv.value) for kv in held)
        seconds = await run_concurrently(owners, take, 32)
        results["owned_repeats_per_s"] = round(n_owners / seconds)
        seconds = await run_concurrently(owners, drop, 32)
        results["owned_releases_per_s"] = round(n_owners / seconds)
        results["owned_owners_count"] = n_owners
        results["owned_conflict_retries_count"] = retried

        # 3. cached lookups over gRPC (GetIdentity by labels: no etcd)
        lookups = 4000 if quick else 20000
        requests = [
            pb.GetIdentityRequest(labels=pb.LabelList(labels=pod(*everyone[i % 1000])))
            for i in range(lookups)
        ]

        async def lookup(req: pb.GetIdentityRequest) -> None:
            nonlocal counter
            counter += 1
            await stubs[counter % 4].GetIdentity(req, timeout=30)

        seconds = await run_concurrently(requests, lookup, 64)
        results["cached_lookups_grpc_per_s"] = round(lookups / seconds)

        # 4. rules: 200 (4 per namespace), put through the API
        start = time.perf_counter()
        for first in range(0, NAMESPACES, 10):
            doc = "---".join(rules_document(ns) for ns in range(first, first + 10))
            await ops.PutRules(pb.PutRulesRequest(document=doc), timeout=30)
        results["put_200_rules_ms"] = round((time.perf_counter() - start) * 1000, 1)

        # In-process: the service's own state, loaded from etcd.
        etcd = etcd_server.client()
        try:
            # What a replica's mirror reads at start.
            source = PolicyStore(etcd).mirror_source(Table("bench"))
            records, revision = await source.read()
            kvs = [kv for _, kv, _ in records]
        finally:
            await etcd.close()
        ident_ids: list[int] = []

        # The mix: the same state with the 50 NetworkPolicies taking ipBlocks
        # over pods and named ports in every other namespace (in process only).
        kvs_ipblocks: list[Any] = [kv for kv in kvs if not kv.key.startswith(RULES_PREFIX)]
        for ns in range(NAMESPACES):
            for rule in parse_document(named_ports_mix(rules_document(ns, ipblocks=True), ns)):
                kvs_ipblocks.append(_KV(RULES_PREFIX + rule.key, rule_to_json(rule), revision, 1))

        def load(kvs: list[Any] = kvs) -> PolicyState:
            state = PolicyState()
            for kv in kvs:
                state.put(kv)
            state.commit(revision)
            return state

        def resolve_all(state: PolicyState) -> tuple[list[int], int, int]:
            idents = sorted(i for i in state.identities if state.node_refs.get("node-1", {}).get(i))
            entries = prefixes = 0
            for ident in idents:
                content = state.resolver.content(ident)
                assert content is not None
                assert not content.error
                entries += len(content.entries)
                prefixes += len(content.prefix_entries)
            return idents, entries, prefixes

        load_times, resolve_times, ipblock_times = [], [], []
        state = load()
        # Interleaved, so both mixes see the same machine; timed in this
        # thread's CPU time, which other load on the machine does not inflate
        # (resolution is pure computation in this thread).
        for _ in range(3 if quick else 5):
            t0 = time.thread_time()
            state = load()
            t1 = time.thread_time()
            ident_ids, entries, _ = resolve_all(state)
            t2 = time.thread_time()
            load_times.append(t1 - t0)
            resolve_times.append(t2 - t1)
            with_blocks = load(kvs_ipblocks)
            t3 = time.thread_time()
            _, entries_ipblocks, prefix_entries = resolve_all(with_blocks)
            ipblock_times.append(time.thread_time() - t3)
        assert len(ident_ids) == 1000, len(ident_ids)
        assert prefix_entries > 0
        results["rules_count"] = len(state.rules)
        results["resolved_identities_count"] = len(ident_ids)
        results["policy_entries_count"] = entries
        results["load_state_ms"] = round(statistics.median(load_times) * 1000, 1)
        results["resolve_1000_identities_200_rules_ms"] = round(
            statistics.median(resolve_times) * 1000, 1
        )
        results["resolve_1000_identities_200_rules_named_ports_ipblocks_ms"] = round(
            statistics.median(ipblock_times) * 1000, 1
        )
        results["ipblocks_policy_entries_count"] = entries_ipblocks
        results["ipblocks_prefix_entries_count"] = prefix_entries

        # cached lookups in-process (what GetIdentity does without gRPC)
        label_filter = LabelFilter()
        texts = [
            [Label.make(lb.source, lb.key, lb.value) for lb in pod(*everyone[i])]
            for i in range(1000)
        ]
        n = 100000 if not quick else 30000
        t0 = time.perf_counter()
        for i in range(n):
            found = state.identity_of_labels(label_filter.filter(label_set(texts[i % 1000])))
            assert found is not None
        results["cached_lookups_in_process_per_s"] = round(n / (time.perf_counter() - t0))

        # 5. one rule changes: only the identities it selects are recomputed
        change_times, recomputed = [], 0
        rev = revision
        for k in range(5 if quick else 10):
            (rule,) = [r for r in parse_document(rules_document(7, 8000 + k)) if r.name == "api"]
            rev += 1
            t0 = time.perf_counter()
            state.put(_KV(f"flagella/policy/v1/rules/{rule.key}", rule_to_json(rule), rev, 1))
            change = state.commit(rev)
            recomputed = 0
            for ident in change.dirty:
                if state.resolver.content(ident) is not None:
                    recomputed += 1
            change_times.append(time.perf_counter() - t0)
        results["one_rule_change_recompute_ms"] = round(statistics.median(change_times) * 1000, 2)
        results["one_rule_change_recomputed_identities_count"] = recomputed

        # 6. end to end over gRPC: WatchPolicy of a node holding the 1,000
        t0 = time.perf_counter()
        call = ops.WatchPolicy(pb.WatchPolicyRequest(node="node-1"))
        it = call.__aiter__()
        upserts = 0
        while True:
            ev = await it.__anext__()
            if ev.kind == pb.EVENT_KIND_UPSERT:
                upserts += 1
            if ev.kind == pb.EVENT_KIND_SYNCED:
                break
        results["watch_snapshot_1000_policies_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        assert upserts == 1000, upserts
        e2e = []
        for k in range(5 if quick else 10):
            doc = "".join(d for d in rules_document(9, 7000 + k).split("---") if "name: api," in d)
            t0 = time.perf_counter()
            put = await ops.PutRules(pb.PutRulesRequest(document=doc), timeout=30)
            while True:
                ev = await it.__anext__()
                if ev.kind == pb.EVENT_KIND_SYNCED and ev.revision >= put.revision:
                    break
            e2e.append(time.perf_counter() - t0)
        call.cancel()
        results["one_rule_change_end_to_end_ms"] = round(statistics.median(e2e) * 1000, 1)
    finally:
        for ch in channels:
            await ch.close()
    return results


class _KV:
    def __init__(self, key: str, value: bytes, rev: int, created: int) -> None:
        self.key = key
        self.value = value
        self.mod_revision = rev
        self.create_revision = created
        self.lease = 0


ROWS = [
    ("new identities (AllocateIdentity, 32 in flight)", "new_identities_per_s", "/s", ">= 500"),
    ("cached allocations (known labels, new reference)", "cached_allocations_per_s", "/s", ""),
    ("owned allocations (one identity, one node, N owners)", "owned_allocations_per_s", "/s", ""),
    ("owned repeats (the same N owners again)", "owned_repeats_per_s", "/s", ""),
    ("owned releases (the N owners, one by one)", "owned_releases_per_s", "/s", ""),
    ("cached lookups over gRPC (GetIdentity by labels)", "cached_lookups_grpc_per_s", "/s", ""),
    ("cached lookups in process", "cached_lookups_in_process_per_s", "/s", ">= 20,000"),
    ("put 200 rules (5 PutRules of 40)", "put_200_rules_ms", "ms", ""),
    ("load state from an etcd snapshot", "load_state_ms", "ms", ""),
    (
        "resolve 1,000 identities under 200 rules",
        "resolve_1000_identities_200_rules_ms",
        "ms",
        "< 1,000",
    ),
    (
        "the same with ipBlocks over pods and named ports mixed in",
        "resolve_1000_identities_200_rules_named_ports_ipblocks_ms",
        "ms",
        "within 20 %",
    ),
    ("one rule changes: recompute what it affects", "one_rule_change_recompute_ms", "ms", "< 50"),
    ("one rule changes: PutRules to WatchPolicy SYNCED", "one_rule_change_end_to_end_ms", "ms", ""),
    ("WatchPolicy snapshot of 1,000 policies", "watch_snapshot_1000_policies_ms", "ms", ""),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs, within 30 s")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    started = time.perf_counter()
    etcd = EtcdServer().start()
    proc = ServiceProcess("policy", ["--etcd-endpoints", etcd.endpoint, "--log-level", "warning"])
    try:
        proc.start().wait_serving()
        results = asyncio.run(bench(args.quick, etcd, proc.address))
    finally:
        proc.cleanup()
        etcd.cleanup()
    results["cpu_count"] = os.cpu_count()
    results["total_s"] = round(time.perf_counter() - started, 1)
    if args.json:
        print(json.dumps(results, sort_keys=True))
        return 0
    width = max(len(r[0]) for r in ROWS)
    print(
        f"{'policy benchmark' + (' (quick)' if args.quick else ''):<{width}}  {'value':>12}  target"
    )
    for label, key, unit, target in ROWS:
        value = results[key]
        print(f"{label:<{width}}  {value:>10,} {unit:<3} {target}")
    print(
        f"({results['new_identities_count']} new identities; {results['resolved_identities_count']} identities, "
        f"{results['rules_count']} rules, {results['policy_entries_count']} entries "
        f"(mix of ipBlocks and named ports: {results['ipblocks_policy_entries_count']} entries and "
        f"{results['ipblocks_prefix_entries_count']} prefix entries); one rule change "
        f"recomputes {results['one_rule_change_recomputed_identities_count']} identities; "
        f"N = {results['owned_owners_count']} owners: {results['owned_reference_keys_count']} "
        f"etcd keys, {results['owned_reference_etcd_bytes']:,} bytes, "
        f"{results['owned_conflict_retries_count']} retried calls; "
        f"{results['cpu_count']} CPUs; {results['total_s']} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
