"""The datapath's policy-map budget as pure logic: the option, and the
policy service's fail-closed policy carried to the endpoint's report."""

from __future__ import annotations

import pytest

from flagella.api.policy.v1 import policy_pb2
from flagella.common.config import load_config
from flagella.common.errors import ConfigError
from flagella.datapath.bpf.layout import MapSizes
from flagella.datapath.config import DatapathConfig
from flagella.datapath.handlers import identity_policy


def config(*argv: str) -> DatapathConfig:
    return load_config(
        DatapathConfig, prog="flagella-datapath", env_prefix="X_", argv=list(argv), environ={}
    )


def test_policy_map_budget_option() -> None:
    assert config().policy_map_max_entries == MapSizes().policy_per_endpoint == 16384
    assert config("--policy-map-max-entries", "12").policy_map_max_entries == 12
    for bad in ("0", str(MapSizes().policy + 1)):
        with pytest.raises(ConfigError) as err:
            config("--policy-map-max-entries", bad)
        assert str(err.value).startswith(
            f"invalid --policy-map-max-entries: {bad} is not in 1..{MapSizes().policy}"
        )


def test_a_fail_closed_policy_keeps_its_reason() -> None:
    closed = policy_pb2.ResolvedPolicy(
        identity=300,
        revision=7,
        ingress_enforced=True,
        egress_enforced=True,
        error="policy needs 20000 entries, more than the per-endpoint budget of 16384",
    )
    pol = identity_policy(closed)
    assert pol.error == closed.error
    assert pol.entries == ()
    assert (pol.ingress_enforced, pol.egress_enforced) == (True, True)
    assert identity_policy(policy_pb2.ResolvedPolicy(identity=300)).error == ""
