#!/usr/bin/env python3
"""The demo scripts/up ends with: pods created through the CNI plugin exactly
as a container runtime runs it, talking, a policy keeping one out, a
service reached; with a second node (scripts/second-node), a pod there
reaching one here through the tunnel, and kept out by the same policy with
its true identity. Runs against the local bring-up (scripts/up), as root.
Everything it creates (network namespaces, endpoints, the policy, the
service) is removed at the end."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc

from flagella.api.lb.v1 import lb_pb2, lb_pb2_grpc
from flagella.cli import certs

BIN = Path(sys.executable).parent
CNI = str(BIN / "flagella-cni")
CLI = [str(BIN / "flagella")]
# The plugin talks only to this node's datapath, over its socket.
CNI_SOCKET = os.environ.get("FLAGELLA_DATAPATH_CNI_SOCKET", "/run/flagella/cni.sock")
# The second node's (scripts/second-node), if it runs.
NODE2_SOCKET = os.environ.get(
    "FLAGELLA_NODE2_CNI_SOCKET",
    os.path.join(os.environ.get("FLAGELLA_SOCK_DIR", "/run/flagella/up"), "cni-node2.sock"),
)
LB = os.environ.get("FLAGELLA_LB_ADDRESS", "127.0.0.1:50054")
PODS = {"frontend": {"app": "frontend"}, "backend": {"app": "backend"}, "other": {"app": "other"}}
# A pod on the second node.
REMOTE = {"remote": {"app": "remote"}}
VIP = "10.96.100.10"
POLICY = """apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: backend-from-frontend, namespace: demo}
spec:
  endpointSelector: {matchLabels: {app: backend}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: frontend}}]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
"""
SERVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8080)); s.listen(16); print("ready", flush=True)
while True:
    c, peer = s.accept()
    c.sendall(f"hello from {sys.argv[1]}, you are {peer[0]}\n".encode()); c.close()
"""
CLIENT = r"""
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5)
    print(s.recv(200).decode().strip())
except OSError as e:
    print(f"no answer ({e})"); sys.exit(1)
"""


def say(text: str) -> None:
    print(f"\n--- {text}", flush=True)


def netns(name: str) -> str:
    return f"fl-demo-{name}"


def in_pod(pod: str, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["nsenter", f"--net=/run/netns/{netns(pod)}", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=check,
    )


def cni(command: str, pod: str, extra: dict[str, object] | None = None) -> dict[str, object]:
    conf = {
        "cniVersion": "1.1.0",
        "name": "flagella",
        "type": "flagella-cni",
        "socket": NODE2_SOCKET if pod in REMOTE else CNI_SOCKET,
        "args": {"cni": {"labels": {**PODS, **REMOTE}[pod]}},
        **(extra or {}),
    }
    env = {
        "PATH": os.environ["PATH"],
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": f"demo-{pod}",
        "CNI_NETNS": f"/run/netns/{netns(pod)}",
        "CNI_IFNAME": "eth0",
        "CNI_ARGS": f"K8S_POD_NAMESPACE=demo;K8S_POD_NAME={pod}",
    }
    proc = subprocess.run(
        [CNI],
        input=json.dumps(conf),
        capture_output=True,
        text=True,
        env=env,
        timeout=90,
        check=False,
    )
    out: dict[str, object] = json.loads(proc.stdout) if proc.stdout.strip() else {}
    if proc.returncode != 0:
        raise RuntimeError(f"CNI {command} {pod}: {out}")
    return out


def connect(src: str, host: str, port: int = 8080) -> str:
    out = in_pod(src, sys.executable, "-c", CLIENT, host, str(port))
    return out.stdout.strip()


def until(check: object, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.3)
    return False


def operator_channel(address: str) -> grpc.Channel:
    """As the CLI does: the operator certificate ($FLAGELLA_TLS_DIR or
    ~/.config/flagella/tls), plaintext with FLAGELLA_INSECURE=true."""
    parser = argparse.ArgumentParser()
    certs.add_tls_flags(parser)
    args = parser.parse_args([])
    if args.insecure:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, certs.channel_credentials(args))


