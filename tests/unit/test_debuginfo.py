"""What a service's debuginfo shows of its configuration (secrets left
out, each named) and its bounded ring of recent warnings and errors."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from flagella.common.config import ServiceConfig, option
from flagella.common.debuginfo import REDACTED, config_document
from flagella.common.logs import RecentRecords


@dataclass(frozen=True)
class _Config(ServiceConfig):
    etcd_password: str = option("hunter2", "a secret")
    api_token: str = option("t0k3n", "another")
    otlp_endpoint: str = option("https://user:pw@collector:4317/v1", "a URL with a password")
    peers: tuple[str, ...] = option(("http://a:b@x:1", "http://y:2"), "URLs")


def test_config_shows_options_and_names_what_it_left_out() -> None:
    doc, redacted = config_document(_Config())
    assert doc["etcd_password"] == REDACTED
    assert doc["api_token"] == REDACTED
    assert doc["otlp_endpoint"] == f"https://{REDACTED}@collector:4317/v1"
    assert doc["peers"] == [f"http://{REDACTED}@x:1", "http://y:2"]
    assert doc["tls_key"] == "/etc/flagella/tls/tls.key"  # the path, never the file
    assert doc["listen"] == "127.0.0.1:50050"
    assert doc["etcd_endpoints"] == ["127.0.0.1:2379"]
    text = repr(doc)
    for secret in ("hunter2", "t0k3n", "user:pw", "a:b@"):
        assert secret not in text
    assert sorted(r.split(":")[0] for r in redacted) == [
        "api_token",
        "etcd_key",
        "etcd_password",
        "otlp_endpoint",
        "peers",
        "tls_key",
    ]


def test_recent_records_keep_the_last_warnings_cut_short() -> None:
    ring = RecentRecords(capacity=3)
    log = logging.getLogger("test.debuginfo")
    log.addHandler(ring)
    log.propagate = False
    try:
        log.info("not kept")
        for i in range(5):
            log.warning("warning %d", i, extra={"reason": "x" * 500})
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed " + "y" * 2000)
    finally:
        log.removeHandler(ring)
    got = list(ring.records)
    assert [r.message[:9] for r in got] == ["warning 3", "warning 4", "failed yy"]
    assert [r.level for r in got] == ["warning", "warning", "error"]
    assert got[0].fields == {"reason": "x" * 200}
    assert len(got[2].message) == 1000
    assert got[2].fields["exc"] == "ValueError('boom')"
    assert got[2].logger == "test.debuginfo"
