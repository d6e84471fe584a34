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
