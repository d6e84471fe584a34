"""The control plane's one sync layer: typed tables (table.py) fed by an
etcd key range (etcd.py), a peer's Watch* stream (stream.py) or a Kubernetes
list/watch (kube.py), and the server side of every Watch* RPC (serve.py).
docs/ARCHITECTURE.md, "The sync layer", says what each guarantees."""

from flagella.common.sync.etcd import Codec, EtcdSource
from flagella.common.sync.kube import KubeSource
from flagella.common.sync.serve import (
    Batching,
    Feed,
    MessageCache,
    WatchMessages,
    serve_watch,
)
from flagella.common.sync.stream import StreamCodec, StreamSource
from flagella.common.sync.table import (
    LOCAL_LOG_SIZE,
    WATCH_LOG_SIZE,
    Batch,
    Change,
    Sink,
    Subscription,
    Table,
)

__all__ = [
    "LOCAL_LOG_SIZE",
    "WATCH_LOG_SIZE",
    "Batch",
    "Batching",
    "Change",
    "Codec",
    "EtcdSource",
    "Feed",
    "KubeSource",
    "MessageCache",
    "Sink",
    "StreamCodec",
    "StreamSource",
    "Subscription",
    "Table",
    "WatchMessages",
    "serve_watch",
]
