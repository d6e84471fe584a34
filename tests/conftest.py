"""Fixtures shared by every test suite, and the CI rule for privileged tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness.cluster import Cluster
from harness.etcd import EtcdServer
from harness.netns import NetnsSet
from harness.procs import ServiceProcess

IN_CI = os.environ.get("CI", "").lower() == "true"


def pytest_configure(config: pytest.Config) -> None:
    """Service processes a test starts by hand (not through harness.procs,
    which gives each its own port) serve metrics on a port the kernel
    picks, not their fixed defaults: tests run side by side."""
    for svc in ("ipam", "policy", "endpoint", "lb", "datapath"):
        os.environ.setdefault(f"FLAGELLA_{svc.upper()}_METRICS_LISTEN", "127.0.0.1:0")


# Folders whose every test touches the kernel.
KERNEL_FOLDERS = ("e2e", "privileged")
# The Docker engine's tests: their stack runs in the host's netns, apart
# from the namespaces, pins and links the kernel tests make, so they run
# beside them (in the second pytest).
DOCKER_FOLDERS = ("deploy",)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks `kernel` the tests that touch the kernel (namespaces, BPF,
    links): scripts/test's full run runs them one after the other in one
    pytest (`-m kernel`) and the others (the Docker engine's included) in a
    second one beside it (`-m "not kernel"`)."""
    tests = Path(__file__).parent
    for item in items:
        path = Path(item.path)
        folder = path.relative_to(tests).parts[0] if path.is_relative_to(tests) else ""
        if folder in DOCKER_FOLDERS or item.get_closest_marker("beside_kernel") is not None:
            continue
        if folder in KERNEL_FOLDERS or item.get_closest_marker("privileged") is not None:
            item.add_marker(pytest.mark.kernel)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """In CI a skipped privileged test is a failure: they must always run there."""
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and item.get_closest_marker("privileged") is not None:
        report.outcome = "failed"
        report.longrepr = f"privileged test skipped in CI: {report.longrepr}"


@pytest.fixture
def require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (netns, veth, BPF)")


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh real etcd for one test."""
    server = EtcdServer(tmp_path / "etcd").start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def spawn(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., ServiceProcess]]:
    """Start flagella service processes, with mutual TLS (plaintext in a
    test marked `insecure`); all are stopped at the end of the test."""
    started: list[ServiceProcess] = []
    insecure = request.node.get_closest_marker("insecure") is not None

    def _spawn(svc: str, *args: str, wait: bool = True, **kwargs: object) -> ServiceProcess:
        kwargs.setdefault("insecure", insecure)
        proc = ServiceProcess(svc, args, log_dir=tmp_path, **kwargs)  # type: ignore[arg-type]
        started.append(proc)
        proc.start()
        if wait:
            proc.wait_serving()
        return proc

    yield _spawn
    for proc in reversed(started):
        proc.stop()
        proc.remove_own_paths()


@pytest.fixture
def nss(require_root: None) -> Iterator[NetnsSet]:
    """Network namespaces of one test, deleted at its end."""
    sets = NetnsSet()
    yield sets
    sets.cleanup()


@pytest.fixture
def cluster(
    tmp_path: Path, etcd: EtcdServer, spawn: Callable[..., ServiceProcess], nss: NetnsSet
) -> Iterator[Cluster]:
    """A cluster on this machine: control plane processes, nodes as netns
    (add them with cluster.add_node). Everything is removed at the end."""
    c = Cluster(tmp_path, etcd, spawn, nss)
    yield c
    c.cleanup()
