"""Logic of the endpoint service (no gRPC here): CreateEndpoint's
orchestration across ipam, policy and the node's datapath, with rollback;
delete, labels, restore and garbage collection.

Crash safety: before each step with a side effect, the step is recorded in
the endpoint's etcd record ("intent"); undoing a step is idempotent, and a
no-op when the step never ran. So after a crash at any point, rolling back
the recorded steps releases exactly what may have been acquired, and nothing
leaks.

Because an undo is a no-op for a step that never ran, intents are recorded
several at a time, each write before every step it covers, and the steps of
a write that do not depend on each other run concurrently:

    create the record, intents ipam + identity  (labels already resolved)
    ipam allocate || policy allocate identity
    write addresses, identity, intents datapath + ipcache
    datapath setup || policy ipcache upsert
    datapath wait for policy || ipam commit
    write the ready record and its CNI result

Three etcd writes per ADD (and no read), where one per step took six writes
and three reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from flagella.common.errors import (
    Aborted,
    FailedPrecondition,
    FlagellaError,
    InvalidArgument,
    NotFound,
)
from flagella.common.locks import KeyedLocks
from flagella.common.portnames import NamedPort
from flagella.endpoint.labelsources import LabelPatch, LabelSources, label_sources
from flagella.endpoint.model import Endpoint, State
from flagella.endpoint.store import EndpointStore

log = logging.getLogger(__name__)

# Steps of a create, in order; rollback undoes them in reverse.
STEP_IPAM = "ipam"
STEP_IDENTITY = "identity"
STEP_DATAPATH = "datapath"
STEP_IPCACHE = "ipcache"
# "relabel:<old identity>" while a label change is under way (restore
# finishes it: the pod runs, its record already holds the new identity).
STEP_RELABEL = "relabel:"


@dataclass(frozen=True)
class NodeInfo:
    name: str
    datapath_address: str
    host_ip: str
    pod_cidrs: tuple[str, ...]


@dataclass(frozen=True)
class Allocated:
    ip: str
    cidr: str


@dataclass(frozen=True)
class SetupResult:
    host_ifname: str
    host_mac: str
    container_mac: str
    mtu: int
    addresses: tuple[str, ...]
    gateways: tuple[str, ...]
    routes: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class RealizedEndpoint:
    """What a node's datapath holds for one endpoint."""

    endpoint_id: int
    container_id: str
    ifname: str
    netns_path: str
    identity: int


A = TypeVar("A")
B = TypeVar("B")


class StepTimer:
    """Milliseconds per step of one operation, for its log line."""

    def __init__(self) -> None:
        self.steps: dict[str, float] = {}
        self._last = time.monotonic()

    def __call__(self, step: str) -> None:
        now = time.monotonic()
        self.steps[step] = round((now - self._last) * 1000, 1)
        self._last = now

    async def track(self, name: str, step: Awaitable[A]) -> A:
        """Await step, noting its own duration (steps run concurrently)."""
        start = time.monotonic()
        try:
            return await step
        finally:
            self.steps[name] = round((time.monotonic() - start) * 1000, 1)


async def both(first: Awaitable[A], second: Awaitable[B]) -> tuple[A, B]:
    """Run two steps concurrently and wait for both to finish, whatever
    happens to either: a rollback must never race a step still in flight.
    The first step's error wins when both fail."""
    a, b = await asyncio.gather(first, second, return_exceptions=True)
    for result in (a, b):
        if isinstance(result, BaseException):
            raise result
    return a, b  # type: ignore[return-value]


class Ipam(Protocol):
    async def node(self, name: str) -> NodeInfo: ...

    async def allocate(
        self, node: str, container_id: str, ifname: str, pod: str, expiration_s: float
    ) -> list[Allocated]: ...

    async def commit(self, node: str, container_id: str, ifname: str) -> None: ...

    async def release(self, node: str, container_id: str, ifname: str) -> None: ...

    async def reconcile(self, node: str, valid: Sequence[tuple[str, str]]) -> list[str]: ...

    async def held(self, node: str) -> dict[str, tuple[str, str]]:
        """ip -> (container id, ifname) of the node's allocations."""

    async def claim(self, node: str, ip: str, container_id: str, ifname: str, pod: str) -> None:
        """Allocate this IP to this owner, committed (no expiration)."""


