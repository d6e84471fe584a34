"""The policy service's etcd layout (ARCHITECTURE.md "etcd layout") and
the JSON values stored under it.

flagella/state/identities/v1/
  id/<id>                         {"labels": [...]}          no lease
  labels/<sorted labels>          {"id": N}                  no lease (the
                                  create-if-absent guard: one id per label set)
  value/<sorted labels>/<node>    {"id": N, "refs": R}       node's lease
                                  (the node's anonymous references)
  value/<sorted labels>/<node>/<owner>
                                  {"id": N}                  node's lease
                                  (one owner's reference: one key per owner)
  nodes/<node>/<lease hex>        {"ttl": T, "by": replica}  that lease
flagella/state/ip/v1/<ip or cidr> {"identity", "node", "hostIP", "source"}
                                  node's lease when it names a node
flagella/state/fqdn/v1/<node>/<endpoint>/<name>
                                  {"ips": [...], "ttl": T, "expires": unix s,
                                  "lookup": unix s}   node's lease
                                  (the FQDN cache: what a name resolved to
                                  for an endpoint, as its node's DNS proxy
                                  saw the answer)
flagella/policy/v1/cidrgroups/<name>   {"cidrs": [...], "labels": {...}}
                                  (a CIDR group, as CiliumCIDRGroup)
flagella/policy/v1/rules/<namespace>/<name> or .../rules/<name>   rule JSON
flagella/policy/v1/config/cluster, .../config/nodes/<node>
                                  {"option": "value", ...} (the runtime
                                  configuration: runtimeconfig.py follows
                                  it with a source of its own; the mirror
                                  ignores it)

<sorted labels> is Cilium's ``source:key=value;`` list with '%' and '/'
percent-encoded so it is one key segment; so is <owner> (e.g.
"<container id>/eth0" is written "<container id>%2Feth0").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

IDENT_PREFIX = "flagella/state/identities/v1/"
ID_PREFIX = IDENT_PREFIX + "id/"
LABELS_PREFIX = IDENT_PREFIX + "labels/"
VALUE_PREFIX = IDENT_PREFIX + "value/"
NODES_PREFIX = IDENT_PREFIX + "nodes/"
IP_PREFIX = "flagella/state/ip/v1/"
FQDN_PREFIX = "flagella/state/fqdn/v1/"
POLICY_PREFIX = "flagella/policy/v1/"
CIDR_GROUPS_PREFIX = POLICY_PREFIX + "cidrgroups/"
RULES_PREFIX = POLICY_PREFIX + "rules/"
CONFIG_PREFIX = POLICY_PREFIX + "config/"
# Everything a replica mirrors, read in one transaction and watched as one
# key range [CIDR_GROUPS_PREFIX, end of IP_PREFIX) (keys of others in between are
# ignored).
MIRRORED_PREFIXES = (CIDR_GROUPS_PREFIX, RULES_PREFIX, FQDN_PREFIX, IDENT_PREFIX, IP_PREFIX)

NODE_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")


def enc(text: str) -> str:
    return text.replace("%", "%25").replace("/", "%2F")


def dec(text: str) -> str:
    return text.replace("%2F", "/").replace("%25", "%")


def id_key(ident: int) -> str:
    return f"{ID_PREFIX}{ident}"


def labels_key(labels: str) -> str:
    return LABELS_PREFIX + enc(labels)


def ref_prefix(labels: str) -> str:
    return f"{VALUE_PREFIX}{enc(labels)}/"


def ref_key(labels: str, node: str) -> str:
    """The node's anonymous reference count on the identity of labels."""
    return ref_prefix(labels) + node


def owners_prefix(labels: str, node: str) -> str:
    """Every owner's reference of node on the identity of labels."""
    return f"{ref_key(labels, node)}/"


def owner_key(labels: str, node: str, owner: str) -> str:
    return owners_prefix(labels, node) + enc(owner)


def node_lease_prefix(node: str) -> str:
    return f"{NODES_PREFIX}{node}/"


def node_lease_key(node: str, lease: int) -> str:
    return f"{node_lease_prefix(node)}{lease:x}"


def ip_key(prefix: str) -> str:
    return IP_PREFIX + prefix


def fqdn_node_prefix(node: str) -> str:
    return f"{FQDN_PREFIX}{node}/"


def fqdn_endpoint_prefix(node: str, endpoint: str) -> str:
    return f"{fqdn_node_prefix(node)}{enc(endpoint)}/"


def fqdn_key(node: str, endpoint: str, name: str) -> str:
    return fqdn_endpoint_prefix(node, endpoint) + name


def rule_key(name: str) -> str:
    return RULES_PREFIX + name


def cidr_group_key(name: str) -> str:
    return CIDR_GROUPS_PREFIX + name


@dataclass(frozen=True, slots=True)
class Parsed:
    kind: str  # id, labels, ref, node, ip, fqdn, rule, or "" when not ours
    a: str = ""
    b: str = ""
    c: str = ""  # a ref's owner ("": the node's anonymous count)


def parse_key(key: str) -> Parsed:
    if key.startswith(IDENT_PREFIX):
        if key.startswith(ID_PREFIX):
            rest = key[len(ID_PREFIX) :]
            return Parsed("id", rest) if rest.isdigit() else Parsed("")
        if key.startswith(LABELS_PREFIX):
            return Parsed("labels", dec(key[len(LABELS_PREFIX) :]))
        if key.startswith(VALUE_PREFIX):
            parts = key[len(VALUE_PREFIX) :].split("/")
            if len(parts) == 2 and all(parts):
                return Parsed("ref", dec(parts[0]), parts[1])
            if len(parts) == 3 and all(parts):
                return Parsed("ref", dec(parts[0]), parts[1], dec(parts[2]))
            return Parsed("")
        if key.startswith(NODES_PREFIX):
            node, sep, lease = key[len(NODES_PREFIX) :].rpartition("/")
            return Parsed("node", node, lease) if sep else Parsed("")
        return Parsed("")
    if key.startswith(IP_PREFIX):
        return Parsed("ip", key[len(IP_PREFIX) :])
    if key.startswith(FQDN_PREFIX):
        parts = key[len(FQDN_PREFIX) :].split("/")
        if len(parts) == 3 and all(parts):
            return Parsed("fqdn", parts[0], dec(parts[1]), parts[2])
        return Parsed("")
    if key.startswith(RULES_PREFIX):
        return Parsed("rule", key[len(RULES_PREFIX) :])
    if key.startswith(CIDR_GROUPS_PREFIX):
        return Parsed("cidrgroup", key[len(CIDR_GROUPS_PREFIX) :])
    return Parsed("")


def dumps(value: dict[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def loads(raw: bytes) -> dict[str, Any]:
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value
