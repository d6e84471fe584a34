"""The protobuf wire format (proto3) of the few flagella.endpoint.v1 messages
flagella-cni sends and reads, on the standard library: the plugin starts once
per CNI operation, and importing the protobuf runtime and the generated
descriptors costs more than the whole call. Field numbers are those of
proto/flagella/endpoint/v1/endpoint.proto; tests/unit/test_cni_wire.py checks
every encoder and decoder here against the generated classes."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

VARINT = 0
FIXED64 = 1
LEN = 2
FIXED32 = 5

# flagella.endpoint.v1.EndpointService
SERVICE = "/flagella.endpoint.v1.EndpointService/"


class WireError(Exception):
    """Bytes that are not the message they should be."""


# --- encoding ---


def varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int32/int64 negatives: ten bytes, two's complement
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return varint((field << 3) | wire_type)


def field_bytes(field: int, value: bytes) -> bytes:
    return _tag(field, LEN) + varint(len(value)) + value


def field_str(field: int, value: str) -> bytes:
    """A string field; proto3 leaves out the default (empty)."""
    return field_bytes(field, value.encode()) if value else b""


def field_uint(field: int, value: int) -> bytes:
    return _tag(field, VARINT) + varint(value) if value else b""


def field_bool(field: int, value: bool) -> bytes:
    return _tag(field, VARINT) + b"\x01" if value else b""


def field_message(field: int, body: bytes) -> bytes:
    """A singular message field: present even when empty."""
    return field_bytes(field, body)


def field_map(field: int, items: Mapping[str, str]) -> bytes:
    """map<string, string>: one entry message (key 1, value 2) per item,
    both written even when empty, as protobuf does."""
    return b"".join(
        field_bytes(field, field_bytes(1, key.encode()) + field_bytes(2, value.encode()))
        for key, value in items.items()
    )


def attachment(container_id: str, ifname: str) -> bytes:
    return field_str(1, container_id) + field_str(2, ifname)


def create_endpoint_request(
    *,
    container_id: str,
    netns_path: str,
    ifname: str,
    pod_name: str,
    pod_namespace: str,
    labels: Mapping[str, str],
    resolve_labels_from_kubernetes: bool,
    node: str,
    mtu: int,
) -> bytes:
    return b"".join(
        (
            field_str(1, container_id),
            field_str(2, netns_path),
            field_str(3, ifname),
            field_str(4, pod_name),
            field_str(5, pod_namespace),
            field_map(6, labels),
            field_bool(7, resolve_labels_from_kubernetes),
            field_str(8, node),
            field_uint(9, mtu),
        )
    )


def delete_endpoint_request(container_id: str, ifname: str) -> bytes:
    return field_message(2, attachment(container_id, ifname))  # oneof by: attachment


def check_endpoint_request(
    container_id: str, ifname: str, netns_path: str, prev_result_json: str
) -> bytes:
    return (
        field_message(1, attachment(container_id, ifname))
        + field_str(2, netns_path)
        + field_str(3, prev_result_json)
    )


def garbage_collect_request(node: str, valid: Iterable[tuple[str, str]]) -> bytes:
    return field_str(1, node) + b"".join(
        field_message(2, attachment(cid, ifname)) for cid, ifname in valid
    )


# --- decoding ---


def fields(data: bytes) -> dict[int, list[int | bytes]]:
    """Field number -> its values in order (ints for varint and fixed
    fields, bytes for length-delimited ones)."""
    out: dict[int, list[int | bytes]] = {}
    pos = 0
    end = len(data)
    while pos < end:
        key, pos = _read_varint(data, pos)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise WireError("field number 0")
        value: int | bytes
        if wire_type == VARINT:
            value, pos = _read_varint(data, pos)
        elif wire_type == LEN:
            length, pos = _read_varint(data, pos)
            if pos + length > end:
                raise WireError("truncated length-delimited field")
            value = data[pos : pos + length]
            pos += length
        elif wire_type == FIXED64:
            if pos + 8 > end:
                raise WireError("truncated fixed64")
            value = int.from_bytes(data[pos : pos + 8], "little")
            pos += 8
        elif wire_type == FIXED32:
            if pos + 4 > end:
                raise WireError("truncated fixed32")
            value = int.from_bytes(data[pos : pos + 4], "little")
            pos += 4
        else:
            raise WireError(f"wire type {wire_type} (groups are not used)")
        out.setdefault(field, []).append(value)
    return out


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = 0
    shift = 0
    while True:
        if pos >= len(data):
            raise WireError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7
        if shift >= 70:
            raise WireError("varint too long")


def _bytes_of(msg: dict[int, list[int | bytes]], field: int) -> list[bytes]:
    values = msg.get(field, [])
    for v in values:
        if not isinstance(v, bytes):
            raise WireError(f"field {field} is not length-delimited")
    return values  # type: ignore[return-value]


def _str(msg: dict[int, list[int | bytes]], field: int) -> str:
    values = _bytes_of(msg, field)
    return values[-1].decode() if values else ""  # last one wins


def _strs(msg: dict[int, list[int | bytes]], field: int) -> list[str]:
    return [v.decode() for v in _bytes_of(msg, field)]


def _uint(msg: dict[int, list[int | bytes]], field: int) -> int:
    values = msg.get(field, [])
    if not values:
        return 0
    value = values[-1]
    if not isinstance(value, int):
        raise WireError(f"field {field} is not a varint")
    return value


def _message(msg: dict[int, list[int | bytes]], field: int) -> dict[int, list[int | bytes]]:
    """A singular message field: its pieces merge (proto semantics)."""
    return fields(b"".join(_bytes_of(msg, field)))


def _map(msg: dict[int, list[int | bytes]], field: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for entry in _bytes_of(msg, field):
        kv = fields(entry)
        out[_str(kv, 1)] = _str(kv, 2)
    return out


def cni_result(data: bytes) -> dict[str, object]:
    """A CniResult as the CNI spec's result JSON (1.x shape), with what
    proto3 leaves unset left out as the plugin always did."""
    msg = fields(data)
    interfaces = []
    for raw in _bytes_of(msg, 2):
        iface = fields(raw)
        item: dict[str, object] = {"name": _str(iface, 1), "mac": _str(iface, 2)}
        mtu = _uint(iface, 4) & 0xFFFFFFFF
        if mtu:
            item["mtu"] = mtu
        sandbox = _str(iface, 3)
        if sandbox:
            item["sandbox"] = sandbox
        interfaces.append(item)
    ips = []
    for raw in _bytes_of(msg, 3):
        ip = fields(raw)
        entry: dict[str, object] = {
            "address": _str(ip, 1),
            "interface": _uint(ip, 3) & 0xFFFFFFFF,
        }
        gateway = _str(ip, 2)
        if gateway:
            entry["gateway"] = gateway
        ips.append(entry)
    routes = []
    for raw in _bytes_of(msg, 4):
        route = fields(raw)
        gw = _str(route, 2)
        routes.append({"dst": _str(route, 1), **({"gw": gw} if gw else {})})
    dns_msg = _message(msg, 5)
    dns: dict[str, object] = {}
    for key, field in (("nameservers", 1), ("domain", 2), ("search", 3), ("options", 4)):
        value: str | list[str] = _str(dns_msg, field) if key == "domain" else _strs(dns_msg, field)
        if value:
            dns[key] = value
    return {"interfaces": interfaces, "ips": ips, "routes": routes, "dns": dns}


def create_endpoint_result(data: bytes) -> dict[str, object]:
    """The CNI result of a CreateEndpointResponse (field 2)."""
    return cni_result(b"".join(_bytes_of(fields(data), 2)))


def endpoint_service_status(data: bytes) -> tuple[bool, dict[str, str]]:
    """EndpointServiceStatus: (ready, dependencies)."""
    msg = fields(data)
    return bool(_uint(msg, 1)), _map(msg, 2)
