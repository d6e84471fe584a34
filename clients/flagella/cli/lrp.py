"""`flagella lrp list|create|delete`: local redirect policies, as
`kubectl get/apply/delete ciliumlocalredirectpolicy` (create reads
CiliumLocalRedirectPolicy documents, YAML or JSON, in Cilium's shape)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from flagella.api.lb.v1 import lb_pb2
from flagella.cli.base import PROTOCOL_NAMES, Clients, CliError, emit, to_dict

_PROTOCOLS = {"TCP": lb_pb2.PROTOCOL_TCP, "UDP": lb_pb2.PROTOCOL_UDP}


def _map(doc: Any, path: str) -> Mapping[str, Any]:
    if doc is None:
        return {}
    if not isinstance(doc, Mapping):
        raise CliError(f"{path}: must be an object")
    return doc


def _ports(items: Any, path: str) -> list[lb_pb2.LrpPort]:
    if items is None:
        return []
    if not isinstance(items, list):
        raise CliError(f"{path}: must be a list")
    out = []
    for i, item in enumerate(items):
        at = f"{path}[{i}]"
        p = _map(item, at)
        try:
            port = int(p.get("port", 0))  # Cilium writes it as a string
        except (TypeError, ValueError):
            raise CliError(f"{at}.port: {p.get('port')!r} is not a port number") from None
        proto = str(p.get("protocol", "TCP")).upper()
        if proto not in _PROTOCOLS:
            raise CliError(f"{at}.protocol: {p.get('protocol')!r} is not TCP or UDP")
        out.append(
            lb_pb2.LrpPort(name=str(p.get("name", "")), port=port, protocol=_PROTOCOLS[proto])
        )
    return out


def from_cilium(doc: Any, namespace: str = "") -> lb_pb2.LocalRedirectPolicy:
    """A CiliumLocalRedirectPolicy document as the lb's message (the lb
    validates the rest and names the field)."""
    doc = _map(doc, "document")
    if doc.get("kind") != "CiliumLocalRedirectPolicy":
        raise CliError(f"kind: {doc.get('kind')!r} is not CiliumLocalRedirectPolicy")
    meta = _map(doc.get("metadata"), "metadata")
    spec = _map(doc.get("spec"), "spec")
    out = lb_pb2.LocalRedirectPolicy(
        name=str(meta.get("name", "")),
        namespace=str(meta.get("namespace") or namespace or "default"),
        description=str(spec.get("description", "")),
        skip_redirect_from_backend=bool(spec.get("skipRedirectFromBackend", False)),
    )
    fe = _map(spec.get("redirectFrontend"), "spec.redirectFrontend")
    given = [k for k in ("addressMatcher", "serviceMatcher") if k in fe]
    if len(given) != 1:
        raise CliError("spec.redirectFrontend: give exactly one of addressMatcher, serviceMatcher")
    path = f"spec.redirectFrontend.{given[0]}"
    m = _map(fe[given[0]], path)
    if given[0] == "addressMatcher":
        out.redirect_frontend.address_matcher.ip = str(m.get("ip", ""))
        out.redirect_frontend.address_matcher.to_ports.extend(
            _ports(m.get("toPorts"), f"{path}.toPorts")
        )
    else:
        sm = out.redirect_frontend.service_matcher
        sm.service_name = str(m.get("serviceName", ""))
        sm.namespace = str(m.get("namespace", ""))
        sm.to_ports.extend(_ports(m.get("toPorts"), f"{path}.toPorts"))
    be = _map(spec.get("redirectBackend"), "spec.redirectBackend")
    if be:
        out.redirect_backend.SetInParent()
    if "localEndpointSelector" in be:
        sel_doc = _map(be["localEndpointSelector"], "spec.redirectBackend.localEndpointSelector")
        sel = out.redirect_backend.local_endpoint_selector
        sel.SetInParent()
        labels = _map(sel_doc.get("matchLabels"), "spec.redirectBackend.localEndpointSelector")
        sel.match_labels.update({str(k): str(v) for k, v in labels.items()})
        for i, item in enumerate(sel_doc.get("matchExpressions") or []):
            e = _map(item, f"spec.redirectBackend.localEndpointSelector.matchExpressions[{i}]")
            sel.match_expressions.add(
                key=str(e.get("key", "")),
                operator=str(e.get("operator", "")),
                values=[str(v) for v in e.get("values") or []],
            )
    out.redirect_backend.to_ports.extend(_ports(be.get("toPorts"), "spec.redirectBackend.toPorts"))
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
                ]
            )
        emit(args, to_dict(resp).get("lrps", []), ["NAME", "FRONTEND", "SELECTOR", "TO"], rows)
    elif args.action == "create":
        try:
            text = Path(args.file).read_text() if args.file != "-" else sys.stdin.read()
            docs = [d for d in yaml.safe_load_all(text) if d is not None]
        except OSError as exc:
            raise CliError(f"cannot read {args.file}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise CliError(f"{args.file}: not YAML or JSON: {exc}") from None
        policies = [from_cilium(d, args.namespace or "") for d in docs]
        created = []
        for p in policies:
            resp = clients.call("lb", stub.CreateLrp, lb_pb2.CreateLrpRequest(lrp=p))
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
