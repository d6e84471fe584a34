"""Fixtures of the privileged BPF tests: the datapath compiled once per
session, and a Datapath on a private pin folder per test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from harness.bpf import private_datapath

from flagella.datapath.bpf import Datapath, Programs, compile_programs


@pytest.fixture(scope="session")
def bpf_programs() -> Programs:
    if os.geteuid() != 0:
        pytest.skip("needs root (BPF)")
    return compile_programs()


@pytest.fixture
def dp(require_root: None, bpf_programs: Programs) -> Iterator[Datapath]:
    with private_datapath(bpf_programs) as datapath:
        yield datapath
