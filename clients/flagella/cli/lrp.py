"""`flagella lrp list|create|delete`: local redirect policies, as
`kubectl get/apply/delete ciliumlocalredirectpolicy` (create reads
CiliumLocalRedirectPolicy documents, YAML or JSON, in Cilium's shape)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from flagella.api.lb.v1 import lb_pb2
from flagella.cli.base import (
    PROTOCOL_NAMES,
    Clients,
    CliError,
    emit,
    read_input,
    to_dict,
    yaml_documents,
)


def documents(text: str, namespace: str) -> list[str]:
    """Each CiliumLocalRedirectPolicy of a YAML or JSON text, as the JSON
    the lb takes (which checks it and names the field); one that names no
    namespace gets namespace."""
    out = []
    for doc in yaml_documents(text):
        if isinstance(doc, dict) and isinstance(doc.get("metadata"), dict):
            doc["metadata"].setdefault("namespace", namespace)
        out.append(json.dumps(doc))
    return out


def _ports_str(ports: Any) -> str:
    return (
        ",".join(
            f"{p.name + '=' if p.name else ''}{p.port}/{PROTOCOL_NAMES.get(p.protocol, '?')}"
            for p in ports
        )
        or "*"
    )


def cmd_lrp(args: argparse.Namespace, clients: Clients) -> int:
    stub = clients.lb()
    if args.action == "list":
        resp = clients.call("lb", stub.GetLrp, lb_pb2.GetLrpRequest(namespace=args.namespace or ""))
        rows = []
        for p in resp.lrps:
            fe = p.redirect_frontend
            if fe.HasField("address_matcher"):
                front = f"{fe.address_matcher.ip} {_ports_str(fe.address_matcher.to_ports)}"
            else:
                sm = fe.service_matcher
                front = f"service {sm.service_name} {_ports_str(sm.to_ports)}"
            sel = p.redirect_backend.local_endpoint_selector
            rows.append(
                [
                    f"{p.namespace}/{p.name}",
                    front,
                    json.dumps(dict(sel.match_labels)),
                    _ports_str(p.redirect_backend.to_ports),
                    p.source,
                ]
            )
        header = ["NAME", "FRONTEND", "SELECTOR", "TO", "SOURCE"]
        emit(args, to_dict(resp).get("lrps", []), header, rows)
    elif args.action == "create":
        policies = documents(read_input(args.file), args.namespace or "default")
        created = []
        for p in policies:
            resp = clients.call("lb", stub.CreateLrp, lb_pb2.CreateLrpRequest(document=p))
            created.append(resp)
        emit(
            args,
            [to_dict(r) for r in created],
            ["NAME", "CREATED", "REVISION"],
            [[f"{r.lrp.namespace}/{r.lrp.name}", r.created, r.lrp.revision] for r in created],
        )
    else:
        namespace, _, name = args.name.rpartition("/")
        namespace = namespace or args.namespace or "default"
        deleted = clients.call(
            "lb", stub.DeleteLrp, lb_pb2.DeleteLrpRequest(namespace=namespace, name=name)
        ).deleted
        if not deleted:
            raise CliError(f"no local redirect policy {namespace}/{name}")
        emit(args, {"deleted": True}, ["DELETED"], [[f"{namespace}/{name}"]])
    return 0


def add_parser(sub: Any) -> None:
    lrp = sub.add_parser("lrp", help="local redirect policies (CiliumLocalRedirectPolicy)")
    actions = lrp.add_subparsers(dest="action", required=True)
    actions.add_parser("list").add_argument("-n", "--namespace")
    create = actions.add_parser("create", help="from CiliumLocalRedirectPolicy documents")
    create.add_argument("-f", "--file", required=True, help="YAML or JSON ('-': stdin)")
    create.add_argument("-n", "--namespace", help="for documents that name none (default)")
    delete = actions.add_parser("delete")
    delete.add_argument("name", help="namespace/name, or name with -n")
    delete.add_argument("-n", "--namespace")
    lrp.set_defaults(func=cmd_lrp)