class Policy(Protocol):
    async def allocate_identity(
        self, labels: dict[str, str], node: str, owner: str
    ) -> tuple[int, int]:
        """(identity, revision of the reference): the node's datapath has the
        identity's policy once it has realized that revision."""

    async def release_identity(self, identity: int, node: str, owner: str) -> None: ...

    async def identity_of(self, labels: dict[str, str]) -> int:
        """The identity of a label set without allocating; 0 if none."""

    async def labels_of(self, identity: int) -> set[tuple[str, str, str]]:
        """The labels (source, key, value) of an identity."""

    async def upsert_ipcache(
        self,
        prefix: str,
        identity: int,
        node: str,
        host_ip: str,
        named_ports: Sequence[NamedPort] = (),
    ) -> None:
        """named_ports: the endpoint's (every node resolves egress rules
        naming a port against them)."""

    async def delete_ipcache(self, prefix: str, identity: int) -> None: ...


class Datapath(Protocol):
    async def setup(self, address: str, ep: Endpoint, pod_cidrs: Sequence[str]) -> SetupResult: ...

    async def teardown(self, address: str, ep: Endpoint) -> None: ...

    async def update_identity(self, address: str, endpoint_id: int, identity: int) -> None: ...

    async def update_named_ports(
        self, address: str, endpoint_id: int, named_ports: Sequence[NamedPort]
    ) -> None: ...

    async def update_options(
        self, address: str, endpoint_id: int, options: dict[str, str]
    ) -> None: ...

    async def wait_policy(
        self, address: str, endpoint_id: int, min_revision: int, timeout: float
    ) -> int: ...

    async def list_endpoints(self, address: str) -> list[RealizedEndpoint]: ...


class PodLabels(Protocol):
    async def labels(self, namespace: str, name: str) -> tuple[dict[str, str], list[NamedPort]]:
        """The identity labels and the named container ports of a pod, from
        Kubernetes."""


@dataclass(frozen=True)
class CreateRequest:
    container_id: str
    netns_path: str
    ifname: str
    node: str
    pod_name: str = ""
    pod_namespace: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    resolve_labels_from_kubernetes: bool = False
    mtu: int = 1500
    # Ignored when the labels come from Kubernetes (the Pod's spec has them).
    named_ports: tuple[NamedPort, ...] = ()


@dataclass(frozen=True)
class Settings:
    # An IP reserved for an ADD that never completes is freed after this.
    reservation_s: float = 120.0
    policy_wait_s: float = 20.0
    dns_nameservers: tuple[str, ...] = ()
    dns_search: tuple[str, ...] = ()


def owner_of(ep: Endpoint) -> str:
    """The identity-reference owner of an endpoint: its attachment."""
    return f"{ep.container_id}/{ep.ifname}"


def pod_of(ep: Endpoint) -> str:
    return f"{ep.pod_namespace}/{ep.pod_name}" if ep.pod_name else ""


def identity_labels(ep: Endpoint) -> dict[str, str]:
    """Pod labels (less those disabled for identity) plus the namespace
    label Kubernetes policies select on (labels from Kubernetes carry it
    already: flagella.endpoint.labels), plus the custom labels. Keys of
    another source than k8s keep it ("container:key"; a Kubernetes label key
    has no colon)."""
    disabled = set(ep.disabled_labels)
    labels = {k: v for k, v in ep.labels.items() if f"k8s:{k}" not in disabled}
    if ep.pod_namespace:
        labels.setdefault("io.kubernetes.pod.namespace", ep.pod_namespace)
    for key, value in ep.custom_labels.items():
        source, _, name = key.partition(":")
        labels[name if source == "k8s" else key] = value
    return labels


def relabelled_from(ep: Endpoint) -> int | None:
    """The identity a label change under way left, or None."""
    for step in ep.steps:
        if step.startswith(STEP_RELABEL):
            return int(step[len(STEP_RELABEL) :])
    return None


def without_relabel(steps: list[str]) -> list[str]:
    return [s for s in steps if not s.startswith(STEP_RELABEL)]


def record_health(ep: Endpoint) -> dict[str, str]:
    """The health of the components the endpoint's record shows: "ok" or
    what is wrong."""
    return {
        "ipam": "ok" if ep.addresses else "no address",
        "identity": "ok" if ep.identity else "no identity",
        "policy": "ok" if ep.policy_revision else "policy not realized",
    }


