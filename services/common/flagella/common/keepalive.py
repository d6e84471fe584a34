"""The one place gRPC keepalive and reconnection are set, for both sides of
every connection flagella makes (its services' servers, the channels
between them, and its etcd client), so they cannot disagree.

A gRPC server that receives pings more often than its
`min_recv_ping_interval_without_data` (5 minutes by default) counts
strikes and ends the connection with GOAWAY `too_many_pings`; it also
refuses pings on a connection without calls unless told otherwise. A
client pinging every 20 s against the defaults had its watch streams cut
every few minutes (issue 18). Here the server accepts pings at half the
clients' interval, with or without calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Reconnection after a peer (or etcd) went away: gRPC's default backoff grows
#: to two minutes, and even a 2 s cap made the first call after a peer's
#: return wait for the channel's next attempt. Attempts on the loopback or a
#: cluster network are cheap; gRPC adds its own ±20 % jitter to each delay.
#: gRPC's "min reconnect backoff" is not a backoff but the least time one
#: attempt may take (TCP, TLS handshake, HTTP/2 settings): at 100 ms, a busy
#: server's slow handshakes were abandoned and retried every 0.1-0.5 s, and
#: 1,000 nodes joining left ipam 20,000 half-open sockets (its file limit).
#: gRPC's default, 20 s; a refused connection is still retried after the
#: backoff above.
CONNECT_TIMEOUT_MS = 20_000
RECONNECT_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
    ("grpc.max_reconnect_backoff_ms", 500),
]


#: etcd's own server permits a ping every 5 s (--grpc-keepalive-min-time)
#: and none on a connection without calls: its client pings every 10 s, and
#: only while a call is open.
ETCD_CLIENT_TIME = 10.0


@dataclass(frozen=True, slots=True)
class Keepalive:
    """time: how long a client's connection may be silent before it pings
    (seconds); timeout: how long it waits for the answer before it drops
    the connection. Every process of a cluster must use the same time
    (the cluster-wide FLAGELLA_GRPC_KEEPALIVE_TIME)."""

    time: float = 20.0
    timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.time <= 0 or self.timeout <= 0:
            raise ValueError("keepalive time and timeout must be positive")

    @property
    def min_ping_interval_ms(self) -> int:
        """The shortest ping interval a server accepts: half the clients',
        so a client's timer running early is never a strike."""
        return max(int(self.time * 1000) // 2, 1)

    def client_options(self, *, without_calls: bool = True) -> list[tuple[str, Any]]:
        """without_calls: ping an idle connection too (our servers permit
        it; etcd's, by default, does not)."""
        return [
            ("grpc.keepalive_time_ms", int(self.time * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.timeout * 1000)),
            ("grpc.keepalive_permit_without_calls", int(without_calls)),
            # An idle watch stream may carry no data for long: keep pinging.
            ("grpc.http2.max_pings_without_data", 0),
            *RECONNECT_OPTIONS,
        ]

    def server_options(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", self.min_ping_interval_ms),
            ("grpc.http2.min_ping_interval_without_data_ms", self.min_ping_interval_ms),
            ("grpc.http2.max_ping_strikes", 2),
        ]
