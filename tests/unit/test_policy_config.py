"""Configuration of the policy service fails fast on bad values."""

from __future__ import annotations

import pytest

from flagella.common.config import load_config
from flagella.common.errors import ConfigError
from flagella.policy.__main__ import settings_of
from flagella.policy.config import PolicyConfig


def _load(*argv: str, env: dict[str, str] | None = None) -> PolicyConfig:
    return load_config(
        PolicyConfig, prog="p", env_prefix="FLAGELLA_POLICY_", argv=argv, environ=env or {}
    )


def test_defaults_and_settings() -> None:
    cfg = _load()
    s = settings_of(cfg)
    assert s.node_lease_ttl == 900
    assert s.budget == 16384
    assert s.allow_localhost is True
    assert _load("--allow-localhost", "policy").allow_localhost == "policy"
    env = _load(env={"FLAGELLA_POLICY_POLICY_MAP_MAX_ENTRIES": "100"})
    assert env.policy_map_max_entries == 100
    custom = _load("--identity-label-filter", "!foo,bar")
    assert custom.identity_label_filter == ("!foo", "bar")


def test_kubernetes_options() -> None:
    from flagella.policy.kube import KINDS

    cfg = _load()
    assert cfg.kubeconfig == ""
    assert cfg.kubernetes_policy_kinds == tuple(k.kind for k in KINDS)
    assert (cfg.leader_lease_duration, cfg.leader_renew_deadline, cfg.leader_retry_period) == (
        15,
        10.0,
        2.0,
    )
    only = _load("--kubernetes-policy-kinds", "NetworkPolicy", "--kubeconfig", "in-cluster")
    assert only.kubernetes_policy_kinds == ("NetworkPolicy",)
    with pytest.raises(ConfigError) as err:
        _load("--kubernetes-policy-kinds", "NetworkPolicy,Ingress")
    assert err.value.option == "--kubernetes-policy-kinds"
    # The old leader stops before its Lease can expire for the others.
    with pytest.raises(ConfigError) as err:
        _load("--leader-lease-duration", "10", "--leader-renew-deadline", "10")
    assert err.value.option == "--leader-lease-duration"
    with pytest.raises(ConfigError) as err:
        _load("--leader-renew-deadline", "2", "--leader-retry-period", "2")
    assert err.value.option == "--leader-renew-deadline"


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (
            (
                "--identity-label-filter",
                "(",
            ),
            "--identity-label-filter",
        ),
        (("--node-lease-ttl", "1"), "--node-lease-ttl"),
        (("--policy-map-max-entries", "0"), "--policy-map-max-entries"),
        (("--allow-localhost", "sometimes"), "--allow-localhost"),
        (("--identity-gc-interval", "0"), "--identity-gc-interval"),
    ],
)
def test_bad_values(argv: tuple[str, ...], option: str) -> None:
    with pytest.raises(ConfigError) as info:
        _load(*argv)
    assert info.value.option == option
