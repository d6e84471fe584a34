"""flagella-cni: the CNI plugin (spec 1.1.0). It hands each invocation (the
CNI_* environment and the network configuration) to its node's datapath over
the node's unix socket, which only root can open, and prints the answer; the
datapath relays it to the endpoint service, which does the CNI work. The
plugin holds no address and no credentials.

The runtime runs it once per operation, so it stays on the standard library
and imports next to nothing: the socket module's C core, the environment
from posix (os is not loaded when Python starts without site, as the
bundle's shim starts it), and JSON from flagella.cni.cnijson (the json
module's import costs more than a whole run).

On the socket, one JSON object a line each way: the request
{"command", "container_id", "netns", "ifname", "args", "path", "config",
"timeout"}, the answer {"exit", "stdout"} (what the endpoint service says the
plugin prints) or {"error", "details", "retry"} (the datapath could not get
an answer)."""

from __future__ import annotations

import _socket
import posix
import sys

from flagella.cni import (
    ENDPOINT_FAILED,
    IO_FAILURE,
    PLUGIN_NOT_AVAILABLE,
    SPEC_VERSION,
    TRY_AGAIN_LATER,
    CniError,
    check_version,
    cnijson,
    config_object,
    requested_version,
    socket_of,
    timeout_of,
    version_result,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any, BinaryIO, TextIO

# The request's fields and the CNI variables they carry.
ENVIRONMENT = (
    ("command", "CNI_COMMAND"),
    ("container_id", "CNI_CONTAINERID"),
    ("netns", "CNI_NETNS"),
    ("ifname", "CNI_IFNAME"),
    ("args", "CNI_ARGS"),
    ("path", "CNI_PATH"),
)
DEFAULT_TIMEOUT = 30.0
# The datapath answers within the timeout (its deadline on the endpoint
# service); the plugin waits this much longer before it gives up itself.
GRACE_S = 5.0


def exchange(path: str, request: bytes, timeout: float, command: str) -> dict[str, Any]:
    """Send the request line to the node's socket; its answer, parsed."""
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout + GRACE_S)
        try:
            sock.connect(path)
        except PermissionError as exc:
            raise CniError(IO_FAILURE, f"cannot open {path}: only root may", str(exc)) from None
        except OSError as exc:
            # Not there, or nothing listening: the datapath is not (yet) up.
            if command == "STATUS":
                raise CniError(
                    PLUGIN_NOT_AVAILABLE, f"no flagella datapath serves {path}", str(exc)
                ) from None
            raise CniError(
                TRY_AGAIN_LATER,
                f"no flagella datapath serves {path} on this node, try again later",
                str(exc),
            ) from None
        sock.sendall(request)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    except TimeoutError:
        raise CniError(
            TRY_AGAIN_LATER, f"no answer on {path} within {timeout:g} s, try again later"
        ) from None
    except OSError as exc:
        raise CniError(
            TRY_AGAIN_LATER, f"the datapath on {path} went away, try again later", str(exc)
        ) from None
    finally:
        sock.close()
    data = b"".join(chunks)
    if not data.endswith(b"\n"):
        # The datapath stopped in the middle of the call.
        raise CniError(TRY_AGAIN_LATER, f"no answer on {path}, try again later")
    try:
        answer = cnijson.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CniError(ENDPOINT_FAILED, f"a bad answer on {path}", str(exc)) from None
    if not isinstance(answer, dict):
        raise CniError(ENDPOINT_FAILED, f"a bad answer on {path}", "not an object")
    return answer


def run(environ: Mapping[str, str], stdin: bytes) -> tuple[str, int]:
    """(what to print, exit status)."""
    raw = config_object(stdin, cnijson.loads)
    command = environ.get("CNI_COMMAND", "")
    if command == "VERSION":
        return cnijson.dumps(version_result(check_version(raw, command))), 0
    path = socket_of(raw)
    # A bad timeout: the endpoint service names it; the plugin waits the default.
    timeout = timeout_of(raw.get("timeout", DEFAULT_TIMEOUT)) or DEFAULT_TIMEOUT
    request: dict[str, Any] = {key: environ.get(name, "") for key, name in ENVIRONMENT}
    request["config"] = cnijson.text_of(stdin)
    request["timeout"] = timeout
    answer = exchange(path, (cnijson.dumps(request) + "\n").encode(), timeout, command)
    stdout, status = answer.get("stdout"), answer.get("exit")
    if isinstance(stdout, str) and isinstance(status, int):
        return stdout, status
    error = answer.get("error")
    details = answer.get("details")
    if not isinstance(error, str) or not isinstance(details, str):
        raise CniError(ENDPOINT_FAILED, f"a bad answer on {path}", "no exit, stdout or error")
    raise CniError(
        TRY_AGAIN_LATER if answer.get("retry") is True else ENDPOINT_FAILED, error, details
    )


def cni_main(environ: Mapping[str, str], stdin: BinaryIO, stdout: TextIO) -> int:
    data = stdin.read()
    try:
        out, status = run(environ, data)
    except CniError as err:
        try:
            version = requested_version(cnijson.loads(data))
        except (ValueError, UnicodeDecodeError):
            version = SPEC_VERSION
        stdout.write(cnijson.dumps(err.to_json(version)))
        return 1
    stdout.write(out)
    return status


def cni_environ() -> dict[str, str]:
    """The process's CNI_* variables, decoded as os.environ decodes them."""
    return {
        key.decode("utf-8", "surrogateescape"): value.decode("utf-8", "surrogateescape")
        for key, value in posix.environ.items()
        if key.startswith(b"CNI_")
    }


def main() -> int:
    return cni_main(cni_environ(), sys.stdin.buffer, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
