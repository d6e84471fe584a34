"""Helpers of the policy integration tests: stubs, labels, stream readers
and a direct look at etcd."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from harness import tls
from harness.etcd import EtcdServer
from harness.procs import ServiceProcess

from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.api.policy.v1 import policy_pb2_grpc as pbg

IDENT_PREFIX = "flagella/state/identities/v1/"
RULES_PREFIX = "flagella/policy/v1/rules/"
IP_PREFIX = "flagella/state/ip/v1/"


def labels(**kv: str) -> list[pb.Label]:
    return [pb.Label(source="k8s", key=k, value=v) for k, v in kv.items()]


def pod_labels(namespace: str, **kv: str) -> list[pb.Label]:
    return [
        pb.Label(source="k8s", key="io.kubernetes.pod.namespace", value=namespace),
        *labels(**kv),
    ]


CLI = str(Path(sys.executable).parent / "flagella")


def cli(policy: ServiceProcess, *args: str) -> str:
    """The flagella CLI, as an operator, against this policy process: its stdout."""
    env = {**os.environ, "FLAGELLA_TLS_DIR": str(tls.session().bundle(tls.OPERATOR))}
    proc = subprocess.run(
        [CLI, "--policy-address", policy.address, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def stub(address: str) -> tuple[grpc.aio.Channel, pbg.PolicyServiceStub]:
    channel = grpc.aio.insecure_channel(address)
    return channel, pbg.PolicyServiceStub(channel)


async def etcd_keys(server: EtcdServer, prefix: str) -> dict[str, Any]:
    """Every key under prefix with its JSON value, read from etcd."""
    etcd = server.client()
    try:
        kvs, _ = await etcd.get_prefix(prefix)
        return {kv.key: json.loads(kv.value) for kv in kvs}
    finally:
        await etcd.close()


PolicyState = dict[int, tuple[bool, bool, tuple[tuple[Any, ...], ...], str]]


class StreamReader:
    """Applies watch events to a client-side state, as a datapath would."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.iterator: AsyncIterator[Any] = call.__aiter__()
        self.state: dict[Any, Any] = {}
        self.synced = 0
        self.kinds: list[int] = []
        self.events = 0

    def apply(self, ev: Any) -> None:
        raise NotImplementedError

    async def until_synced(self, revision: int = 0, timeout: float = 20.0) -> None:
        """Reads until a SYNCED at revision or later."""

        async def read() -> None:
            while True:
                ev = await self.iterator.__anext__()
                self.events += 1
                self.kinds.append(ev.kind)
                if ev.kind == pb.EVENT_KIND_RESET:
                    self.state.clear()
                elif ev.kind == pb.EVENT_KIND_SYNCED:
                    self.synced = ev.revision
                    if ev.revision >= revision:
                        return
                elif ev.kind == pb.EVENT_KIND_BATCH:
                    for inner in ev.events:
                        self.apply(inner)
                else:
                    self.apply(ev)

        await asyncio.wait_for(read(), timeout)

    def cancel(self) -> None:
        self.call.cancel()


class PolicyStream(StreamReader):
    def apply(self, ev: Any) -> None:
        if ev.kind == pb.EVENT_KIND_UPSERT:
            p = ev.policy
            assert p.identity == ev.identity
            self.state[ev.identity] = (
                p.ingress_enforced,
                p.egress_enforced,
                tuple(
                    sorted(
                        (
                            e.identity,
                            e.port,
                            e.end_port,
                            e.protocol,
                            e.direction,
                            e.verdict,
                            tuple(e.derived_from),
                        )
                        for e in p.entries
                    )
                ),
                p.error,
            )
        elif ev.kind == pb.EVENT_KIND_DELETE:
            assert ev.identity in self.state, f"DELETE of {ev.identity} never sent"
            del self.state[ev.identity]


class IPCacheStream(StreamReader):
    def apply(self, ev: Any) -> None:
        e = ev.entry
        if ev.kind == pb.EVENT_KIND_UPSERT:
            self.state[e.prefix] = (e.identity, e.node, e.host_ip, e.source, e.revision)
        elif ev.kind == pb.EVENT_KIND_DELETE:
            assert e.prefix in self.state, f"DELETE of {e.prefix} never sent"
            del self.state[e.prefix]


def watch_policy(s: pbg.PolicyServiceStub, node: str, since: int = 0) -> PolicyStream:
    return PolicyStream(s.WatchPolicy(pb.WatchPolicyRequest(node=node, since_revision=since)))


def watch_ipcache(
    s: pbg.PolicyServiceStub, since: int = 0, *, batch_events: bool = False
) -> IPCacheStream:
    return IPCacheStream(
        s.WatchIPCache(pb.WatchIPCacheRequest(since_revision=since, batch_events=batch_events))
    )