def main() -> int:
    if os.geteuid() != 0:
        print("the demo needs root (it creates network namespaces)", file=sys.stderr)
        return 2
    servers: list[subprocess.Popen[str]] = []
    ips: dict[str, str] = {}
    pods = {**PODS, **(REMOTE if os.path.exists(NODE2_SOCKET) else {})}
    clients = ["frontend", "other", *(p for p in pods if p in REMOTE)]
    lb = lb_pb2_grpc.LoadBalancerServiceStub(operator_channel(LB))
    ok = True
    try:
        where = " (remote: on the second node, through its socket)" if "remote" in pods else ""
        say(f"{len(pods)} pods, each a network namespace, networked by `flagella-cni ADD`{where}")
        for pod, labels in pods.items():
            subprocess.run(["ip", "netns", "add", netns(pod)], check=True)
            result = cni("ADD", pod)
            ip = str(result["ips"][0]["address"]).split("/")[0]  # type: ignore[index]
            ips[pod] = ip
            iface = result["interfaces"][1]  # type: ignore[index]
            print(f"{pod:<9} {ip:<15} {iface['name']} in {iface['sandbox']}, labels {labels}")
        for pod in ("backend", "frontend"):
            proc = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{netns(pod)}", sys.executable, "-c", SERVER, pod],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert proc.stdout is not None
            proc.stdout.readline()
            servers.append(proc)

        say("no policy selects the backend: everyone reaches it (remote: across nodes)")
        if "remote" in pods:
            ok &= until(lambda: connect("remote", ips["backend"]).startswith("hello"))
        for src in clients:
            print(f"{src} -> backend:8080: {connect(src, ips['backend'])}")

        say("policy: only app=frontend may reach app=backend on TCP 8080 (flagella policy import)")
        path = Path("/tmp/flagella-demo-policy.yaml")
        path.write_text(POLICY)
        subprocess.run([*CLI, "policy", "import", str(path)], check=True)
        for src in clients[1:]:
            ok &= until(lambda src=src: connect(src, ips["backend"]).startswith("no answer"))
        for src in clients:
            print(f"{src} -> backend:8080: {connect(src, ips['backend'])}")
        print("what the datapaths saw (flagella observe --verdict dropped; every node's):")
        mon = subprocess.run(
            [*CLI, "observe", "--verdict", "dropped", "--last", str(len(clients))],
            capture_output=True,
            text=True,
            check=False,
        )
        print("  " + mon.stdout.strip().replace("\n", "\n  "))

        say("policy deleted: other reaches the backend again")
        subprocess.run(
            [*CLI, "policy", "delete", "demo/backend-from-frontend"],
            check=True,
            capture_output=True,
        )
        ok &= until(lambda: not connect("other", ips["backend"]).startswith("no answer"))
        print(f"other -> backend:8080: {connect('other', ips['backend'])}")
        if "remote" in pods:
            ok &= until(lambda: connect("remote", ips["backend"]).startswith("hello"))
            print(f"remote -> backend:8080: {connect('remote', ips['backend'])}")
            print("how the nodes reach each other (flagella status --nodes):")
            matrix = subprocess.run(
                [*CLI, "status", "--nodes"], capture_output=True, text=True, check=False
            )
            print("  " + matrix.stdout.strip().replace("\n", "\n  "))

        say(f"a ClusterIP service {VIP}:80 backed by frontend and backend, reached from other")
        lb.UpsertService(
            lb_pb2.UpsertServiceRequest(
                service=lb_pb2.Service(
                    name="demo/web",
                    frontend=lb_pb2.Frontend(address=VIP, port=80, protocol=lb_pb2.PROTOCOL_TCP),
                    type=lb_pb2.SERVICE_TYPE_CLUSTER_IP,
                    backends=[
                        lb_pb2.Backend(address=ips[p], port=8080) for p in ("frontend", "backend")
                    ],
                )
            ),
            timeout=10,
        )
        ok &= until(lambda: connect("other", VIP, 80).startswith("hello"))
        for _ in range(4):
            print(f"other -> {VIP}:80: {connect('other', VIP, 80)}")
    finally:
        say("cleaning up: CNI DEL, service, namespaces")
        for proc in servers:
            proc.kill()
            proc.wait(5)
        try:
            lb.DeleteService(lb_pb2.DeleteServiceRequest(name="demo/web"), timeout=10)
        except grpc.RpcError as exc:
            print(f"service delete: {exc.code().name}")
        for pod in pods:
            try:
                cni("DEL", pod)
            except (RuntimeError, OSError) as exc:
                print(exc)
            subprocess.run(["ip", "netns", "del", netns(pod)], check=False, capture_output=True)
        Path("/tmp/flagella-demo-policy.yaml").unlink(missing_ok=True)
    print("\ndemo " + ("done" if ok else "FAILED (see above)"))
    return 0 if ok else 1


if __name__ == "__main__":
    shutil.which("nsenter") or sys.exit("nsenter is missing")
    sys.exit(main())
