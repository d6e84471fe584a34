# shellcheck shell=bash
# Pid files of the processes scripts/up starts: PIDFILE holds the pid,
# PIDFILE.cmd the command line it was started with (NUL-separated, as
# /proc/PID/cmdline). A pid alone proves nothing after a kill -9: the
# process may be a zombie (it still answers `kill -0`) or the pid may have
# been reused by another command.

# pid_record PIDFILE PID COMMAND...: remember what was started.
pid_record() {
  local pidfile=$1 pid=$2
  shift 2
  printf '%s\0' "$@" >"$pidfile.cmd"
  echo "$pid" >"$pidfile"
}

# pid_alive PIDFILE: the recorded process runs (state not zombie or dead)
# and is still the command recorded with it.
pid_alive() {
  local pidfile=$1 pid stat state
  [ -f "$pidfile" ] || return 1
  pid=$(cat "$pidfile")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
  # The state follows the command name, which is in parentheses and may
  # itself hold spaces or parentheses: take what follows the last ") ".
  state=${stat##*) }
  state=${state%% *}
  case $state in Z | X | x) return 1 ;; esac
  # A pid file from before commands were recorded: the state is all we know.
  [ -f "$pidfile.cmd" ] || return 0
  # Through a pipe: /proc files report size 0, which cmp would trust.
  cmp -s "$pidfile.cmd" <(cat "/proc/$pid/cmdline" 2>/dev/null)
}
