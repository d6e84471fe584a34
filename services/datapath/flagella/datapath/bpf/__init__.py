"""The eBPF core of the datapath: programs compiled once by bcc, pinned
maps, typed map access, tc attachment, conntrack GC and flow events.

No gRPC here. The datapath service builds on::

    dp = Datapath.load("/sys/fs/bpf/flagella")      # maps pinned, programs loaded
    dp.endpoints.upsert(ep_id, ["10.0.1.5"], ifindex=ifindex, identity=identity,
                        mac=pod_mac, node_mac=host_veth_mac)   # dropped: not ready
    dp.attach(ifindex)
    dp.policy.apply(ep_id, entries, revision)         # traffic flows from here on

Layouts and behaviour: docs/datapath-bpf.md.
"""

from flagella.datapath.bpf.compiler import CompileError, Programs, compile_programs
from flagella.datapath.bpf.datapath import (
    DEFAULT_PIN_ROOT,
    Attachment,
    Datapath,
    GcStats,
    LayoutMismatch,
    MapStatus,
)
from flagella.datapath.bpf.events import EventReader, Flow
from flagella.datapath.bpf.layout import (
    Direction,
    DropReason,
    FlowType,
    FlowVerdict,
    Identity,
    MapSizes,
    Verdict,
    layout_version,
    maglev_slot,
)
from flagella.datapath.bpf.lb import Backend, Frontend, Service, frontend_rev_nat_id
from flagella.datapath.bpf.maps import BpfMap, MapFullError
from flagella.datapath.bpf.policy import PolicyBudgetExceeded, PolicyEntry
from flagella.datapath.bpf.syscall import BpfError, TestRunResult
from flagella.datapath.bpf.tables import EndpointState, NodeConfig, Tuple

__all__ = [
    "DEFAULT_PIN_ROOT",
    "Attachment",
    "Backend",
    "BpfError",
    "BpfMap",
    "CompileError",
    "Datapath",
    "Direction",
    "DropReason",
    "EndpointState",
    "EventReader",
    "Flow",
    "FlowType",
    "FlowVerdict",
    "Frontend",
    "GcStats",
    "Identity",
    "LayoutMismatch",
    "MapFullError",
    "MapSizes",
    "MapStatus",
    "NodeConfig",
    "PolicyBudgetExceeded",
    "PolicyEntry",
    "Programs",
    "Service",
    "TestRunResult",
    "Tuple",
    "Verdict",
    "compile_programs",
    "frontend_rev_nat_id",
    "layout_version",
    "maglev_slot",
]
