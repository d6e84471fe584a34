"""The gobgpd child process of this node's datapath.

gobgpd runs with CAP_NET_BIND_SERVICE as its only capability (setpriv:
ambient, inheritable and bounding set, no new privileges), as the
datapath's own user unless --bgp-user names another. Its gRPC API is a unix
socket in the datapath's state folder (<state>/bgp/run/gobgpd.sock), not a
TCP port: nothing but the datapath (and root) reaches it, where anything in
the node's network namespace could reach a loopback port and announce
routes. (As another user, gobgpd must be able to search every folder above
it: the run folder is then that user's, 0711, its socket 0777.) Its output
goes to <state>/bgp/gobgpd.log (the last session downs' reasons are read
from it: GoBGP's API does not carry them).

Its pid (with its start time, so a reused pid is never taken for it) is
kept in <state>/bgp/gobgpd.pid (a gobgpd of the same socket without one, a
crash having come between its start and that write, is killed before the
next start): a datapath started again after a crash
adopts the gobgpd it finds there (the sessions stay up; the speaker then
reconciles it), and one that does not answer is killed and replaced. A
datapath stopped gracefully stops its gobgpd.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pwd
import re
import signal
import time
from pathlib import Path

log = logging.getLogger(__name__)

# gobgpd's log (peer ups and downs, at info) is rotated past this at a start.
MAX_LOG = 8 << 20
# A unix socket's path is at most 107 bytes.
MAX_SOCKET_PATH = 107
STOP_TIMEOUT = 5.0
CAPS = "-all,+net_bind_service"
# gobgpd's plain log: Reason=hold-timer-expired, or Reason="quoted text".
_REASON = re.compile(r'Reason=(?:"([^"]*)"|(\S+))')


class GobgpdError(Exception):
    """gobgpd could not be started (binary missing, setpriv refused, ...)."""


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), or None: gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22; the command (field 2) may hold spaces: split after its ')'.
    return int(stat.rpartition(")")[2].split()[19])


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


class Gobgpd:
    def __init__(
        self,
        state_dir: Path,
        *,
        binary: str = "gobgpd",
        user: str = "",
        log_level: str = "info",
    ) -> None:
        self.folder = state_dir / "bgp"
        self.run_dir = self.folder / "run"
        self.socket_path = self.run_dir / "gobgpd.sock"
        self.pid_file = self.folder / "gobgpd.pid"
        self.log_file = self.folder / "gobgpd.log"
        self.binary = binary
        self.user = user
        self.log_level = log_level
        self.pid = 0
        self.adopted = False
        self._child: asyncio.subprocess.Process | None = None
        self._exited: asyncio.Event = asyncio.Event()
        self._exited.set()
        self.started_at = 0.0
        if len(str(self.socket_path).encode()) > MAX_SOCKET_PATH:
            raise GobgpdError(
                f"{self.socket_path}: a unix socket path of more than {MAX_SOCKET_PATH} bytes "
                "(give a shorter --state-dir)"
            )

    @property
    def target(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def running(self) -> bool:
        return self.pid != 0 and not self._exited.is_set()

    async def wait_exited(self) -> None:
        await self._exited.wait()

    # --- adoption ---

    def adopt(self) -> bool:
        """Take over the gobgpd of the pid file, if it is still that
        gobgpd (same start time, our socket). Returns whether it was."""
        try:
            doc = json.loads(self.pid_file.read_text())
            pid, start = int(doc["pid"]), int(doc["start_time"])
        except (OSError, ValueError, KeyError, TypeError):
            return False
        cmd = _cmdline(pid)
        if _start_time(pid) != start or not any(str(self.socket_path) in a for a in cmd):
            self.pid_file.unlink(missing_ok=True)
            return False
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return False
        self.pid, self.adopted, self.started_at = pid, True, time.monotonic()
        self._exited = asyncio.Event()
        self._watch_pidfd(pidfd)
        log.info("adopted the running gobgpd", extra={"pid": pid})
        return True

    def _watch_pidfd(self, pidfd: int) -> None:
        loop = asyncio.get_running_loop()
        exited = self._exited

        def readable() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            exited.set()

        loop.add_reader(pidfd, readable)

    # --- start and stop ---

    def _command(self) -> list[str]:
        gobgpd = [
            self.binary,
            "--api-hosts", self.target,
            "--pprof-disable",
            "--log-level", self.log_level,
            "--log-plain",
        ]  # fmt: skip
        drop = [
            "setpriv",
            f"--inh-caps={CAPS}",
            f"--ambient-caps={CAPS}",
            f"--bounding-set={CAPS}",
            "--no-new-privs",
        ]
        if self.user:
            try:
                pw = pwd.getpwnam(self.user)
            except KeyError:
                raise GobgpdError(f"no user {self.user!r} (--bgp-user)") from None
            drop[1:1] = [f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups"]
        return [*drop, "--", *gobgpd]

    def _prepare(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.folder, 0o711 if self.user else 0o700)
        self.run_dir.mkdir(exist_ok=True)
        if self.user:
            # gobgpd (another user) makes its socket here; the datapath enters.
            pw = pwd.getpwnam(self.user)
            os.chown(self.run_dir, pw.pw_uid, pw.pw_gid)
            os.chmod(self.run_dir, 0o711)
        else:
            os.chmod(self.run_dir, 0o700)
        self.socket_path.unlink(missing_ok=True)
        # Its log is appended to across starts: one old generation is kept.
        if self.log_file.exists() and self.log_file.stat().st_size > MAX_LOG:
            self.log_file.replace(self.log_file.with_suffix(".log.1"))

    def _kill_strays(self) -> None:
        """A gobgpd of this socket that is not ours (started just before a
        crash left no pid file for it): killed, so nothing leaks and the new
        one gets the port."""
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == self.pid:
                continue
            cmd = _cmdline(int(proc.name))
            if cmd and any(str(self.socket_path) in a for a in cmd) and self.binary in cmd:
                log.warning("killing a stray gobgpd", extra={"pid": int(proc.name)})
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(proc.name), signal.SIGKILL)

    async def start(self) -> None:
        """Start a new gobgpd (after stopping any that runs)."""
        await self.stop()
        self._kill_strays()
        try:
            self._prepare()
            command = self._command()
            with open(self.log_file, "ab") as out:  # noqa: ASYNC230 (a local file, once)
                # Its own session: a signal to the datapath's process group is
                # not its. Another user's socket must take the datapath's
                # connection (umask 0; the folders keep others out).
                old = os.umask(0 if self.user else 0o077)
                try:
                    child = await asyncio.create_subprocess_exec(
                        *command,
                        stdin=asyncio.subprocess.DEVNULL,
                        stdout=out,
                        stderr=out,
                        start_new_session=True,
                    )
                finally:
                    os.umask(old)
        except (OSError, KeyError) as exc:
            raise GobgpdError(f"cannot start gobgpd: {exc}") from exc
        self._child, self.pid, self.adopted = child, child.pid, False
        self.started_at = time.monotonic()
        self._exited = asyncio.Event()
        start = _start_time(child.pid)
        self.pid_file.write_text(json.dumps({"pid": child.pid, "start_time": start}))
        try:
            # asyncio's child watcher reaps it; the pidfd says when it exited.
            self._watch_pidfd(os.pidfd_open(child.pid))
        except ProcessLookupError:
            self._exited.set()
        log.info("gobgpd started", extra={"pid": child.pid, "socket": str(self.socket_path)})

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT; forget the pid file."""
        if self.running:
            pid = self.pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self._exited.wait(), STOP_TIMEOUT)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                await self._exited.wait()
            log.info("gobgpd stopped", extra={"pid": pid})
        self.pid = 0
        self._child = None
        self.pid_file.unlink(missing_ok=True)

    def log_tail(self, lines: int = 3) -> str:
        """The last lines gobgpd (or setpriv) wrote: why it did not start."""
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])

    def peer_down_reason(self, address: str, tail: int = 1 << 16) -> str:
        """Why gobgpd last took the session with address down, as its log
        says ("hold-timer-expired", "notification-received code 6(cease)
        ..."); its API does not say. Empty when the log does not tell."""
        try:
            with open(self.log_file, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - tail))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        keys = (f"Key={address} ", f'Key="{address}" ')
        for line in reversed(lines):
            if 'msg="Peer Down"' in line and any(k in line for k in keys):
                m = _REASON.search(line)
                return m.group(1) or m.group(2) if m else ""
        return ""

    def kill(self) -> None:
        """SIGKILL (a gobgpd that does not answer)."""
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
