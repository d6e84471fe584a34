"""Both sides of every gRPC connection from one Keepalive: a client's ping
interval is never below what the server accepts."""

from __future__ import annotations

import pytest

from flagella.common.keepalive import ETCD_CLIENT_TIME, Keepalive


@pytest.mark.parametrize("time_s", [0.2, 1.0, 20.0, 300.0])
def test_clients_never_ping_faster_than_servers_accept(time_s: float) -> None:
    ka = Keepalive(time_s)
    client = dict(ka.client_options())
    server = dict(ka.server_options())
    assert (
        client["grpc.keepalive_time_ms"]
        >= 2 * server["grpc.http2.min_recv_ping_interval_without_data_ms"]
    )
    # Clients ping idle connections; servers permit it.
    assert client["grpc.keepalive_permit_without_calls"] == 1
    assert server["grpc.keepalive_permit_without_calls"] == 1


def test_etcd_client_keeps_to_etcds_defaults() -> None:
    # etcd: --grpc-keepalive-min-time 5 s, no pings without a stream.
    client = dict(Keepalive(ETCD_CLIENT_TIME).client_options(without_calls=False))
    assert client["grpc.keepalive_time_ms"] >= 5_000
    assert client["grpc.keepalive_permit_without_calls"] == 0


def test_bad_periods_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        Keepalive(0)
