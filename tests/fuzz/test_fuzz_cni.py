"""flagella-cni fuzzed on its environment and stdin: whatever a runtime (or
a broken one) hands it, it prints a spec result or a spec error object and
exits in time, never a traceback. Most invocations go to the real node
socket of the datapath's relay in front of the real endpoint service (the
control plane of conftest.py), the others to a socket nobody serves, a
relative path, or nothing at all."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from fuzzing import EXAMPLES, NODE, ODD, Plane, text
from harness.cni import PLUGIN, node_relay
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.integration

# The plugin waits for its answer up to the config's timeout plus 5 s.
RUN_TIMEOUT_S = 15
COMMANDS = ["ADD", "DEL", "CHECK", "GC", "STATUS", "VERSION", "", "add", "BOGUS", "ADD\x01"]
VERSIONS = ["1.1.0", "1.0.0", "0.4.0", "0.3.1", "0.3.0", "0.2.0", "2.0.0", "", "1.1", "x"]
# Env values are exec arguments: each at most 128 KiB (MAX_ARG_STRLEN).
ENV_SHAPED = [
    "/proc/self/ns/net",
    "/nonexistent",
    "eth0",
    "a" * 16,
    "/opt/cni/bin",
    "IgnoreUnknown=1;K8S_POD_NAME=p;K8S_POD_NAMESPACE=d",
    "K8S_POD_NAME",
    "=;=;",
]
ENV_TEXT = st.one_of(
    st.sampled_from([s for s in ODD if "\x00" not in s] + ENV_SHAPED),
    st.text(max_size=16).filter(lambda s: "\x00" not in s),
    st.just("x" * 100_000),
)
#: (environment, stdin) that once made the plugin fail outside the spec;
#: @SOCKET@ stands for the node socket.
REGRESSIONS: list[tuple[dict[str, str], bytes]] = [
    # A timeout of NaN, infinity or beyond a float reached socket.settimeout
    # (ValueError, OverflowError: a traceback, no spec error).
    *(
        (
            {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1", "CNI_IFNAME": "eth0"},
            b'{"cniVersion": "1.1.0", "socket": "@SOCKET@", "timeout": %s}' % t,
        )
        for t in (b"NaN", b"Infinity", b"1e400", b"1" + b"0" * 400)
    ),
]
ENVIRONMENT = ("CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_ARGS", "CNI_PATH")

JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    text(big=False),
)
JSON_ANY = st.recursive(
    JSON_LEAF,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(text(big=False), inner, max_size=3)
    ),
    max_leaves=8,
)


def netconf(socket: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A network configuration, its fields right or wrong in value and type."""
    fields = {
        "cniVersion": st.one_of(st.sampled_from(VERSIONS), JSON_ANY),
        "name": st.one_of(st.just("flagella"), JSON_ANY),
        "type": st.one_of(st.just("flagella-cni"), JSON_ANY),
        "socket": socket,
        "timeout": st.one_of(
            st.sampled_from([0.5, 1, 2, 0, -1, 1e308, 10**400, "5", True]), JSON_ANY
        ),
        "args": st.one_of(
            st.fixed_dictionaries(
                {
                    "cni": st.fixed_dictionaries(
                        {},
                        optional={
                            "labels": st.one_of(
                                st.dictionaries(text(big=False), text(big=False), max_size=3),
                                JSON_ANY,
                            ),
                            "ports": JSON_ANY,
                        },
                    )
                }
            ),
            JSON_ANY,
        ),
        "prevResult": JSON_ANY,
        "runtimeConfig": JSON_ANY,
        "capabilities": JSON_ANY,
        "ipMasq": JSON_ANY,
    }
    required = {k: fields.pop(k) for k in ("cniVersion", "socket")}
    return st.fixed_dictionaries(required, optional=fields)


def stdin(socket: str) -> st.SearchStrategy[bytes]:
    """What a runtime writes: a config (most of the time), or not JSON."""
    sockets = st.one_of(
        st.just(socket),
        st.just(socket),
        st.sampled_from(["/nonexistent/cni.sock", "relative.sock", "/", ""]),
        JSON_ANY,
    )
    configs = netconf(sockets).map(lambda c: json.dumps(c).encode())
    broken = st.sampled_from(
        [
            b"",
            b"{",
            b"[]",
            b"null",
            b"\xff\xfe{}",
            b"\xef\xbb\xbf{}",
            b"{" * 100_000,
            b"[" * 5000 + b"]" * 5000,
            b'{"cniVersion": "1.1.0"' + b" " * (2 << 20) + b"}",
            b'{"cniVersion": "1.1.0", "timeout": NaN}',
            b'{"cniVersion": "1.1.0", "timeout": Infinity}',
            b'{"cniVersion": "1.1.0", "a": "\\ud800"}',
            b'{"cniVersion": "1.1.0"}\x00',
        ]
    )
    return st.one_of(configs, configs, configs, broken, st.binary(max_size=64))


def environment() -> st.SearchStrategy[dict[str, str]]:
    fields = dict.fromkeys(ENVIRONMENT, ENV_TEXT)
    fields["CNI_COMMAND"] = st.one_of(st.sampled_from(COMMANDS), ENV_TEXT)
    fields["CNI_CONTAINERID"] = st.one_of(st.just("ctr-fuzz"), ENV_TEXT)
    return st.fixed_dictionaries({}, optional=fields)


def check_output(env: dict[str, str], data: bytes) -> None:
    run_env = {"PATH": os.environ.get("PATH", ""), **env}
    try:
        proc = subprocess.run(
            [PLUGIN],
            input=data,
            capture_output=True,
            env=run_env,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"flagella-cni hung: env {env!r}, stdin {data[:200]!r}")
    where = f"env {env!r}, stdin {data[:200]!r}: exit {proc.returncode}, stdout {proc.stdout[:500]!r}, stderr {proc.stderr[-2000:]!r}"
    assert b"Traceback" not in proc.stderr, where
    if proc.returncode == 0 and not proc.stdout.strip():
        return  # DEL, CHECK, GC succeed silently
    out = json.loads(proc.stdout)
    assert isinstance(out, dict), where
    assert isinstance(out.get("cniVersion"), str), where
    if proc.returncode != 0:
        assert isinstance(out.get("code"), int), where
        assert not isinstance(out.get("code"), bool), where
        assert isinstance(out.get("msg"), str), where
        assert out["msg"], where
    else:
        assert "code" not in out, where


@pytest.fixture(scope="module")
def cni_socket(plane: Plane) -> Iterator[str]:
    """The node socket of node NODE's datapath relay, in front of the real
    endpoint service."""
    with node_relay(plane.cluster.services["endpoint"].address, NODE) as path:
        yield path


def test_fuzz_cni_plugin(cni_socket: str) -> None:
    def one(env: dict[str, str], body: bytes) -> None:
        check_output(env, body)

    for env, body in REGRESSIONS:
        one = example(env=env, body=body.replace(b"@SOCKET@", cni_socket.encode()))(one)
    settings(
        max_examples=EXAMPLES * 2,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )(given(env=environment(), body=stdin(cni_socket))(one))()