class EndpointService:
    def __init__(
        self,
        store: EndpointStore,
        ipam: Ipam,
        policy: Policy,
        datapath: Datapath,
        *,
        pod_labels: PodLabels | None = None,
        settings: Settings | None = None,
        fault_hook: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
        self.ipam = ipam
        self.policy = policy
        self.datapath = datapath
        self.pod_labels = pod_labels
        self.settings = settings or Settings()
        # Fault injection for crash tests: called after each create step.
        self.fault_hook = fault_hook
        # One operation at a time per attachment within this replica.
        self._locks = KeyedLocks()

    def _lock(self, container_id: str, ifname: str) -> contextlib.AbstractAsyncContextManager[None]:
        return self._locks((container_id, ifname))

    # --- create ---

    async def create(self, req: CreateRequest) -> Endpoint:
        async with self._lock(req.container_id, req.ifname):
            # Labels first: no side effect, and the identity intent needs them.
            labels, named_ports = await self._labels_for(req)
            for attempt in range(2):
                ep = self._new_endpoint(req, labels, named_ports)
                created, found, revision = await self.store.create(ep)
                if created:
                    return await self._create(found, revision)
                if found.node != req.node:
                    # Container ids are unique per runtime: this is a node
                    # naming another node's pod, which it may not touch.
                    raise FailedPrecondition(
                        f"attachment {req.container_id}/{req.ifname} is an endpoint of node "
                        f"{found.node}, not {req.node}",
                        field="container_id",
                    )
                if found.state is State.READY and found.netns_path == req.netns_path:
                    return found  # a repeated ADD: same answer
                if attempt:
                    break
                # A crashed or superseded ADD: undo it before starting over.
                await self._remove(found, "superseded by a new ADD")
            raise Aborted("another ADD of this attachment is in progress; try again")

    @staticmethod
    def _from_kubernetes(req: CreateRequest) -> bool:
        return req.resolve_labels_from_kubernetes and not req.labels

    async def _labels_for(self, req: CreateRequest) -> tuple[dict[str, str], list[NamedPort]]:
        if not self._from_kubernetes(req):
            return dict(req.labels), list(req.named_ports)
        if self.pod_labels is None:
            raise FailedPrecondition(
                "labels must be given: the endpoint service has no Kubernetes access",
                field="labels",
            )
        return await self.pod_labels.labels(req.pod_namespace, req.pod_name)

    def _new_endpoint(
        self, req: CreateRequest, labels: dict[str, str], named_ports: list[NamedPort]
    ) -> Endpoint:
        ep = Endpoint(
            id=0,
            container_id=req.container_id,
            ifname=req.ifname,
            netns_path=req.netns_path,
            node=req.node,
            pod_name=req.pod_name,
            pod_namespace=req.pod_namespace,
            labels=dict(labels),
            labels_from_kubernetes=self._from_kubernetes(req),
            named_ports=sorted(named_ports),
            mtu=req.mtu,
        )
        ep.transition(State.WAITING_FOR_IDENTITY, "CNI ADD")
        # The intents of the first two steps go with the record itself.
        ep.steps = [STEP_IPAM, STEP_IDENTITY]
        return ep

    async def _create(self, ep: Endpoint, revision: int) -> Endpoint:
        took = StepTimer()
        set_up = False
        try:
            node = await self.ipam.node(ep.node)
            took("node")
            allocated, (ep.identity, wanted) = await both(
                took.track(
                    "ipam",
                    self.ipam.allocate(
                        ep.node, ep.container_id, ep.ifname, pod_of(ep), self.settings.reservation_s
                    ),
                ),
                took.track(
                    "identity",
                    self.policy.allocate_identity(identity_labels(ep), ep.node, owner_of(ep)),
                ),
            )
            took("ipam+identity")
            await self._after(STEP_IPAM)
            await self._after(STEP_IDENTITY)
            ep.addresses = [
                f"{a.ip}/{32 if ipaddress.ip_address(a.ip).version == 4 else 128}"
                for a in allocated
            ]
            ep.transition(State.REGENERATING, f"identity {ep.identity}")
            ep.steps += [STEP_DATAPATH, STEP_IPCACHE]
            revision = await self.store.update(ep, revision)
            took("record")
            setup, _ = await both(
                took.track(
                    "datapath", self.datapath.setup(node.datapath_address, ep, node.pod_cidrs)
                ),
                took.track("ipcache", self._upsert_ipcache(ep, node)),
            )
            took("datapath+ipcache")
            ep.host_ifname, ep.mac = setup.host_ifname, setup.container_mac
            set_up = True
            await self._after(STEP_DATAPATH)
            await self._after(STEP_IPCACHE)
            ep.policy_revision, _ = await both(
                took.track(
                    "policy",
                    self.datapath.wait_policy(
                        node.datapath_address, ep.id, wanted, self.settings.policy_wait_s
                    ),
                ),
                took.track("commit", self.ipam.commit(ep.node, ep.container_id, ep.ifname)),
            )
            took("policy+commit")
            await self._after("policy")
            ep.result = self._cni_result(ep, setup)
            ep.transition(State.READY, f"policy revision {ep.policy_revision} realized")
            await self.store.update(ep, revision)
            took("ready")
        except BaseException as exc:
            reason = exc.details if isinstance(exc, FlagellaError) else repr(exc)
            # Another replica's restore rolled this ADD back under it (its
            # steps undone: the datapath's NotFound ...): a retry succeeds.
            # An endpoint the datapath set up for this ADD and no longer
            # knows was removed by such a restore, whose record write may
            # not have landed yet.
            vanished = set_up and isinstance(exc, NotFound)
            overtaken = isinstance(exc, FlagellaError) and (
                vanished or await self._overtaken(ep, revision)
            )
            log.warning(
                "endpoint create failed, rolling back",
                extra={"endpoint": ep.id, "container": ep.container_id, "reason": reason},
            )
            await asyncio.shield(self._remove(ep, f"create failed: {reason}"))
            if overtaken and not isinstance(exc, Aborted):
                raise Aborted(f"rolled back by another replica meanwhile ({reason})") from exc
            raise
        log.info(
            "endpoint ready",
            extra={
                "endpoint": ep.id,
                "container": ep.container_id,
                "identity": ep.identity,
                "addresses": ep.addresses,
                "took_ms": took.steps,
            },
        )
        return ep

    async def _overtaken(self, ep: Endpoint, revision: int) -> bool:
        """Whether someone else changed or removed ep's record since this
        replica wrote it at revision."""
        try:
            found = await self.store.get(ep.container_id, ep.ifname)
        except FlagellaError:
            return False  # unknown: the original error stands
        return found is None or found[1] != revision

    async def _upsert_ipcache(self, ep: Endpoint, node: NodeInfo) -> None:
        for address in ep.addresses:
            await self.policy.upsert_ipcache(
                address, ep.identity, ep.node, node.host_ip, ep.named_ports
            )

    async def _after(self, step: str) -> None:
        if self.fault_hook is not None:
            await self.fault_hook(step)

    def _cni_result(self, ep: Endpoint, setup: SetupResult) -> dict[str, object]:
        interfaces = [
            {"name": setup.host_ifname, "mac": setup.host_mac, "mtu": setup.mtu},
            {
                "name": ep.ifname,
                "mac": setup.container_mac,
                "mtu": setup.mtu,
                "sandbox": ep.netns_path,
            },
        ]
        ips = []
        for address in setup.addresses:
            version = ipaddress.ip_interface(address).version
            gateway = next(
                (g for g in setup.gateways if ipaddress.ip_address(g).version == version), ""
            )
            ips.append({"address": address, "gateway": gateway, "interface": 1})
        return {
            "interfaces": interfaces,
            "ips": ips,
            "routes": [{"dst": dst, "gw": gw} for dst, gw in setup.routes],
            "dns": {
                "nameservers": list(self.settings.dns_nameservers),
                "search": list(self.settings.dns_search),
            },
        }

    # --- delete ---

    async def delete(self, container_id: str, ifname: str, *, caller: str = "") -> bool:
        """caller: the caller's node, when the caller is one (CNI DEL); an
        endpoint of another node is not its to delete, and not there for it."""
        async with self._lock(container_id, ifname):
            found = await self.store.get(container_id, ifname)
            if found is None:
                return False
            if caller and found[0].node != caller:
                log.warning(
                    "DEL of another node's endpoint ignored",
                    extra={"container": container_id, "node": caller, "owner": found[0].node},
                )
                return False
            ep, revision = found
            if ep.state is not State.DISCONNECTING:
                # Recorded before any undo, so that another replica's restore
                # sees a removal under way, not a ready endpoint to redo.
                ep.transition(State.DISCONNECTING, "CNI DEL")
                await self.store.update(ep, revision)
            await self._remove(ep, "CNI DEL")
            return True

    async def delete_by_id(self, endpoint_id: int) -> bool:
        found = await self.store.get_by_id(endpoint_id)
        if found is None:
            return False
        return await self.delete(found[0].container_id, found[0].ifname)

    async def _remove(self, ep: Endpoint, reason: str) -> None:
        """Undo every recorded step (each undo is idempotent), then forget the
        endpoint. Raises Unavailable if a peer is down: the record stays and
        a retry (or GC) finishes the job."""
        if ep.state is not State.DISCONNECTING:
            ep.transition(State.DISCONNECTING, reason)
        steps = set(ep.steps)
        node: NodeInfo | None = None
        if STEP_DATAPATH in steps or STEP_IPCACHE in steps:
            try:
                node = await self.ipam.node(ep.node)
            except NotFound:
                node = None  # the node is gone, and its datapath with it
        if STEP_IPCACHE in steps:
            for address in ep.addresses:
                await self.policy.delete_ipcache(address, ep.identity)
        if STEP_DATAPATH in steps and node is not None:
            await self.datapath.teardown(node.datapath_address, ep)
        if STEP_IDENTITY in steps:
            # A crash right after the allocation leaves its id unrecorded:
            # find it by labels. Releasing by owner is exact (a no-op if this
            # owner never got a reference), so this never drops someone
            # else's reference.
            identity = ep.identity or await self.policy.identity_of(identity_labels(ep))
            if identity:
                await self.policy.release_identity(identity, ep.node, owner_of(ep))
        if STEP_IPAM in steps:
            # A node without pod CIDRs (NotFound) holds no address to release.
            with contextlib.suppress(NotFound):
                await self.ipam.release(ep.node, ep.container_id, ep.ifname)
        ep.transition(State.DISCONNECTED, reason)
        await self.store.delete(ep)

        log.info("endpoint removed", extra={"endpoint": ep.id, "reason": reason})

    # --- queries ---

    async def get(self, container_id: str, ifname: str) -> Endpoint:
        found = await self.store.get(container_id, ifname)
        if found is None:
            raise NotFound(f"no endpoint for {container_id}/{ifname}", field="attachment")
        return found[0]

    async def get_by_id(self, endpoint_id: int) -> Endpoint:
        found = await self.store.get_by_id(endpoint_id)
        if found is None:
            raise NotFound(f"no endpoint {endpoint_id}", field="id")
        return found[0]

    async def list_endpoints(
        self, node: str = "", namespace: str = "", state: State | None = None
    ) -> list[Endpoint]:
        return [
            ep
            for ep in await self.store.list_all()
            if (not node or ep.node == node)
            and (not namespace or ep.pod_namespace == namespace)
            and (state is None or ep.state is state)
        ]

    # --- labels ---

    async def patch_labels(
        self,
        endpoint_id: int,
        labels: dict[str, str] | None,
        *,
        from_kubernetes: bool = False,
        extra: LabelPatch | None = None,
    ) -> Endpoint:
        """The endpoint with these labels (None: its pod labels kept) and
        custom and disabled labels changed as extra says, moved to their
        identity. from_kubernetes: the labels are its pod's in Kubernetes
        (the watchers'); labels that follow Kubernetes change only that way."""
        found = await self.store.get_by_id(endpoint_id)
        if found is None:
            raise NotFound(f"no endpoint {endpoint_id}", field="id")
        async with self._lock(found[0].container_id, found[0].ifname):
            ep, revision = await self._fresh(found[0])
            before = (ep.labels, ep.custom_labels, ep.disabled_labels)
            if labels is None:
                labels = ep.labels
            elif ep.labels_from_kubernetes and not from_kubernetes:
                raise FailedPrecondition(
                    f"endpoint {ep.id}'s labels follow its pod {pod_of(ep)} in Kubernetes: "
                    "change them there",
                    field="labels",
                )
            if ep.state is not State.READY:
                raise FailedPrecondition(f"endpoint {ep.id} is {ep.state.value}, not ready")
            custom, disabled = (extra or LabelPatch()).applied(ep, labels)
            if (labels, custom, disabled) == before:
                return ep
            old_identity = ep.identity
            ep.labels, ep.custom_labels, ep.disabled_labels = dict(labels), custom, disabled
            new_identity, wanted = await self.policy.allocate_identity(
                identity_labels(ep), ep.node, owner_of(ep)
            )
            if new_identity == old_identity:
                return await self._save(ep, revision)
            # Cancelled too (a Kubernetes watcher's term can end mid-change),
            # each failure undoes what was done: never a pod half-switched.
            try:
                node = await self.ipam.node(ep.node)
                ep.identity = new_identity
                ep.steps.append(f"{STEP_RELABEL}{old_identity}")
                ep.transition(State.REGENERATING, f"labels changed: identity {new_identity}")
                revision = await self.store.update(ep, revision)
            except BaseException:
                # Nothing switched yet: only the new reference to drop.
                await asyncio.shield(
                    self.policy.release_identity(new_identity, ep.node, owner_of(ep))
                )
                raise
            try:
                await self.datapath.update_identity(node.datapath_address, ep.id, new_identity)
                for address in ep.addresses:
                    await self.policy.upsert_ipcache(
                        address, new_identity, ep.node, node.host_ip, ep.named_ports
                    )
                ep.policy_revision = await self.datapath.wait_policy(
                    node.datapath_address, ep.id, wanted, self.settings.policy_wait_s
                )
            except BaseException:
                ep.labels, ep.custom_labels, ep.disabled_labels = before
                await asyncio.shield(self._switch_back(ep, node, old_identity, revision))
                raise
            await self.policy.release_identity(old_identity, ep.node, owner_of(ep))
            ep.steps = without_relabel(ep.steps)
            ep.transition(State.READY, f"identity {new_identity} realized")
            return await self._save(ep, revision)

    async def label_sources(self, endpoint_id: int) -> LabelSources:
        """The endpoint's labels by source (Cilium's OpLabels): the pod's
        labels in its identity and those its identity leaves out (the
        policy service's label filter), custom, disabled."""
        ep = await self.get_by_id(endpoint_id)
        in_identity = await self.policy.labels_of(ep.identity) if ep.identity else set()
        return label_sources(ep, in_identity)

    async def patch_config(
        self, endpoint_id: int, values: dict[str, str], reset: Sequence[str]
    ) -> Endpoint:
        """The endpoint's runtime options changed: its datapath applies them
        (its policy written again), then its record keeps them."""
        found = await self.store.get_by_id(endpoint_id)
        if found is None:
            raise NotFound(f"no endpoint {endpoint_id}", field="id")
        async with self._lock(found[0].container_id, found[0].ifname):
            ep, revision = await self._fresh(found[0])
            options = {k: v for k, v in ep.options.items() if k not in reset} | values
            if options == ep.options:
                return ep
            if ep.state is not State.READY:
                raise FailedPrecondition(f"endpoint {ep.id} is {ep.state.value}, not ready")
            node = await self.ipam.node(ep.node)
            # The datapath first: a retry after a failed save applies again.
            await self.datapath.update_options(node.datapath_address, ep.id, options)
            ep.options = options
            return await self._save(ep, revision)

    async def patch_named_ports(self, endpoint_id: int, named_ports: list[NamedPort]) -> Endpoint:
        """The endpoint's named ports are these from now on (its pod's
        changed in Kubernetes): its record, its datapath (which rewrites
        the entries of rules naming a port: the endpoint's own ingress, and
        the egress of the node's endpoints to it) and its ipcache entries
        (every other node's egress)."""
        found = await self.store.get_by_id(endpoint_id)
        if found is None:
            raise NotFound(f"no endpoint {endpoint_id}", field="id")
        async with self._lock(found[0].container_id, found[0].ifname):
            ep, revision = await self._fresh(found[0])
            want = sorted(named_ports)
            if ep.state is not State.READY:
                raise FailedPrecondition(f"endpoint {ep.id} is {ep.state.value}, not ready")
            if ep.named_ports == want:
                return ep
            ep.named_ports = want
            node = await self.ipam.node(ep.node)
            await self.datapath.update_named_ports(node.datapath_address, ep.id, want)
            await self._upsert_ipcache(ep, node)
            return await self._save(ep, revision)

    async def _switch_back(
        self, ep: Endpoint, node: NodeInfo, old_identity: int, revision: int
    ) -> None:
        """Back to the old identity after a failed label change."""
        new_identity, ep.identity = ep.identity, old_identity
        await self.datapath.update_identity(node.datapath_address, ep.id, old_identity)
        for address in ep.addresses:
            await self.policy.upsert_ipcache(
                address, old_identity, ep.node, node.host_ip, ep.named_ports
            )
        await self.policy.release_identity(new_identity, ep.node, owner_of(ep))
        ep.steps = without_relabel(ep.steps)
        ep.transition(State.READY, "label change rolled back")
        await self.store.update(ep, revision)

    async def _finish_relabel(self, ep: Endpoint, old_identity: int) -> None:
        """After a restart: the label change a crash interrupted, done (its
        record holds the new labels and identity, both references held)."""
        ep, revision = await self._fresh(ep)
        node = await self.ipam.node(ep.node)
        await self.datapath.update_identity(node.datapath_address, ep.id, ep.identity)
        for address in ep.addresses:
            await self.policy.upsert_ipcache(
                address, ep.identity, ep.node, node.host_ip, ep.named_ports
            )
        await self.policy.release_identity(old_identity, ep.node, owner_of(ep))
        ep.steps = without_relabel(ep.steps)
        ep.transition(State.READY, "restore: label change finished")
        await self.store.update(ep, revision)

    async def _fresh(self, ep: Endpoint) -> tuple[Endpoint, int]:
        found = await self.store.get(ep.container_id, ep.ifname)
        if found is None:
            raise NotFound(f"no endpoint {ep.id}", field="id")
        return found

    async def _save(self, ep: Endpoint, revision: int) -> Endpoint:
        await self.store.update(ep, revision)
        return ep

    # --- check ---

    async def check(
        self, container_id: str, ifname: str, netns_path: str, *, caller: str = ""
    ) -> None:
        """caller: the caller's node, when the caller is one (CNI CHECK): it
        knows only its own endpoints."""
        ep = await self.get(container_id, ifname)
        if caller and ep.node != caller:
            raise NotFound(
                f"no endpoint for {container_id}/{ifname} on {caller}", field="attachment"
            )
        if ep.state is not State.READY:
            raise FailedPrecondition(f"endpoint {ep.id} is {ep.state.value}", field="attachment")
        if netns_path and netns_path != ep.netns_path:
            raise InvalidArgument(
                f"endpoint is in {ep.netns_path}, not {netns_path}", field="netns_path"
            )
        node = await self.ipam.node(ep.node)
        realized = {
            r.endpoint_id: r for r in await self.datapath.list_endpoints(node.datapath_address)
        }
        got = realized.get(ep.id)
        if got is None:
            raise FailedPrecondition(f"datapath of {ep.node} has no endpoint {ep.id}")
        if got.identity != ep.identity:
            raise FailedPrecondition(
                f"datapath has identity {got.identity} for endpoint {ep.id}, want {ep.identity}"
            )

    # --- health ---

    async def health(self, ep: Endpoint) -> dict[str, str]:
        """Per component: "ok" or what is wrong."""
        out = record_health(ep)
        try:
            node = await self.ipam.node(ep.node)
            realized = {
                r.endpoint_id: r for r in await self.datapath.list_endpoints(node.datapath_address)
            }
        except FlagellaError as exc:
            out["datapath"] = f"unreachable: {exc.details}"
            return out
        got = realized.get(ep.id)
        if got is None:
            out["datapath"] = f"endpoint missing on {ep.node}"
        elif got.identity != ep.identity:
            out["datapath"] = f"identity {got.identity} on the datapath, want {ep.identity}"
        else:
            out["datapath"] = "ok"
        return out

    # --- garbage collection and restore ---

    async def sweep(self, missing_since: dict[int, int]) -> list[Endpoint]:
        """Periodic GC: a ready endpoint whose node's datapath no longer has
        it (its netns, and with it the veth, is gone) in two sweeps in a row
        is removed with its IPs. missing_since carries the sweep count
        between calls."""
        removed: list[Endpoint] = []
        by_node: dict[str, list[Endpoint]] = {}
        for ep in await self.list_endpoints(state=State.READY):
            by_node.setdefault(ep.node, []).append(ep)
        seen_missing: set[int] = set()
        for node_name, eps in by_node.items():
            try:
                node = await self.ipam.node(node_name)
                present = {
                    r.endpoint_id for r in await self.datapath.list_endpoints(node.datapath_address)
                }
            except FlagellaError as exc:
                log.info("sweep skipped a node", extra={"node": node_name, "reason": exc.details})
                continue
            for ep in eps:
                if ep.id in present:
                    continue
                seen_missing.add(ep.id)
                if missing_since.get(ep.id, 0) >= 1:
                    async with self._lock(*ep.key):
                        await self._remove(ep, "sweep: container gone")
                    removed.append(ep)
                    seen_missing.discard(ep.id)
        for endpoint_id in list(missing_since):
            if endpoint_id not in seen_missing:
                del missing_since[endpoint_id]
        for endpoint_id in seen_missing:
            missing_since[endpoint_id] = missing_since.get(endpoint_id, 0) + 1
        return removed

    async def sweep_loop(self, interval: float) -> None:
        """sweep() every interval seconds, until cancelled."""
        missing: dict[int, int] = {}
        while True:
            await asyncio.sleep(interval)
            try:
                removed = await self.sweep(missing)
            except FlagellaError as exc:
                log.warning("endpoint sweep failed", extra={"reason": exc.details})
                continue
            if removed:
                log.info("sweep removed endpoints", extra={"ids": [ep.id for ep in removed]})

    async def garbage_collect(self, node: str, valid: Sequence[tuple[str, str]]) -> list[Endpoint]:
        """CNI GC: remove the node's endpoints not in valid, then release any
        IP of the node whose owner is not valid (an ADD that crashed before
        its record was written)."""
        keep = set(valid)
        removed = []
        for ep in await self.list_endpoints(node=node):
            if ep.key in keep:
                continue
            async with self._lock(*ep.key):
                await self._remove(ep, "CNI GC")
            removed.append(ep)
        await self.ipam.reconcile(
            node, [*keep, *(ep.key for ep in await self.list_endpoints(node=node))]
        )
        return removed

    async def restore(self) -> None:
        """After a restart: roll back every endpoint that was mid-operation
        (but finish a label change: its pod runs, and its record holds the
        new identity), then reconcile the ready ones against IPAM and their
        node's datapath.
        A ready endpoint's IPs are never released here: one IPAM lost is
        claimed again (the same address), one its datapath lost is set up
        again (or, when its netns is gone, left to the sweep)."""
        ready: dict[str, list[Endpoint]] = {}
        for ep in await self.store.list_all():
            if ep.state is State.READY:
                ready.setdefault(ep.node, []).append(ep)
                continue
            async with self._lock(*ep.key):
                try:
                    old_identity = relabelled_from(ep)
                    if old_identity is not None:
                        await self._finish_relabel(ep, old_identity)
                        continue
                    await self._remove(ep, f"restore: interrupted while {ep.state.value}")
                except FlagellaError as exc:
                    log.warning(
                        "restore could not roll back yet",
                        extra={"endpoint": ep.id, "reason": exc.details},
                    )
        for node_name, eps in ready.items():
            try:
                await self._reconcile_node(node_name, eps)
            except FlagellaError as exc:
                log.warning(
                    "restore could not reconcile a node yet",
                    extra={"node": node_name, "reason": exc.details},
                )

    async def _now(self, ep: Endpoint) -> Endpoint | None:
        """The attachment's endpoint in etcd now: another replica may be
        removing ep (DISCONNECTING), have removed it, or added a new one."""
        found = await self.store.get(ep.container_id, ep.ifname)
        return None if found is None else found[0]

    async def _reconcile_node(self, node_name: str, eps: list[Endpoint]) -> None:
        held = await self.ipam.held(node_name)
        node = await self.ipam.node(node_name)
        realized = {
            r.endpoint_id for r in await self.datapath.list_endpoints(node.datapath_address)
        }
        for ep in eps:
            async with self._lock(*ep.key):
                lost = [
                    a.split("/")[0]
                    for a in ep.addresses
                    if held.get(a.split("/")[0]) != (ep.container_id, ep.ifname)
                ]
                if not lost and ep.id in realized:
                    continue
                now = await self._now(ep)
                if now is None or now.id != ep.id or now.state is not State.READY:
                    continue
                for ip in lost:
                    log.warning("restore: reclaiming an IP ipam lost", extra={"ip": ip})
                    await self.ipam.claim(ep.node, ip, ep.container_id, ep.ifname, pod_of(ep))
                if ep.id not in realized:
                    try:
                        await self.datapath.setup(node.datapath_address, ep, node.pod_cidrs)
                        log.info(
                            "restore: endpoint set up again on its node", extra={"endpoint": ep.id}
                        )
                    except NotFound:
                        log.info(
                            "restore: endpoint's netns is gone; the sweep removes it",
                            extra={"endpoint": ep.id},
                        )
                now = await self._now(ep)
                if now is None or (now.id == ep.id and now.state is not State.READY):
                    # Another replica's DEL began meanwhile and may have undone
                    # its steps before ours: undo what was just redone (by
                    # owner: only while no new endpoint holds the attachment).
                    log.info("restore: endpoint removed meanwhile", extra={"endpoint": ep.id})
                    if ep.id not in realized:
                        await self.datapath.teardown(node.datapath_address, ep)
                    if lost:
                        await self.ipam.release(ep.node, ep.container_id, ep.ifname)
