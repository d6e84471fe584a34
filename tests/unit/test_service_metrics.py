"""Pure parts of the control-plane metrics: outcomes counted by service
logic, the bounded CNI labels, start-up phases (flagella.common.metrics)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from flagella.cni import TRY_AGAIN_LATER
from flagella.common.errors import NotFound
from flagella.common.metrics import Metrics
from flagella.common.outcomes import Outcomes, counted
from flagella.endpoint.metrics import cni_labels


class Worker:
    def __init__(self) -> None:
        self.outcomes = Outcomes()

    @counted("work")
    async def work(self, fail: BaseException | None = None) -> int:
        if fail is not None:
            raise fail
        return 7


async def test_a_counted_method_counts_each_call_by_its_outcome_and_not_a_cancelled_one() -> None:
    w = Worker()
    assert await w.work() == 7
    with pytest.raises(NotFound):
        await w.work(NotFound("no such node", field="node"))
    with pytest.raises(KeyError):
        await w.work(KeyError("bug"))
    with pytest.raises(asyncio.CancelledError):
        await w.work(asyncio.CancelledError())
    assert dict(w.outcomes.counts) == {
        ("work", "success"): 1,
        ("work", "not_found"): 1,
        ("work", "internal"): 1,
    }


def test_cni_labels_stay_in_a_fixed_set_whatever_the_runtime_sent() -> None:
    assert cni_labels("ADD", None) == ("ADD", "success")
    assert cni_labels("ADD", TRY_AGAIN_LATER) == ("ADD", "try_again_later")
    assert cni_labels("add; rm -rf /", 999) == ("unknown", "error")


def test_a_start_up_phase_is_timed_with_its_outcome_and_named_in_snake_case() -> None:
    m = Metrics("test")
    with m.bootstrap.phase("restore"):
        pass
    with pytest.raises(RuntimeError), m.bootstrap.phase("first_sync"):
        raise RuntimeError("etcd went away")
    m.bootstrap.serving()

    def count(phase: str, outcome: str) -> float:
        labels = {"phase": phase, "outcome": outcome}
        return m.registry.get_sample_value("flagella_bootstrap_seconds_count", labels) or 0.0

    assert count("restore", "success") == 1
    assert count("first_sync", "failure") == 1
    assert count("serving", "success") == 1
    with pytest.raises(ValueError, match="lower case"), m.bootstrap.phase("Maps Loaded"):
        pass


def test_each_garbage_collection_is_timed_by_generation_while_installed() -> None:
    m = Metrics("test")
    m.gc_pauses.install()
    try:
        before = m.registry.get_sample_value(
            "flagella_python_gc_pause_seconds_count", {"generation": "2"}
        )
        # A heap with many tracked objects: the full collection takes time.
        heap = [[i] for i in range(200_000)]
        gc.collect()
        gc.collect(0)
        del heap
    finally:
        m.gc_pauses.uninstall()

    def sample(name: str, generation: str) -> float:
        got = m.registry.get_sample_value(name, {"generation": generation})
        assert got is not None
        return got

    assert before is not None
    assert sample("flagella_python_gc_pause_seconds_count", "2") >= before + 1
    assert sample("flagella_python_gc_pause_seconds_count", "0") >= 1
    assert sample("flagella_python_gc_pause_seconds_sum", "2") > 0.0
    full = sample("flagella_python_gc_pause_seconds_count", "2")
    gc.collect()  # uninstalled: no longer counted
    assert sample("flagella_python_gc_pause_seconds_count", "2") == full
    # Buckets are cumulative and end with every collection.
    bounds = [
        sample_value
        for metric in m.registry.collect()
        if metric.name == "flagella_python_gc_pause_seconds"
        for s in metric.samples
        if s.name.endswith("_bucket") and s.labels["generation"] == "2"
        for sample_value in [s.value]
    ]
    assert bounds == sorted(bounds)
    assert bounds[-1] == full
