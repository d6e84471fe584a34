"""A dense node at small scale (bench/dense_node.py's engine): endpoints set
up on one real datapath as the endpoint service sets them up, then one rule
selecting all of them, as subjects and as peers: every endpoint's policy
map has it (read back from the map). No timing is asserted: it runs beside
the kernel tests (its netns, links and pins are its own)."""

from __future__ import annotations

import pytest
from harness import dense
from harness.cluster import Cluster

pytestmark = [pytest.mark.privileged, pytest.mark.integration, pytest.mark.beside_kernel]

ENDPOINTS = 20


def test_one_rule_over_every_endpoint_reaches_every_policy_map(cluster: Cluster) -> None:
    cluster.start(services=("policy",))
    node = cluster.add_node("dense")
    result = dense.run(cluster, node, ENDPOINTS, apps=ENDPOINTS)
    assert len(result.setup_ms) == ENDPOINTS
    assert result.missing == []
    # Each endpoint: an allow and an L4-only marker per peer, and its two
    # entries of before (the local host's ingress, egress not enforced).
    assert result.policy_entries == ENDPOINTS * (2 * ENDPOINTS + 2)
