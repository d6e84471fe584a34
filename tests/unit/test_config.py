"""Typed configuration: flags over service env over cluster env over defaults,
and one clear reason when something is wrong."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from flagella.common.config import (
    ServiceConfig,
    load_config,
    option,
    parse_cidr,
    parse_host_port,
)
from flagella.common.errors import ConfigError


@dataclass(frozen=True)
class DemoConfig(ServiceConfig):
    cidr: tuple[str, ...] = option(("10.0.0.0/8",), "cidrs", parse=parse_cidr)
    size: int = option(24, "a size")
    debug: bool = option(False, "a switch")
    peer: str = option("", "a peer", parse=parse_host_port)

    def validate(self) -> None:
        super().validate()
        if self.size > 32:
            raise ConfigError("--size", "at most 32")


def load(argv: list[str], env: dict[str, str] | None = None) -> DemoConfig:
    return load_config(
        DemoConfig, prog="t", env_prefix="FLAGELLA_DEMO_", argv=argv, environ=env or {}
    )


def test_defaults() -> None:
    cfg = load([])
    assert cfg.cidr == ("10.0.0.0/8",)
    assert cfg.size == 24
    assert cfg.debug is False
    assert cfg.etcd_endpoints == ("127.0.0.1:2379",)


def test_flag_beats_service_env_beats_cluster_env() -> None:
    env = {
        "FLAGELLA_DEMO_SIZE": "20",
        "FLAGELLA_SIZE": "16",
        "FLAGELLA_ETCD_ENDPOINTS": "e1:1,e2:2",
    }
    assert load([], env).size == 20
    assert load(["--size", "28"], env).size == 28
    assert load([], {"FLAGELLA_SIZE": "16"}).size == 16
    assert load([], env).etcd_endpoints == ("e1:1", "e2:2")


def test_tuples_repeat_or_comma_separate_and_bools_switch() -> None:
    cfg = load(["--cidr", "10.1.0.0/16,fd00::/64", "--cidr", "10.2.0.0/16", "--debug"])
    assert cfg.cidr == ("10.1.0.0/16", "fd00::/64", "10.2.0.0/16")
    assert cfg.debug is True
    assert load(["--no-debug"], {"FLAGELLA_DEMO_DEBUG": "true"}).debug is False
    assert load([], {"FLAGELLA_DEMO_DEBUG": "yes"}).debug is True


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--cidr", "10.0.0.1/8"], {}, "invalid --cidr: '10.0.0.1/8' is not a valid CIDR"),
        (["--size", "x"], {}, "invalid --size: invalid literal for int()"),
        ([], {"FLAGELLA_DEMO_SIZE": "x"}, "invalid FLAGELLA_DEMO_SIZE:"),
        (
            [],
            {"FLAGELLA_DEMO_DEBUG": "maybe"},
            "invalid FLAGELLA_DEMO_DEBUG: 'maybe' is not a boolean",
        ),
        (["--size", "40"], {}, "invalid --size: at most 32"),
        (["--peer", "host"], {}, "invalid --peer: 'host' is not host:port"),
        (["--peer", "host:70000"], {}, "invalid --peer: 'host:70000' has no valid port"),
        (
            ["--log-level", "loud"],
            {},
            "invalid --log-level: 'loud' is not one of debug, info, warning, error",
        ),
        (["--nope"], {}, "invalid arguments: unrecognized arguments: --nope"),
        (["--etcd-timeout", "0"], {}, "invalid --etcd-timeout: must be positive"),
        (["--watch-history", "100"], {}, "invalid --watch-history: must be within 256..1048576"),
    ],
)
def test_errors_name_the_option(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(argv, env)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_host_port_forms() -> None:
    assert parse_host_port("unix:/run/flagella.sock") == "unix:/run/flagella.sock"
    assert parse_host_port("[::1]:50051") == "[::1]:50051"
    assert parse_host_port("ipam:50051") == "ipam:50051"
    with pytest.raises(ValueError, match="empty host"):
        parse_host_port("[]:1")


def test_watch_history_sizes_the_served_tables_logs() -> None:
    # The option reaches the tables that other processes' watches resume
    # from (here the lb's services); process-local mirrors keep their own.
    from flagella.common.sync import LOCAL_LOG_SIZE, WATCH_LOG_SIZE
    from flagella.lb.store import LbStore

    assert load([]).watch_history == WATCH_LOG_SIZE
    assert load(["--watch-history", "1024"]).watch_history == 1024
    store = LbStore(etcd=None, watch_history=1024)  # type: ignore[arg-type]
    assert store.services.log_size == 1024
    assert LOCAL_LOG_SIZE < WATCH_LOG_SIZE
