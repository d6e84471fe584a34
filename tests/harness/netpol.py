"""The Kubernetes e2e NetworkPolicy suite's model, truth tables and probes
(kubernetes/kubernetes test/e2e/network/netpol: model.go, reachability.go,
truthtable.go, policies.go, probe.go), ported for flagella's privileged
tests (tests/e2e/test_netpol_upstream.py).

- The model: namespaces x, y, z labelled `ns: <name>` (the API server adds
  `kubernetes.io/metadata.name`), pods a, b, c in each labelled `pod: <name>`,
  each serving TCP and UDP (and SCTP when the kernel has it) on ports 80 and
  81, with upstream's named container ports (`serve-80-tcp`, ...).
- Reachability: the expected truth table over all 81 (from, to) pairs,
  default true, changed with upstream's Expect / ExpectPeer /
  ExpectAllIngress / ExpectAllEgress, compared with what was probed and
  printed as upstream prints it on a mismatch (loopback pairs are ignored, as
  upstream ignores them).
- Probes: one long-lived prober process per source pod (inside its netns)
  probes all targets of a round concurrently; a TCP probe is a connect and an
  answer naming the target pod within the timeout, a UDP probe a datagram
  answered by the target pod (sent up to three times within the timeout).
  The 9 probers of a round run at once: a round takes about one timeout.
  A probe is allowed (True) when the target pod answers, denied (False) when
  it times out or is reset, and neither (None, a mismatch whatever the table
  says) otherwise: refused, unreachable, or another pod answering means the
  packet was not dropped by policy, nor delivered to the right server.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from harness.netns import Netns

NAMESPACES = ("x", "y", "z")
POD_NAMES = ("a", "b", "c")
PORTS = (80, 81)
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
PROBE_TIMEOUT_S = 1.0


def sctp_missing() -> str | None:
    """Why SCTP cannot be served or probed here, or None when it can."""
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_SCTP).close()
    except OSError as e:
        return f"the kernel has no SCTP (socket(AF_INET, SOCK_STREAM, IPPROTO_SCTP): {e})"
    return None


def protocols() -> tuple[str, ...]:
    """The protocols the pods serve: upstream's, less what the kernel lacks."""
    return ("TCP", "UDP") if sctp_missing() else ("TCP", "UDP", "SCTP")


def pod_strings() -> list[str]:
    """Every pod as upstream writes it: "x/a", ..., "z/c"."""
    return [f"{ns}/{pod}" for ns in NAMESPACES for pod in POD_NAMES]


def namespace_object(name: str, extra: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A Namespace with upstream's label (model.go: Namespace.LabelSelector)."""
    return {"metadata": {"name": name, "labels": {"ns": name, **(extra or {})}}}


def pod_labels(name: str) -> dict[str, str]:
    """Upstream's pod labels (model.go: Pod.LabelSelector)."""
    return {"pod": name}


def pod_object(namespace: str, name: str, node: str, labels: Mapping[str, str]) -> dict[str, Any]:
    """A Pod as upstream's model makes it: one container per port and
    protocol, each with its named container port (model.go: Container.Spec)."""
    containers = [
        {
            "name": f"cont-{port}-{proto.lower()}",
            "image": "registry.k8s.io/e2e-test-images/agnhost:2.53",
            "ports": [
                {"containerPort": port, "name": f"serve-{port}-{proto.lower()}", "protocol": proto}
            ],
        }
        for port in PORTS
        for proto in protocols()
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": namespace, "name": name, "labels": dict(labels)},
        "spec": {"nodeName": node, "serviceAccountName": "default", "containers": containers},
    }


def network_policy(
    namespace: str,
    name: str,
    pod_selector: Mapping[str, Any],
    *,
    ingress: list[dict[str, Any]] | None = None,
    egress: list[dict[str, Any]] | None = None,
    policy_types: list[str] | None = None,
) -> dict[str, Any]:
    """A NetworkPolicy as upstream's helpers build it (policies.go):
    ingress/egress given (even empty) adds its direction to policyTypes, in
    that order, unless policy_types names them."""
    spec: dict[str, Any] = {"podSelector": dict(pod_selector)}
    types = []
    if ingress is not None:
        spec["ingress"] = ingress
        types.append("Ingress")
    if egress is not None:
        spec["egress"] = egress
        types.append("Egress")
    spec["policyTypes"] = policy_types if policy_types is not None else types
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"namespace": namespace, "name": name},
        "spec": spec,
    }


