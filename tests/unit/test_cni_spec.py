"""CNI spec handling of flagella-cni's invocations (in the endpoint service):
environment, network config, error codes and result shapes (pure logic)."""

from __future__ import annotations

import json
import os

import pytest

from flagella.cni import CniError
from flagella.endpoint import cni as spec

CONF = {
    "cniVersion": "1.1.0",
    "name": "flagella",
    "type": "flagella-cni",
    "socket": "/run/flagella/cni.sock",
}
ENV = {
    "CNI_COMMAND": "ADD",
    "CNI_CONTAINERID": "c1",
    "CNI_NETNS": "/proc/self/ns/net",
    "CNI_IFNAME": "eth0",
}


def parse(env: dict[str, str], conf: object) -> spec.Invocation:
    data = conf if isinstance(conf, bytes) else json.dumps(conf).encode()
    # The node's datapath tells whether the netns exists: here, this machine.
    exists = os.path.exists(env.get("CNI_NETNS", ""))
    return spec.parse_invocation(env, data, netns_exists=exists)


def test_add_invocation() -> None:
    conf = {**CONF, "mtu": 1400, "args": {"cni": {"labels": {"app": "web"}}}}
    env = {**ENV, "CNI_ARGS": "K8S_POD_NAME=web-1;K8S_POD_NAMESPACE=shop;IgnoreUnknown=1"}
    inv = parse(env, conf)
    assert (inv.command, inv.container_id, inv.ifname) == ("ADD", "c1", "eth0")
    assert (inv.pod_name, inv.pod_namespace) == ("web-1", "shop")
    assert inv.conf.labels == {"app": "web"}
    assert inv.conf.mtu == 1400


@pytest.mark.parametrize(
    ("env", "conf", "code", "msg"),
    [
        ({**ENV, "CNI_CONTAINERID": ""}, CONF, 4, "CNI_CONTAINERID not set (required for ADD)"),
        ({k: v for k, v in ENV.items() if k != "CNI_IFNAME"}, CONF, 4, "CNI_IFNAME not set"),
        (
            {**ENV, "CNI_NETNS": "/run/netns/does-not-exist"},
            CONF,
            4,
            "CNI_NETNS /run/netns/does-not-exist does not exist",
        ),
        (
            {**ENV, "CNI_IFNAME": "a-very-long-interface-name"},
            CONF,
            4,
            "CNI_IFNAME 'a-very-long-interface-name'",
        ),
        ({**ENV, "CNI_COMMAND": "BOGUS"}, CONF, 4, "CNI_COMMAND 'BOGUS' is not one of"),
        ({**ENV, "CNI_COMMAND": ""}, CONF, 4, "CNI_COMMAND is not set"),
        ({**ENV, "CNI_ARGS": "novalue"}, CONF, 4, "CNI_ARGS: malformed pair 'novalue'"),
        (ENV, b"{not json", 6, "network config: not valid JSON"),
        (ENV, b"[1]", 6, "network config: not a JSON object"),
        (ENV, {**CONF, "cniVersion": "9.9.9"}, 1, "cniVersion 9.9.9 is not supported"),
        (ENV, {k: v for k, v in CONF.items() if k != "cniVersion"}, 7, "cniVersion is missing"),
        (ENV, {**CONF, "name": ""}, 7, "network config: name must be a non-empty string"),
        (ENV, {**CONF, "mtu": 70000}, 7, "network config: mtu 70000 is not in 576..65535"),
        (
            ENV,
            {**CONF, "args": {"cni": {"labels": {"a": 1}}}},
            7,
            "args.cni.labels must map strings",
        ),
        ({**ENV, "CNI_COMMAND": "CHECK"}, CONF, 7, "CHECK needs prevResult"),
        # The plugin talks only to its node: no address, no node of its own.
        (ENV, {**CONF, "endpoint": "10.0.0.1:50053"}, 7, "endpoint is not used any more"),
        (ENV, {**CONF, "node": "node-b"}, 7, "node is not used any more"),
        (ENV, {**CONF, "socket": "cni.sock"}, 7, "socket must be an absolute path"),
        ({"CNI_COMMAND": "GC"}, {**CONF, "cniVersion": "1.0.0"}, 1, "GC needs cniVersion 1.1.0"),
        (
            {"CNI_COMMAND": "GC"},
            {**CONF, "cni.dev/valid-attachments": [{"containerID": "x"}]},
            7,
            "cni.dev/valid-attachments[0].ifname must be a non-empty string",
        ),
    ],
)
def test_errors_carry_spec_codes(env: dict[str, str], conf: object, code: int, msg: str) -> None:
    with pytest.raises(CniError) as err:
        parse(env, conf)
    assert err.value.code == code
    assert msg in err.value.msg


def test_del_needs_no_netns_and_gc_reads_valid_attachments() -> None:
    inv = parse({"CNI_COMMAND": "DEL", "CNI_CONTAINERID": "c1", "CNI_IFNAME": "eth0"}, CONF)
    assert inv.netns == ""
    gc = parse(
        {"CNI_COMMAND": "GC"},
        {
            **CONF,
            "cni.dev/valid-attachments": [
                {"containerID": "a", "ifname": "eth0"},
                {"containerID": "b", "ifname": "net1"},
            ],
        },
    )
    assert gc.conf.valid_attachments == (spec.Attachment("a", "eth0"), spec.Attachment("b", "net1"))


def test_result_conversion_for_old_versions() -> None:
    result = {
        "cniVersion": "1.1.0",
        "interfaces": [],
        "ips": [
            {"address": "10.0.0.5/32", "gateway": "169.254.1.1", "interface": 1},
            {"address": "fd00::5/128", "gateway": "fe80::1", "interface": 1},
        ],
        "routes": [],
        "dns": {},
    }
    old = spec.convert_result(result, "0.3.1")
    assert old["cniVersion"] == "0.3.1"
    assert [ip["version"] for ip in old["ips"]] == ["4", "6"]
    assert "version" not in spec.convert_result(result, "1.0.0")["ips"][0]


def test_error_json_and_requested_version() -> None:
    err = CniError(11, "try again later", "etcd down")
    assert err.to_json("0.4.0") == {
        "cniVersion": "0.4.0",
        "code": 11,
        "msg": "try again later",
        "details": "etcd down",
    }
    assert spec.requested_version(b'{"cniVersion": "0.4.0"}') == "0.4.0"
    assert spec.requested_version(b"garbage") == "1.1.0"
