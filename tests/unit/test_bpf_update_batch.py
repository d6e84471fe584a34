"""BpfMap.update_batch on an LPM trie (the policy map): one batch syscall
where the kernel has batch updates for the type; where it refuses them
(EINVAL), one update each from then on; a batch cut short writes the rest
one by one, so the entry that fails raises its own error. The syscalls are
fakes here; tests/privileged/test_bpf_policy.py writes a real map."""

from __future__ import annotations

import errno
from typing import Any

import pytest

from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf import maps, syscall
from flagella.datapath.bpf.maps import BpfMap, MapFullError


class FakeKernel:
    def __init__(self, *, batch_errno: int = 0, cut_at: int = -1, full_at: int = -1) -> None:
        self.batch_errno, self.cut_at, self.full_at = batch_errno, cut_at, full_at
        self.batches: list[int] = []
        self.singles: list[int] = []

    def map_update_batch(self, fd: int, keys: Any, values: Any, count: int) -> int:
        if self.batch_errno:
            raise syscall.BpfError(self.batch_errno, "update batch")
        self.batches.append(count)
        return self.cut_at if 0 <= self.cut_at < count else count

    def map_update(self, fd: int, key: Any, value: Any, flags: int) -> None:
        if key.identity == self.full_at:
            raise syscall.BpfError(errno.E2BIG, "update")
        self.singles.append(key.identity)


def policy_map(monkeypatch: pytest.MonkeyPatch, kernel: FakeKernel) -> BpfMap[Any, Any]:
    monkeypatch.setattr(maps.syscall, "map_update_batch", kernel.map_update_batch)
    monkeypatch.setattr(maps.syscall, "map_update", kernel.map_update)
    spec = next(s for s in L.map_specs(L.MapSizes()) if s.name == "policy")
    return BpfMap(spec, -1, "")


def pairs(n: int) -> list[tuple[L.PolicyKey, L.PolicyValue]]:
    return [(L.PolicyKey(prefixlen=104, identity=i, ep_id=1), L.PolicyValue()) for i in range(n)]


def test_one_batch_syscall_per_4096(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = FakeKernel()
    assert policy_map(monkeypatch, kernel).update_batch(pairs(5000)) == 5000
    assert (kernel.batches, kernel.singles) == ([4096, 904], [])


def test_a_kernel_without_lpm_batches_gets_one_update_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kernel = FakeKernel(batch_errno=errno.EINVAL)
    bpf_map = policy_map(monkeypatch, kernel)
    assert bpf_map.update_batch(pairs(3)) == 3
    assert bpf_map.update_batch(pairs(2)) == 2  # no batch tried again
    assert kernel.singles == [0, 1, 2, 0, 1]


def test_a_batch_cut_short_writes_the_rest_and_raises_the_failing_entry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kernel = FakeKernel(cut_at=2, full_at=3)
    with pytest.raises(MapFullError):
        policy_map(monkeypatch, kernel).update_batch(pairs(5))
    assert kernel.singles == [2]  # 0 and 1 by the batch, 3 fails: 4 not written
