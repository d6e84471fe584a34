"""BPF map pressure, as the datapath exports it (flagella_bpf_map_pressure)
and `flagella status` shows it: one rule for both.

Pressure is how close a map is to running out of room: entries in use over
max_entries, for the maps that take entries as they come (hash, LRU, LPM
trie, hash of maps). An array has every slot from its creation, indexed by
something bounded by construction (`config`: the one node record;
`metrics`: one counter per drop reason and direction): it cannot run out,
so it has no pressure (not 100 %). A ring buffer has no entries (what does
not fit is counted as lost flow events)."""

from __future__ import annotations

NO_PRESSURE = frozenset({"array", "percpu_array", "ringbuf"})


def map_pressure(map_type: str, entries: int, max_entries: int) -> float | None:
    """entries / max_entries, or None for a map kind with no pressure."""
    if map_type in NO_PRESSURE or max_entries <= 0:
        return None
    return entries / max_entries
