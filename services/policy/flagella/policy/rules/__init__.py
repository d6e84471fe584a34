"""Network policy rules: the model (model), field checks (validate), the
input formats (flagella_policy, k8s, and document, the entry point for
YAML/JSON text), the JSON stored in etcd (codec) and compilation for
resolution (compile). The names other modules use are re-exported here.
"""

from flagella.policy.rules.codec import (
    cidr_group_from_json,
    cidr_group_to_json,
    rule_from_json,
    rule_to_json,
)
from flagella.policy.rules.compile import (
    Clause,
    CompiledRule,
    PortKey,
    compile_rule,
    peer_selector,
    subject_selector,
)
from flagella.policy.rules.document import parse_document, parse_object
from flagella.policy.rules.flagella_policy import parse_flagella_policy
from flagella.policy.rules.k8s import parse_k8s_network_policy
from flagella.policy.rules.model import (
    ICMP_PROTOCOLS,
    PORT_PROTOCOLS,
    CIDRGroup,
    CIDRSpec,
    Direction,
    Expression,
    PeerSpec,
    PortSpec,
    Protocol,
    Rule,
    RuleSource,
    SelectorSpec,
    ServicePeer,
    Verdict,
    icmp_port,
    icmp_type_of,
)
from flagella.policy.rules.services import (
    ServiceInfo,
    backend_prefixes,
    check_service_peer,
    service_name,
)
from flagella.policy.rules.validate import (
    ENTITY_NAMES,
    MAX_GROUP_CIDRS,
    MAX_RULES_PER_PUT,
    PROTOCOL_NAMES,
    check_cidr,
    check_label_value,
    check_name,
    check_namespace,
    check_port,
    check_selector,
    check_unique,
    fail,
    parse_network,
    selector_key,
)

__all__ = [
    "ENTITY_NAMES",
    "ICMP_PROTOCOLS",
    "MAX_GROUP_CIDRS",
    "MAX_RULES_PER_PUT",
    "PORT_PROTOCOLS",
    "PROTOCOL_NAMES",
    "CIDRGroup",
    "CIDRSpec",
    "Clause",
    "CompiledRule",
    "Direction",
    "Expression",
    "PeerSpec",
    "PortKey",
    "PortSpec",
    "Protocol",
    "Rule",
    "RuleSource",
    "SelectorSpec",
    "ServiceInfo",
    "ServicePeer",
    "Verdict",
    "backend_prefixes",
    "check_cidr",
    "check_label_value",
    "check_name",
    "check_namespace",
    "check_port",
    "check_selector",
    "check_service_peer",
    "check_unique",
    "cidr_group_from_json",
    "cidr_group_to_json",
    "compile_rule",
    "fail",
    "icmp_port",
    "icmp_type_of",
    "parse_document",
    "parse_flagella_policy",
    "parse_k8s_network_policy",
    "parse_network",
    "parse_object",
    "peer_selector",
    "rule_from_json",
    "rule_to_json",
    "selector_key",
    "service_name",
    "subject_selector",
]
