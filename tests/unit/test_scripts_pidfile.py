"""scripts/up's pid-file check (scripts/lib/pidfile.sh): a process counts as
running only when it is alive, not a zombie, and still the command that was
started (issue 18 item 7: after a kill -9, a zombie or a reused pid made
scripts/up restart nothing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

LIB = Path(__file__).resolve().parents[2] / "scripts" / "lib" / "pidfile.sh"


def alive(pidfile: Path) -> bool:
    result = subprocess.run(
        ["bash", "-c", f'. "{LIB}" && pid_alive "$1"', "-", str(pidfile)],
        check=False,
        timeout=10,
    )
    return result.returncode == 0


def record(pidfile: Path, pid: int, *command: str) -> None:
    subprocess.run(
        ["bash", "-c", f'. "{LIB}" && pid_record "$@"', "-", str(pidfile), str(pid), *command],
        check=True,
        timeout=10,
    )


def started(proc: subprocess.Popen[bytes]) -> None:
    """Waits until the kernel shows the new program's command line (it is
    empty for a moment after exec)."""
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    for _ in range(500):
        if cmdline.read_bytes():
            return
        subprocess.run(["sleep", "0.01"], check=True)
    raise AssertionError(f"pid {proc.pid} shows no command line")


def test_only_the_recorded_live_command_counts_as_running(tmp_path: Path) -> None:
    # A command line with spaces and parentheses in its name, as /proc shows it.
    command = [sys.executable, "-c", "import time; time.sleep(60)", "a (b) c"]
    running = subprocess.Popen(command)
    other = subprocess.Popen(["sleep", "60"])
    zombie = subprocess.Popen(command)
    try:
        for proc in (running, other, zombie):
            started(proc)
        pidfile = tmp_path / "svc.pid"
        record(pidfile, running.pid, *command)
        assert alive(pidfile)

        # The pid now belongs to another command (a reused pid).
        record(pidfile, other.pid, *command)
        assert not alive(pidfile)

        # Killed and not reaped: a zombie still answers kill -0.
        zombie.kill()
        record(pidfile, zombie.pid, *command)
        stat = Path(f"/proc/{zombie.pid}/stat")
        for _ in range(200):
            if stat.read_text().rsplit(") ", 1)[1].startswith("Z"):
                break
            subprocess.run(["sleep", "0.01"], check=True)
        assert subprocess.run(["kill", "-0", str(zombie.pid)], check=False).returncode == 0
        assert not alive(pidfile)

        # Gone entirely, or no pid file, or garbage in it.
        zombie.wait()
        assert not alive(pidfile)
        assert not alive(tmp_path / "missing.pid")
        (tmp_path / "bad.pid").write_text("12x\n")
        assert not alive(tmp_path / "bad.pid")

        # A pid file written before commands were recorded: its state decides.
        (tmp_path / "old.pid").write_text(f"{running.pid}\n")
        assert alive(tmp_path / "old.pid")
    finally:
        for proc in (running, other, zombie):
            proc.kill()
            proc.wait()
