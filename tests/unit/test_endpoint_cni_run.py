"""A relayed CNI invocation run by the endpoint service (flagella.endpoint.cnirun)
against fake peers (pure logic): what the plugin prints and its exit status,
the node taken from the caller and never from the config, and a node kept to
its own endpoints."""

from __future__ import annotations

import json
from typing import Any

from test_endpoint_orchestration import World, make

from flagella.endpoint.cnirun import CniRunner

CONF = {"cniVersion": "1.1.0", "name": "flagella", "type": "flagella-cni"}


def env(command: str, container_id: str = "c1") -> dict[str, str]:
    return {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": container_id,
        "CNI_NETNS": "/var/run/netns/pod",
        "CNI_IFNAME": "eth0",
        "CNI_ARGS": "K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-1",
    }


class Runner:
    def __init__(self, world: World, ready: bool = True) -> None:
        self.service, self.store = make(world)

        async def status() -> tuple[bool, dict[str, str]]:
            return ready, {} if ready else {"ipam": "not serving"}

        self.run = CniRunner(self.service, status)

    async def __call__(
        self, command: str, node: str, container_id: str = "c1", **conf: Any
    ) -> tuple[int, dict[str, Any]]:
        config = json.dumps({**CONF, "args": {"cni": {"labels": {"app": "web"}}}, **conf})
        out, status = await self.run(
            env(command, container_id), config.encode(), netns_exists=True, node=node
        )
        return status, json.loads(out) if out else {}


async def test_add_is_on_the_callers_node_and_answers_a_spec_result() -> None:
    world = World()
    run = Runner(world)
    status, result = await run("ADD", "n1")
    assert status == 0
    assert result["cniVersion"] == "1.1.0"
    assert [i.get("sandbox") for i in result["interfaces"]] == [None, "/var/run/netns/pod"]
    assert result["ips"] == [{"address": "10.0.0.5/32", "interface": 1, "gateway": "169.254.1.1"}]
    (ep,) = await run.service.list_endpoints()
    assert (ep.node, ep.pod_name, ep.labels) == ("n1", "web-1", {"app": "web"})
    assert await run("ADD", "n1") == (0, result)  # repeated: the same answer
    # An older cniVersion gets its own shape.
    status, old = await run("ADD", "n1", cniVersion="0.4.0")
    assert (status, old["cniVersion"], old["ips"][0]["version"]) == (0, "0.4.0", "4")


async def test_a_node_cannot_touch_another_nodes_endpoint() -> None:
    world = World()
    run = Runner(world)
    assert (await run("ADD", "n1"))[0] == 0
    status, err = await run("ADD", "n2")
    assert (status, err["code"], err["msg"]) == (1, 100, "ADD failed: FAILED_PRECONDITION")
    assert "is an endpoint of node n1, not n2" in err["details"]
    status, err = await run("CHECK", "n2", prevResult={})
    assert (status, err["code"]) == (1, 3)
    # DEL and GC of another node: nothing of n1's goes.
    assert await run("DEL", "n2") == (0, {})
    assert await run("GC", "n2", **{"cni.dev/valid-attachments": []}) == (0, {})
    assert [ep.node for ep in await run.service.list_endpoints()] == ["n1"]
    assert world.veths
    assert await run("DEL", "n1") == (0, {})
    assert await run.service.list_endpoints() == []


async def test_failures_map_to_spec_codes() -> None:
    world = World(fail_at="allocate")
    run = Runner(world)
    status, err = await run("ADD", "n1", cniVersion="1.0.0")
    assert (status, err["cniVersion"], err["code"]) == (1, "1.0.0", 11)
    assert err["details"] == "allocate down"
    world.fail_at = ""
    status, err = await run("ADD", "n1", args={"cni": {"labels": {"app": "no good"}}})
    assert (status, err["code"]) == (1, 7)
    assert err["msg"].startswith("labels['app']: 'no good' is not a valid label value")
    status, err = await run("ADD", "n1", mtu=100)
    assert (status, err["code"]) == (1, 7)


async def test_status_and_version() -> None:
    assert await Runner(World())("STATUS", "n1") == (0, {})
    status, err = await Runner(World(), ready=False)("STATUS", "n1")
    assert (status, err["code"], err["details"]) == (1, 50, "ipam: not serving")
    status, out = await Runner(World())("VERSION", "n1", cniVersion="0.4.0")
    assert (status, out["cniVersion"]) == (0, "0.4.0")
