"""flagella.cni.wire against the generated protobuf classes: what the plugin
encodes parses as the same message, what the endpoint service sends decodes
to what the plugin printed when it used the protobuf runtime, and garbage is
a WireError."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from flagella.api.endpoint.v1 import endpoint_pb2
from flagella.cni import wire

text = st.text(max_size=30)
labels = st.dictionaries(text, text, max_size=5)


@settings(max_examples=300, deadline=None)
@given(
    container_id=text,
    netns_path=text,
    ifname=text,
    pod_name=text,
    pod_namespace=text,
    labels=labels,
    k8s=st.booleans(),
    node=text,
    mtu=st.integers(0, 2**32 - 1),
)
def test_create_endpoint_request(
    container_id: str,
    netns_path: str,
    ifname: str,
    pod_name: str,
    pod_namespace: str,
    labels: dict[str, str],
    k8s: bool,
    node: str,
    mtu: int,
) -> None:
    raw = wire.create_endpoint_request(
        container_id=container_id,
        netns_path=netns_path,
        ifname=ifname,
        pod_name=pod_name,
        pod_namespace=pod_namespace,
        labels=labels,
        resolve_labels_from_kubernetes=k8s,
        node=node,
        mtu=mtu,
    )
    want = endpoint_pb2.CreateEndpointRequest(
        container_id=container_id,
        netns_path=netns_path,
        ifname=ifname,
        pod_name=pod_name,
        pod_namespace=pod_namespace,
        labels=labels,
        resolve_labels_from_kubernetes=k8s,
        node=node,
        mtu=mtu,
    )
    assert endpoint_pb2.CreateEndpointRequest.FromString(raw) == want
    if len(labels) <= 1:  # map order aside, the bytes are protobuf's own
        assert raw == want.SerializeToString()


@settings(max_examples=200, deadline=None)
@given(cid=text, ifname=text, netns=text, prev=text, node=text)
def test_delete_check_gc_requests(cid: str, ifname: str, netns: str, prev: str, node: str) -> None:
    attachment = endpoint_pb2.Attachment(container_id=cid, ifname=ifname)
    got = endpoint_pb2.DeleteEndpointRequest.FromString(wire.delete_endpoint_request(cid, ifname))
    assert got == endpoint_pb2.DeleteEndpointRequest(attachment=attachment)
    assert got.WhichOneof("by") == "attachment"
    assert endpoint_pb2.CheckEndpointRequest.FromString(
        wire.check_endpoint_request(cid, ifname, netns, prev)
    ) == endpoint_pb2.CheckEndpointRequest(
        attachment=attachment, netns_path=netns, prev_result_json=prev
    )
    assert endpoint_pb2.GarbageCollectRequest.FromString(
        wire.garbage_collect_request(node, [(cid, ifname), ("b", "net1")])
    ) == endpoint_pb2.GarbageCollectRequest(
        node=node,
        valid_attachments=[attachment, endpoint_pb2.Attachment(container_id="b", ifname="net1")],
    )


def result_json(result: endpoint_pb2.CniResult) -> dict[str, Any]:
    """What flagella-cni printed from a CniResult when it used the protobuf
    runtime (its former _result_json, less cniVersion)."""
    interfaces = []
    for iface in result.interfaces:
        item: dict[str, Any] = {"name": iface.name, "mac": iface.mac}
        if iface.mtu:
            item["mtu"] = iface.mtu
        if iface.sandbox:
            item["sandbox"] = iface.sandbox
        interfaces.append(item)
    ips = []
    for ip in result.ips:
        entry: dict[str, Any] = {"address": ip.address, "interface": ip.interface}
        if ip.gateway:
            entry["gateway"] = ip.gateway
        ips.append(entry)
    routes = [{"dst": r.dst, **({"gw": r.gw} if r.gw else {})} for r in result.routes]
    dns: dict[str, Any] = {}
    if result.dns.nameservers:
        dns["nameservers"] = list(result.dns.nameservers)
    if result.dns.domain:
        dns["domain"] = result.dns.domain
    if result.dns.search:
        dns["search"] = list(result.dns.search)
    if result.dns.options:
        dns["options"] = list(result.dns.options)
    return {"interfaces": interfaces, "ips": ips, "routes": routes, "dns": dns}


u32 = st.integers(0, 2**32 - 1)
interfaces = st.builds(endpoint_pb2.CniInterface, name=text, mac=text, sandbox=text, mtu=u32)
ips = st.builds(endpoint_pb2.CniIPConfig, address=text, gateway=text, interface=u32)
routes = st.builds(endpoint_pb2.CniRoute, dst=text, gw=text)
dns = st.builds(
    endpoint_pb2.CniDNS,
    nameservers=st.lists(text, max_size=3),
    domain=text,
    search=st.lists(text, max_size=3),
    options=st.lists(text, max_size=3),
)
results = st.builds(
    endpoint_pb2.CniResult,
    cni_version=text,
    interfaces=st.lists(interfaces, max_size=3),
    ips=st.lists(ips, max_size=3),
    routes=st.lists(routes, max_size=3),
    dns=st.one_of(st.none(), dns),
)


@settings(max_examples=300, deadline=None)
@given(result=results, endpoint_id=st.integers(0, 2**64 - 1), container=text)
def test_create_endpoint_response(
    result: endpoint_pb2.CniResult, endpoint_id: int, container: str
) -> None:
    resp = endpoint_pb2.CreateEndpointResponse(
        endpoint=endpoint_pb2.Endpoint(
            id=endpoint_id, container_id=container, labels={"a": "b"}, policy_revision=-1
        ),
        result=result,
    )
    assert wire.create_endpoint_result(resp.SerializeToString()) == result_json(result)


@settings(max_examples=200, deadline=None)
@given(ready=st.booleans(), deps=labels)
def test_endpoint_service_status(ready: bool, deps: dict[str, str]) -> None:
    raw = endpoint_pb2.EndpointServiceStatus(ready=ready, dependencies=deps).SerializeToString()
    assert wire.endpoint_service_status(raw) == (ready, deps)


def test_unknown_fields_of_every_wire_type_are_skipped() -> None:
    extra = (
        wire.varint((99 << 3) | wire.VARINT) + wire.varint(5)
        + wire.varint((98 << 3) | wire.FIXED64) + bytes(8)
        + wire.varint((97 << 3) | wire.FIXED32) + bytes(4)
        + wire.field_bytes(96, b"xyz")
    )  # fmt: skip
    raw = endpoint_pb2.EndpointServiceStatus(ready=True).SerializeToString() + extra
    assert wire.endpoint_service_status(raw) == (True, {})


def test_negative_int64_varint() -> None:
    assert wire.varint(-1) == b"\xff" * 9 + b"\x01"


@settings(max_examples=2000, deadline=None)
@given(data=st.binary(max_size=100))
def test_garbage_is_a_wire_error(data: bytes) -> None:
    try:
        wire.create_endpoint_result(data)
        wire.endpoint_service_status(data)
    except (wire.WireError, UnicodeDecodeError):
        pass
