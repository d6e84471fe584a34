"""Fuzzing flagella's RPCs from their descriptors: a hypothesis strategy for
any protobuf message (every field kind, extreme and malformed values, shaped
by the field's name), every method of every service of `flagella.api`
enumerated from the generated modules (a new RPC or field is fuzzed without
a line here), and the call that checks what a fuzzed request may do: end
with a deliberate status within its deadline, name the field it refuses,
and leave nothing behind when refused."""

from __future__ import annotations

import asyncio
import importlib
import os
import pkgutil
import re
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from harness import tls
from harness.cluster import Cluster
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import flagella.api
from flagella.common import authz, pki
from flagella.common.pki import Identity

#: Examples per RPC: enough to reach every field in CI; raise it for a long
#: local run (FLAGELLA_FUZZ_EXAMPLES=500).
EXAMPLES = int(os.environ.get("FLAGELLA_FUZZ_EXAMPLES", "25"))
#: A call's deadline: a handler that cannot answer in this long is a bug.
DEADLINE_S = 5.0
#: How long a stream may stay silent after its start and count as accepted
#: (a watch with nothing to say yet).
STREAM_QUIET_S = 0.3
MAX_DEPTH = 3
HUGE = 1 << 20  # 1 MiB

I32 = (-(2**31), 2**31 - 1)
I64 = (-(2**63), 2**63 - 1)
U32 = (0, 2**32 - 1)
U64 = (0, 2**64 - 1)
F = FieldDescriptor
INT_RANGES = {
    F.TYPE_INT32: I32,
    F.TYPE_SINT32: I32,
    F.TYPE_SFIXED32: I32,
    F.TYPE_INT64: I64,
    F.TYPE_SINT64: I64,
    F.TYPE_SFIXED64: I64,
    F.TYPE_UINT32: U32,
    F.TYPE_FIXED32: U32,
    F.TYPE_UINT64: U64,
    F.TYPE_FIXED64: U64,
}

# --- values shaped by a field's name ---

IPS = [
    "10.0.0.1",
    "10.200.0.5",
    "0.0.0.0",
    "255.255.255.255",
    "127.0.0.1",
    "192.168.101.1",
    "fd00::1",
    "::",
    "::1",
    "fe80::1",
    "2001:db8::ff",
    "::ffff:10.0.0.1",
]
CIDRS = [
    "10.0.0.0/8",
    "10.200.0.0/16",
    "10.200.1.0/24",
    "0.0.0.0/0",
    "10.0.0.1/32",
    "fd00::/64",
    "::/0",
    "2001:db8::/32",
    "fd00::1/128",
    "10.0.0.1/24",
    "fd00::1/64",
]
BAD_IPS = [
    "1.2.3",
    "256.1.1.1",
    "1.2.3.4.5",
    "01.2.3.4",
    "::g",
    ":::",
    "1::2::3",
    " 10.0.0.1",
    "10.0.0.1 ",
    "10.0.0.1\x00",
    "fe80::1%eth0",
    "10.0.0.0/-1",
    "10.0.0.0/33",
    "fd00::/129",
    "10.0.0.0/",
    "/24",
    "10.0.0.0/24/24",
    "10.0.0.0/ 8",
    "1.2.3.4/08",
    "localhost",
    "10.0.0.1:80",
    "[::1]",
    "٣.٣.٣.٣",
]
NAMES = [
    "n1",
    "web",
    "a-b",
    "a.b",
    "kube-system",
    "default",
    "a" * 63,
    "a" * 64,
    "a" * 254,
    "-a",
    "a-",
    "A",
    "a_b",
    "a b",
    "a/b",
    "..",
    "0",
    "é",
]
LABELS = [
    "app",
    "app=web",
    "k8s:app=web",
    "k8s:io.kubernetes.pod.namespace=default",
    "reserved:host",
    "reserved:world",
    "cidr:10.0.0.0/8",
    "any:app",
    "a/b=c",
    "=",
    "=x",
    "app=",
    "k8s:",
    ":",
    "a" * 64 + "=b",
    "app=" + "v" * 64,
    "-bad=x",
    "app=web=x",
    "k8s:app=web,role=db",
    "app in (a,b)",
    "app!=web",
    "!app",
]
ODD = [
    "",
    " ",
    "\x00",
    "a\x00b",
    "\u202eevil",
    "\u200b",
    "\ufeff",
    "💥",
    "\U0010fffd",
    "ß",
    "İ",
    "\n",
    "\t",
    "../../etc/passwd",
    "%s%n",
    "{}",
    "null",
    "*",
]