@dataclass(frozen=True)
class Peer:
    """Upstream's Peer: a namespace and/or a pod name; empty matches all."""

    namespace: str = ""
    pod: str = ""

    def matches(self, pod: str) -> bool:
        ns, name = pod.split("/")
        return (not self.namespace or self.namespace == ns) and (not self.pod or self.pod == name)


class Reachability:
    """Expected connectivity between every pair of pods (reachability.go)."""

    def __init__(self, default: bool = True) -> None:
        self.pods = pod_strings()
        self.expected = {(f, t): default for f in self.pods for t in self.pods}

    def expect(self, src: str, dst: str, connected: bool) -> Reachability:
        self.expected[(src, dst)] = connected
        return self

    def expect_peer(self, src: Peer, dst: Peer, connected: bool) -> Reachability:
        for f, t in self.expected:
            if src.matches(f) and dst.matches(t):
                self.expected[(f, t)] = connected
        return self

    def expect_all_ingress(self, pod: str, connected: bool) -> Reachability:
        return self.expect_peer(Peer(), Peer(*pod.split("/")), connected)

    def expect_all_egress(self, pod: str, connected: bool) -> Reachability:
        return self.expect_peer(Peer(*pod.split("/")), Peer(), connected)

    def mismatches(self, observed: Mapping[tuple[str, str], bool | None]) -> list[tuple[str, str]]:
        """The pairs probed otherwise than expected, loopback ignored (as
        upstream's ignoreLoopback); a probe neither allowed nor denied (None)
        is always one."""
        return [
            (f, t) for (f, t), want in self.expected.items() if f != t and observed[(f, t)] != want
        ]

    def tables(self, observed: Mapping[tuple[str, str], bool | None]) -> str:
        """Expected, observed and their comparison, as upstream prints them
        (truthtable.go: "." connected / "X" blocked, "?" neither; "." same /
        "X" differs; rows are sources, columns destinations)."""

        def table(title: str, cell: Any) -> str:
            lines = [title, "-\t" + "\t".join(self.pods)]
            lines += [f + "\t" + "\t".join(cell(f, t) for t in self.pods) for f in self.pods]
            return "\n".join(lines)

        def mark(ok: bool | None) -> str:
            return "?" if ok is None else "." if ok else "X"

        return "\n\n".join(
            [
                table("Expected:", lambda f, t: mark(self.expected[(f, t)])),
                table("Observed:", lambda f, t: mark(observed[(f, t)])),
                table(
                    "Comparison (loopback ignored):",
                    lambda f, t: mark(f == t or self.expected[(f, t)] == observed[(f, t)]),
                ),
            ]
        )


# Serves each pod's ports: answers every TCP connection and UDP datagram
# with the pod's name ("x/a"), so a probe knows who answered.
SERVE = r"""
import asyncio, socket, sys
name, specs = sys.argv[1], sys.argv[2:]

class Udp(asyncio.DatagramProtocol):
    def connection_made(self, transport):
        self.transport = transport
    def datagram_received(self, data, addr):
        self.transport.sendto(name.encode() + b"\n", addr)

async def answer(reader, writer):
    try:
        await asyncio.wait_for(reader.readline(), 5)
        writer.write(name.encode() + b"\n")
        await writer.drain()
    except (OSError, asyncio.TimeoutError):
        pass
    finally:
        writer.close()

async def main():
    loop = asyncio.get_running_loop()
    for spec in specs:
        proto, port = spec.split(":")
        if proto == "UDP":
            await loop.create_datagram_endpoint(Udp, local_addr=("0.0.0.0", int(port)))
            continue
        kind = socket.IPPROTO_SCTP if proto == "SCTP" else 0
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, kind)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", int(port)))
        await asyncio.start_server(answer, sock=s, backlog=128)
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""

# Reads one round a line ({"proto", "port", "timeout", "targets": [[name,
# ip], ...]}), probes every target at once, answers one line: a JSON list of
# [verdict, detail] in the targets' order (verdict: true, the target pod
# answered; false, timed out or reset; null, anything else).
PROBER = r"""
import asyncio, json, socket, sys

