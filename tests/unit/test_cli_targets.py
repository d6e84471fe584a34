"""Where the CLI looks for the suite: addresses from the environment of a
flagella container or pod (compose's and the manifests' variables), and the
datapath a one-node command picks from the node registry."""

from __future__ import annotations

import pytest

from flagella.cli.targets import default_address, local_address, pick_one


def test_the_operators_variable_wins() -> None:
    env = {"FLAGELLA_IPAM_ADDRESS": "10.0.0.5:50051", "FLAGELLA_IPAM_LISTEN": "0.0.0.0:50051"}
    assert default_address("ipam", env) == "10.0.0.5:50051"


def test_compose_containers_reach_the_suite() -> None:
    # The ipam container: its own service on loopback.
    assert default_address("ipam", {"FLAGELLA_IPAM_LISTEN": "0.0.0.0:50051"}) == "127.0.0.1:50051"
    assert default_address("ipam", {"FLAGELLA_IPAM_LISTEN": "[::]:7"}) == "[::1]:7"
    # The datapath container: the peers it was given.
    env = {
        "FLAGELLA_DATAPATH_LISTEN": "172.29.0.1:50055",
        "FLAGELLA_DATAPATH_IPAM_ADDRESS": "",
        "FLAGELLA_DATAPATH_POLICY_ADDRESS": "policy:50052",
        "FLAGELLA_DATAPATH_ENDPOINT_ADDRESS": "endpoint:50053",
    }
    assert default_address("policy", env) == "policy:50052"
    assert default_address("endpoint", env) == "endpoint:50053"
    # An empty peer address (no registration) is no address.
    assert default_address("ipam", env) == "127.0.0.1:50051"


def test_kubernetes_service_variables() -> None:
    env = {"LB_SERVICE_HOST": "10.96.0.14", "LB_SERVICE_PORT": "50054"}
    assert default_address("lb", env) == "10.96.0.14:50054"
    assert default_address("lb", {"LB_SERVICE_HOST": "fd00::e", "LB_SERVICE_PORT": "1"}) == (
        "[fd00::e]:1"
    )


def test_a_headless_service_in_a_pod_is_found_by_its_name() -> None:
    # The kubelet gives a headless Service no variables; its name resolves
    # to every replica.
    pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "RELAY_SERVICE_HOST": "10.96.0.20",
           "RELAY_SERVICE_PORT": "50056"}  # fmt: skip
    assert default_address("ipam", pod) == "ipam:50051"
    assert default_address("relay", pod) == "10.96.0.20:50056"
    assert default_address("ipam", {}) == "127.0.0.1:50051"  # not in a pod


def test_the_datapath_comes_from_the_registry_unless_named() -> None:
    assert default_address("datapath", {"FLAGELLA_DATAPATH_LISTEN": "0.0.0.0:50055"}) is None
    assert default_address("datapath", {"FLAGELLA_DATAPATH_ADDRESS": "n1:50055"}) == "n1:50055"
    assert local_address("unix:/run/x.sock") == "unix:/run/x.sock"


def test_a_one_node_command_picks_its_node() -> None:
    nodes = {"a": "10.0.0.1:50055", "b": "10.0.0.2:50055"}
    assert pick_one(nodes, "b", "a").address == "10.0.0.2:50055"
    assert pick_one(nodes, "", "a").node == "a"  # the node this runs on
    assert pick_one({"a": "x:1"}, "", "elsewhere").node == "a"  # the only one
    with pytest.raises(LookupError, match=r"2 nodes \(a, b\): name one with --node"):
        pick_one(nodes, "", "elsewhere")
    with pytest.raises(LookupError, match=r"no node 'c' with a datapath .*nodes: a, b"):
        pick_one(nodes, "c", "a")
    with pytest.raises(LookupError, match="no node has registered a datapath"):
        pick_one({}, "", "a")