def _huge(s: str) -> st.SearchStrategy[str]:
    return st.just(s * (HUGE // len(s)))


def text(big: bool = True) -> st.SearchStrategy[str]:
    """Any string: empty, huge (when big), odd code points (NUL, RTL, zero
    width, astral), short random unicode (never surrogates: not UTF-8)."""
    small = st.one_of(st.sampled_from(ODD), st.text(max_size=24))
    return st.one_of(small, _huge("x"), _huge("é")) if big else small


def string_for(name: str, big: bool) -> st.SearchStrategy[str]:
    """A string shaped by the field's name, valid and malformed alike."""
    n = name.lower()
    shaped: list[st.SearchStrategy[str]] = []
    if any(k in n for k in ("address", "cidr", "ip", "prefix", "peer", "gateway", "subnet")):
        shaped += [st.sampled_from(IPS + CIDRS), st.sampled_from(BAD_IPS)]
    if "label" in n or "selector" in n or n in ("key", "value", "source"):
        shaped += [st.sampled_from(LABELS)]
    if "port" in n or "protocol" in n:
        shaped += [
            st.sampled_from(
                [
                    "80",
                    "0",
                    "65535",
                    "65536",
                    "-1",
                    "http",
                    "TCP",
                    "UDP",
                    "SCTP",
                    "ICMP",
                    "tcp",
                    "any",
                    "80-90",
                ]
            )
        ]
    if n in (
        "name",
        "namespace",
        "node",
        "node_name",
        "pod",
        "pod_name",
        "id",
        "endpoint",
        "endpoint_id",
        "container_id",
        "ifname",
        "interface",
        "map",
        "owner",
    ):
        shaped += [st.sampled_from(NAMES)]
    if not shaped:
        return text(big)
    # The shaped values most of the time: they get past the first check.
    return st.one_of(*shaped, *shaped, text(big))


def int_for(name: str, lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [v for v in (0, -1, 1, lo, hi, lo + 1, hi - 1) if lo <= v <= hi]
    if "port" in name.lower():
        edges += [v for v in (80, 65535, 65536, 70000) if lo <= v <= hi]
    return st.one_of(
        st.sampled_from(edges),
        st.integers(lo, hi),
        st.integers(-300, 300).filter(lambda v: lo <= v <= hi),
    )


def scalar(fd: FieldDescriptor, name: str, big: bool) -> st.SearchStrategy[Any]:
    if fd.type in INT_RANGES:
        return int_for(name, *INT_RANGES[fd.type])
    if fd.type == F.TYPE_BOOL:
        return st.booleans()
    if fd.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        width = 32 if fd.type == F.TYPE_FLOAT else 64
        return st.one_of(
            st.sampled_from([0.0, -0.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e300]),
            st.floats(width=width),
        )
    if fd.type == F.TYPE_STRING:
        return string_for(name, big)
    if fd.type == F.TYPE_BYTES:
        small = st.binary(max_size=40)
        return st.one_of(small, st.just(b"\xff" * HUGE)) if big else small
    if fd.type == F.TYPE_ENUM:
        known = [v.number for v in fd.enum_type.values]
        return st.one_of(st.sampled_from(known), st.sampled_from([-1, 99, 2**31 - 1]))
    raise AssertionError(f"unhandled field type {fd.type} of {fd.full_name}")


def _single(fd: FieldDescriptor, name: str, depth: int, big: bool) -> st.SearchStrategy[Any]:
    if fd.type == F.TYPE_MESSAGE:
        return message(fd.message_type, depth + 1)
    return scalar(fd, name, big)


def field_value(fd: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    """Huge values (1 MiB strings, a thousand-element list) only in the
    request's own fields, and never one inside another: a request stays
    within a few MiB, gRPC's default limit, and in memory."""
    big = depth == 0
    if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
        key_fd = fd.message_type.fields_by_name["key"]
        val_fd = fd.message_type.fields_by_name["value"]
        # A map's keys and values take the shape of the map's name (labels).
        keys = _single(key_fd, fd.name, depth, False)
        values = _single(val_fd, fd.name, depth, False)
        return st.dictionaries(keys, values, max_size=4)
    if fd.is_repeated:
        elem = _single(fd, fd.name, depth, False)
        short = st.lists(elem, max_size=4)
        # A long list: the same element a thousand times (cheap to draw).
        return st.one_of(short, elem.map(lambda e: [e] * 1000)) if big else short
    return _single(fd, fd.name, depth, big)


def _set(msg: Message, fd: FieldDescriptor, value: Any) -> None:
    target = getattr(msg, fd.name)
    if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
        for k, v in value.items():
            if isinstance(v, Message):
                target[k].CopyFrom(v)
            else:
                target[k] = v
    elif fd.is_repeated:
        if fd.type == F.TYPE_MESSAGE:
            for v in value:
                target.add().CopyFrom(v)
        else:
            target.extend(value)
    elif fd.type == F.TYPE_MESSAGE:
        target.CopyFrom(value)
    else:
        setattr(msg, fd.name, value)


def message(desc: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Any message of this type: each field present or not; of a oneof, one
    member or none; nested messages down to MAX_DEPTH, empty below."""
    cls = message_factory.GetMessageClass(desc)
    if depth >= MAX_DEPTH:
        return st.just(cls())
    real_oneofs = [o for o in desc.oneofs if not _synthetic(o)]
    in_oneof = {fd.name for o in real_oneofs for fd in o.fields}
    free = {
        fd.name: st.deferred(lambda fd=fd: field_value(fd, depth))
        for fd in desc.fields
        if fd.name not in in_oneof
    }
    choices = [
        st.one_of(st.none(), *(st.tuples(st.just(fd), field_value(fd, depth)) for fd in o.fields))
        for o in real_oneofs
    ]

    def build(parts: tuple[dict[str, Any], list[Any]]) -> Message:
        values, chosen = parts
        msg = cls()
        for name, value in values.items():
            _set(msg, desc.fields_by_name[name], value)
        for pick in chosen:
            if pick is not None:
                _set(msg, pick[0], pick[1])
        return msg

    return st.tuples(st.fixed_dictionaries({}, optional=free), st.tuples(*choices).map(list)).map(
        build
    )


def _synthetic(oneof: Any) -> bool:
    # proto3 `optional` makes a oneof of one field: not a real choice.
    return bool(getattr(oneof, "is_synthetic", False)) or (
        len(oneof.fields) == 1 and oneof.name == "_" + oneof.fields[0].name
    )


# --- every method of every service ---


@dataclass(frozen=True)
class Method:
    service: str  # the flagella service that serves it: "ipam", ..., "relay"
    path: str  # "/flagella.ipam.v1.IpamService/RegisterNode"
    request: type[Message]
    response: type[Message]
    streaming: bool

    @property
    def id(self) -> str:
        return self.path.rsplit(".", 1)[-1]


def methods() -> list[Method]:
    """Every RPC of every service of every generated `*_pb2` module."""
    found = []
    for info in pkgutil.walk_packages(flagella.api.__path__, "flagella.api."):
        if not info.name.endswith("_pb2"):
            continue
        module = importlib.import_module(info.name)
        for svc in module.DESCRIPTOR.services_by_name.values():
            if not svc.full_name.startswith("flagella."):
                continue  # GoBGP's API (apipb): flagella only calls it
            for m in svc.methods:
                assert not m.client_streaming, f"{m.full_name}: client streams are not fuzzed yet"
                found.append(
                    Method(
                        service=svc.full_name.split(".")[1],
                        path=f"/{svc.full_name}/{m.name}",
                        request=message_factory.GetMessageClass(m.input_type),
                        response=message_factory.GetMessageClass(m.output_type),
                        streaming=m.server_streaming,
                    )
                )
    return sorted(found, key=lambda m: m.path)


# --- who calls: an identity the authorization table lets through ---

NODE = "n1"


def caller(method: Method) -> tuple[Identity, str | None]:
    """The identity to call as, so that authorization is not what refuses a
    fuzzed call, and the request field (if any) that must name its node."""
    grants = authz.TABLE[method.path]
    kinds = {g.kind: g for g in grants}
    if "operator" in kinds:
        return tls.OPERATOR, None
    for g in grants:
        if g.kind == "service":
            return pki.service(g.arg), None
    if "own-node" in kinds:
        return pki.node(NODE), kinds["own-node"].arg
    return pki.node(NODE), None  # "node", "node-of"


def request_strategy(method: Method) -> st.SearchStrategy[Message]:
    """Fuzzed requests; for a method a node may call for itself only, the
    node field names the caller's node most of the time (else authz refuses
    before anything else looks)."""
    _, node_field = caller(method)
    base = message(method.request.DESCRIPTOR)
    if node_field is None:
        return base

    def own(msg: Message, keep: bool) -> Message:
        if not keep:
            setattr(msg, node_field, NODE)
        return msg

    return st.builds(own, base, st.sampled_from([False, False, False, True]))


# --- the call and what it must do ---

#: Statuses a fuzzed call may end with. UNAVAILABLE is not here: a method
#: that may answer it says why in its service's `unavailable` table.
DELIBERATE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
}
# "<field path>: <reason>", as the bootstrap formats a domain error; a
# path's index is a number, a key or a quoted key (of any characters).
_INDEX = r"""\[('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\[\]]*)\]"""
_STEP = rf"[A-Za-z_]\w*(?:{_INDEX})*"
FIELD_DETAILS = re.compile(rf"^{_STEP}(?:\.{_STEP})*: \S", re.DOTALL)
# Refusals made before a service's own code looks, which name no field:
# the server's gRPC refusing a request over its size limit, the authorizer
# (it names the method, and the request field a node may not name).
NO_FIELD = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: re.compile(r"^Received message larger than max "),
    grpc.StatusCode.PERMISSION_DENIED: re.compile(r"^spiffe://\S+ may not call /\S+: \S"),
}


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str


Snapshot = Callable[[], Awaitable[Any]]


@dataclass
class Fuzzer:
    """Calls methods over channels it opens (one per process and identity)
    and checks every outcome; `snapshots` are read before and after each
    call and must agree whenever the call was refused."""

    addresses: Mapping[str, str]  # flagella service -> address
    snapshots: list[Snapshot]
    unavailable: Mapping[str, str] = field(default_factory=dict)  # path -> why allowed
    _channels: dict[tuple[str, str], grpc.aio.Channel] = field(default_factory=dict)
    _last: list[Any] | None = None

    def channel(self, service: str, identity: Identity) -> grpc.aio.Channel:
        key = (service, f"{identity.kind}/{identity.name}")
        if key not in self._channels:
            self._channels[key] = tls.session().aio_channel(self.addresses[service], identity)
        return self._channels[key]

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()

    async def call(self, method: Method, request: Message) -> Outcome:
        identity, _ = caller(method)
        ch = self.channel(method.service, identity)
        ser, de = type(request).SerializeToString, method.response.FromString
        try:
            if not method.streaming:
                await ch.unary_unary(method.path, ser, de)(request, timeout=DEADLINE_S)
                return Outcome(grpc.StatusCode.OK, "")
            call = ch.unary_stream(method.path, ser, de)(request)
            try:
                await asyncio.wait_for(call.read(), STREAM_QUIET_S)
            except TimeoutError:
                pass  # open and quiet: accepted
            finally:
                call.cancel()
            return Outcome(grpc.StatusCode.OK, "")
        except grpc.aio.AioRpcError as exc:
            return Outcome(exc.code(), exc.details() or "")

    async def check(self, method: Method, request: Message) -> Outcome:
        """One fuzzed call, checked."""
        # A refused call's "after" is the next call's "before" (it changed nothing).
        before = self._last if self._last is not None else [await s() for s in self.snapshots]
        self._last = None
        out = await self.call(method, request)
        allowed = DELIBERATE | (
            {grpc.StatusCode.UNAVAILABLE} if method.path in self.unavailable else set()
        )
        assert out.code in allowed, f"{method.path} -> {out.code.name}: {out.details}"
        if out.code == grpc.StatusCode.OK:
            return out
        exempt = NO_FIELD.get(out.code)
        assert FIELD_DETAILS.match(out.details) or (exempt and exempt.match(out.details)), (
            f"{method.path} -> {out.code.name} names no field: {out.details[:2000]!r}"
        )
        after = [await s() for s in self.snapshots]
        for b, a in zip(before, after, strict=True):
            assert a == b, (
                f"{method.path} refused ({out.code.name}: {out.details}) but changed:\n"
                + diff(b, a)
            )
        self._last = after
        return out


def diff(before: Any, after: Any) -> str:
    if not isinstance(before, dict) or not isinstance(after, dict):
        return f"before {before!r}\nafter {after!r}"
    lines = [f"- {k}" for k in before.keys() - after.keys()]
    lines += [f"+ {k}" for k in after.keys() - before.keys()]
    lines += [f"~ {k}" for k in before.keys() & after.keys() if before[k] != after[k]]
    return "\n".join(sorted(lines)[:40])


def of_service(service: str) -> Iterator[Method]:
    return (m for m in methods() if m.service == service)


def run(
    fuzzer: Fuzzer,
    loop: asyncio.AbstractEventLoop,
    method: Method,
    regressions: Mapping[str, list[Message]],
) -> None:
    """EXAMPLES fuzzed requests to method, and first the regression examples
    (requests that once found a bug) recorded for it."""

    def one(request: Message) -> None:
        loop.run_until_complete(fuzzer.check(method, request))

    for request in regressions.get(method.path, []):
        assert isinstance(request, method.request), f"{method.path}: regression of another type"
        one = example(request=request)(one)
    test = settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )(given(request=request_strategy(method))(one))
    test()


#: Methods that may answer UNAVAILABLE to a fuzzed call, and why that is the truth.
UNAVAILABLE: dict[str, str] = {}


@dataclass
class Plane:
    """Processes under fuzzing, the fuzzer calling them, the loop it runs on."""

    cluster: Cluster
    fuzzer: Fuzzer
    loop: asyncio.AbstractEventLoop


def stop_followers_first(cluster: Cluster) -> None:
    """Stops the services, each before those it follows: lb waits out its
    5 s grace for the policy service's open watch if it goes first."""
    for svc in ("relay", "endpoint", "policy", "lb", "ipam"):
        if svc in cluster.services:
            cluster.services[svc].stop()
