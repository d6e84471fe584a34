"""The gobgpd supervisor's bookkeeping with real processes standing in for
gobgpd (a sleeping Python whose command line names the socket, as gobgpd's
does): a pid file is adopted only for the process it was written for (same
start time, same socket), a stray of the same socket is killed before a
start, and the exit of an adopted process is seen (its pidfd). Starting the
real gobgpd is tested end to end (tests/e2e/test_bgp.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from flagella.datapath.bgp.supervisor import Gobgpd, GobgpdError, _start_time


@pytest.fixture
def stand_ins() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def stand_in(sup: Gobgpd, procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    """A process whose command line is gobgpd's (binary, socket)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", sup.binary, "--api-hosts", sup.target]
    )
    procs.append(proc)
    return proc


def test_adopts_only_the_process_its_pid_file_names(
    tmp_path: Path, stand_ins: list[subprocess.Popen[bytes]]
) -> None:
    async def main() -> None:
        sup = Gobgpd(tmp_path)
        sup.folder.mkdir(parents=True)
        assert not sup.adopt()  # no pid file
        proc = stand_in(sup, stand_ins)
        sup.pid_file.write_text(json.dumps({"pid": proc.pid, "start_time": 1}))
        assert not sup.adopt()  # a reused pid: another start time
        assert not sup.pid_file.exists()
        start = _start_time(proc.pid)
        sup.pid_file.write_text(json.dumps({"pid": proc.pid, "start_time": start}))
        other = Gobgpd(tmp_path / "other")
        other.folder.mkdir(parents=True)
        other.pid_file.write_text(json.dumps({"pid": proc.pid, "start_time": start}))
        assert not other.adopt()  # not its socket
        assert sup.adopt()
        assert sup.running
        assert sup.adopted
        proc.kill()
        await asyncio.wait_for(sup.wait_exited(), 5)
        assert not sup.running

    asyncio.run(main())


def test_a_stray_of_the_same_socket_is_killed(
    tmp_path: Path, stand_ins: list[subprocess.Popen[bytes]]
) -> None:
    sup = Gobgpd(tmp_path)
    stray = stand_in(sup, stand_ins)
    elsewhere = stand_in(Gobgpd(tmp_path / "elsewhere"), stand_ins)
    sup._kill_strays()
    assert stray.wait(5) == -9
    assert elsewhere.poll() is None


def test_a_socket_path_too_long_is_refused(tmp_path: Path) -> None:
    with pytest.raises(GobgpdError, match="unix socket path"):
        Gobgpd(tmp_path / ("x" * 100))


LOG = """\
time="2026-11-29T03:01:41Z" level=info msg="Peer Up" Key=192.168.100.253 State=BGP_FSM_OPENCONFIRM Topic=Peer
time="2026-11-29T03:01:50Z" level=info msg="Peer Down" Key=192.168.100.253 Reason=hold-timer-expired State=BGP_FSM_ESTABLISHED Topic=Peer
time="2026-11-29T03:02:05Z" level=info msg="Peer Down" Key="fd00:100::253" Reason="notification-received code 6(cease) subcode 2(administrative shutdown)" State=BGP_FSM_ESTABLISHED Topic=Peer
"""


def test_why_a_session_went_down_is_read_from_gobgpds_log(tmp_path: Path) -> None:
    sup = Gobgpd(tmp_path)
    assert sup.peer_down_reason("192.168.100.253") == ""  # no log yet
    sup.folder.mkdir(parents=True)
    sup.log_file.write_text(LOG)
    assert sup.peer_down_reason("192.168.100.253") == "hold-timer-expired"
    assert sup.peer_down_reason("fd00:100::253") == (
        "notification-received code 6(cease) subcode 2(administrative shutdown)"
    )
    assert sup.peer_down_reason("192.168.100.25") == ""  # another peer's prefix
