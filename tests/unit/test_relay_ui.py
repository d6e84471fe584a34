"""The flows page's pure parts: its query's validation (by field), which
Host names it may be asked for, the Server-Sent Event framing, and the
directory's reload rule shared with `flagella observe`."""

from __future__ import annotations

import json

import pytest

from flagella.api.datapath.v1 import datapath_pb2
from flagella.common import flows as hubble
from flagella.common.config import load_config
from flagella.common.errors import ConfigError
from flagella.relay.config import RelayConfig
from flagella.relay.ui import MAX_LAST, BadQuery, host_allowed, parse_query, sse


def test_the_query_is_checked_field_by_field() -> None:
    assert parse_query({}) == ("", 500)
    assert parse_query({"namespace": "shop", "last": "0"}) == ("shop", 0)
    for query, field in (
        ({"namespace": "Shop"}, "namespace"),
        ({"namespace": "a/b"}, "namespace"),
        ({"namespace": "x" * 64}, "namespace"),
        ({"last": "-1"}, "last"),
        ({"last": "ten"}, "last"),
        ({"last": str(MAX_LAST + 1)}, "last"),
    ):
        with pytest.raises(BadQuery) as exc:
            parse_query(query)
        assert exc.value.field == field


def test_the_page_answers_only_to_its_addresses_localhost_and_allowed_names() -> None:
    for host in ("127.0.0.1:12000", "[::1]:12000", "localhost:12000", "localhost", "10.0.0.7"):
        assert host_allowed(host, ()), host
    for host in ("evil.example", "evil.example:12000", "localhost.evil.example", ""):
        assert not host_allowed(host, ()), host
    assert host_allowed("flows.example:443", ("flows.example",))


def test_an_event_is_one_json_line() -> None:
    body = sse("flow", {"text": "a\nb"})
    assert body.count(b"\n") == 3  # event, data, blank line
    kind, data, _, _ = body.decode().split("\n")
    assert kind == "event: flow"
    assert json.loads(data.removeprefix("data: ")) == {"text": "a\nb"}


def test_an_unknown_end_reloads_the_directory_at_most_once_a_second() -> None:
    f = datapath_pb2.Flow(src_ip="10.0.0.1", dst_ip="10.0.0.2", src_identity=256, dst_identity=2)
    known = hubble.Directory(
        {"10.0.0.1": hubble.Pod("a", "shop", 1, "n1")},
        {256: ("k8s:app=a",), 2: ("reserved:world",)},
    )
    assert not hubble.stale(known, f, loaded_at=0.0, now=100.0)
    assert hubble.stale(hubble.Directory(), f, loaded_at=0.0, now=1.0)
    assert not hubble.stale(hubble.Directory(), f, loaded_at=0.5, now=1.0)


def test_the_page_is_on_loopback_by_default_and_an_empty_address_turns_it_off() -> None:
    def load(*argv: str) -> RelayConfig:
        return load_config(RelayConfig, prog="relay", env_prefix="FLAGELLA_RELAY_",
                           argv=argv, environ={})  # fmt: skip

    assert load().ui_listen == "127.0.0.1:12000"
    assert load("--ui-listen", "").ui_listen == ""
    assert load("--ui-allowed-hosts", "a.example,b.example").ui_allowed_hosts == (
        "a.example",
        "b.example",
    )
    for bad in ("nope", "unix:/run/ui.sock"):
        with pytest.raises(ConfigError) as exc:
            load("--ui-listen", bad)
        assert exc.value.option == "--ui-listen", exc.value