async def stream(name, ip, port, timeout, kind):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, kind)
    s.setblocking(False)
    try:
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(loop.sock_connect(s, (ip, port)), timeout)
        await loop.sock_sendall(s, b"HELLO\n")
        got = (await asyncio.wait_for(loop.sock_recv(s, 4096), timeout)).decode().strip()
        return (True if got == name else None), got or "closed"
    except asyncio.TimeoutError:
        return False, "timeout"
    except ConnectionResetError:
        return False, "reset"
    except OSError as e:
        return None, e.strerror or str(e)
    finally:
        s.close()

async def datagram(name, ip, port, timeout):
    loop = asyncio.get_running_loop()
    got = loop.create_future()

    class Client(asyncio.DatagramProtocol):
        def datagram_received(self, data, addr):
            if not got.done():
                got.set_result(data)

        def error_received(self, exc):
            if not got.done():
                got.set_exception(exc)

    transport, _ = await loop.create_datagram_endpoint(Client, remote_addr=(ip, port))
    try:
        for _ in range(3):
            transport.sendto(b"HELLO\n")
            try:
                data = (await asyncio.wait_for(asyncio.shield(got), timeout / 3)).decode().strip()
                return (True if data == name else None), data
            except asyncio.TimeoutError:
                continue
            except OSError as e:
                return None, e.strerror or str(e)
        return False, "timeout"
    finally:
        transport.close()

async def probe(req, name, ip):
    proto, port, timeout = req["proto"], req["port"], req["timeout"]
    if proto == "UDP":
        return await datagram(name, ip, port, timeout)
    kind = socket.IPPROTO_SCTP if proto == "SCTP" else 0
    return await stream(name, ip, port, timeout, kind)

async def main():
    for line in sys.stdin:
        req = json.loads(line)
        out = await asyncio.gather(*(probe(req, n, ip) for n, ip in req["targets"]))
        print(json.dumps(out), flush=True)

asyncio.run(main())
"""


@dataclass
class ModelPod:
    """One of the 9 pods: "x/a", its netns and IPv4 address."""

    name: str
    ns: Netns
    ip: str


def serve(pod: ModelPod) -> subprocess.Popen[str]:
    """Start the pod's servers (every port and protocol of the model)."""
    specs = [f"{proto}:{port}" for port in PORTS for proto in protocols()]
    proc = pod.ns.popen(sys.executable, "-c", SERVE, pod.name, *specs)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "ready":
        raise RuntimeError(f"servers of {pod.name} did not start: {line}")
    return proc


class Prober:
    """A prober process in one source pod, kept for the whole suite."""

    def __init__(self, pod: ModelPod) -> None:
        self.pod = pod
        self.proc = subprocess.Popen(
            pod.ns.cmd(sys.executable, "-u", "-c", PROBER),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def send(self, targets: Iterable[ModelPod], proto: str, port: int, timeout: float) -> None:
        req = {"proto": proto, "port": port, "timeout": timeout,
               "targets": [[t.name, t.ip] for t in targets]}  # fmt: skip
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()

    def receive(self, deadline: float) -> list[tuple[bool | None, str]]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], deadline)
        if not ready:
            raise TimeoutError(f"prober in {self.pod.name} did not answer in {deadline}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"prober in {self.pod.name} exited ({self.proc.poll()})")
        return [(verdict, str(detail)) for verdict, detail in json.loads(line)]

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@dataclass
class Round:
    """One probe of all 81 pairs on one port and protocol."""

    ok: dict[tuple[str, str], bool | None]
    detail: dict[tuple[str, str], str]


def probe_all(
    probers: Mapping[str, Prober],
    pods: Mapping[str, ModelPod],
    proto: str,
    port: int,
    timeout: float = PROBE_TIMEOUT_S,
) -> Round:
    """Every pod probes every pod, all at once."""
    targets = [pods[name] for name in pod_strings()]
    for prober in probers.values():
        prober.send(targets, proto, port, timeout)
    ok: dict[tuple[str, str], bool | None] = {}
    detail: dict[tuple[str, str], str] = {}
    for src, prober in probers.items():
        for target, (verdict, why) in zip(targets, prober.receive(timeout * 3 + 5), strict=True):
            ok[(src, target.name)] = verdict
            detail[(src, target.name)] = why
    return Round(ok, detail)


@contextlib.contextmanager
def probers(pods: Mapping[str, ModelPod]) -> Iterator[dict[str, Prober]]:
    started = {name: Prober(pod) for name, pod in pods.items()}
    try:
        yield started
    finally:
        for p in started.values():
            p.close()
