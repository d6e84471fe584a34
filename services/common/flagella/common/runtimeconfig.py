"""Runtime configuration (Cilium's GetConfig/PatchConfig): the options, what
they take, and how the cluster's values and a node's overrides make the
values a datapath applies. The policy service stores and validates them;
every datapath follows them (WatchConfig) and applies them live.

Pure logic: no grpc, no etcd. docs/runtime-config.md lists the options.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from flagella.common.errors import InvalidArgument, map_key

log = logging.getLogger(__name__)

BOOL = ("false", "true")
# Cilium's enable-policy: enforce where a rule selects the endpoint, on
# every endpoint (no rule: deny all), or nowhere.
ENFORCEMENT = ("default", "always", "never")
# Cilium's monitor-aggregation, onto the datapath's policy-verdict events
# (drops are always reported): none and low every allowed new connection,
# medium only where policy is enforced, maximum none.
AGGREGATION = ("none", "low", "medium", "maximum")
VERDICT_EVENTS = {"none": "all", "low": "all", "medium": "enforced", "maximum": "none"}


@dataclass(frozen=True)
class OptionSpec:
    name: str
    # The value when nothing is set; "": the datapath's own start-up flag.
    default: str
    # The values it takes; empty for an immutable option.
    allowed: tuple[str, ...]
    mutable: bool
    description: str


OPTIONS: tuple[OptionSpec, ...] = (
    OptionSpec(
        "policy-enforcement",
        "default",
        ENFORCEMENT,
        True,
        "default: enforce where a rule selects the endpoint; always: every endpoint "
        "(no rule: deny all); never: no policy enforced",
    ),
    OptionSpec(
        "policy-audit-mode",
        "false",
        BOOL,
        True,
        "what the policy would drop passes and is reported as an AUDIT flow",
    ),
    OptionSpec("debug", "false", BOOL, True, "the datapath logs at debug level"),
    OptionSpec(
        "monitor-aggregation",
        "",
        AGGREGATION,
        True,
        "policy-verdict flow events: none/low every allowed new connection, medium where "
        "policy is enforced, maximum none (drops always); unset: the datapath's "
        "--verdict-events",
    ),
    OptionSpec("routing-mode", "", (), False, "native or tunnel: the datapath's --tunnel"),
    OptionSpec("bpf-root", "", (), False, "the pin folder: the datapath's --bpf-root"),
    OptionSpec("cluster-cidr", "", (), False, "the pod address pools: ipam's --cluster-cidr"),
    OptionSpec(
        "policy-map-max-entries",
        "",
        (),
        False,
        "the per-endpoint policy-map budget: the datapath's --policy-map-max-entries",
    ),
)
BY_NAME = {o.name: o for o in OPTIONS}


def validate_patch(values: Mapping[str, str], reset: Iterable[str]) -> None:
    """A PATCH's options and values: unknown or immutable options and
    invalid values are refused, naming the option."""
    for name, value in values.items():
        _check_name(name, map_key("set", name))
        spec = BY_NAME[name]
        if value not in spec.allowed:
            raise InvalidArgument(
                f"invalid value {value!r} (one of {', '.join(spec.allowed)})",
                field=map_key("set", name),
            )
    for i, name in enumerate(reset):
        _check_name(name, f"reset[{i}]")
        if name in values:
            raise InvalidArgument(f"{name} both set and reset", field=f"reset[{i}]")


def _check_name(name: str, field: str) -> None:
    spec = BY_NAME.get(name)
    if spec is None:
        raise InvalidArgument(
            f"unknown option {name!r} (mutable: {', '.join(mutable_names())})", field=field
        )
    if not spec.mutable:
        raise InvalidArgument(f"{name} is immutable (set at start-up)", field=field)


# The options an endpoint may override (PatchEndpointConfig).
ENDPOINT_OPTIONS = ("policy-enforcement", "policy-audit-mode")


def validate_endpoint_options(values: Mapping[str, str], field: str) -> None:
    """An endpoint's options: only ENDPOINT_OPTIONS, with values they take."""
    for name, value in values.items():
        if name not in ENDPOINT_OPTIONS:
            raise InvalidArgument(
                f"not an endpoint option: {name!r} (one of {', '.join(ENDPOINT_OPTIONS)})",
                field=map_key(field, name),
            )
        allowed = BY_NAME[name].allowed
        if value not in allowed:
            raise InvalidArgument(
                f"invalid value {value!r} (one of {', '.join(allowed)})", field=map_key(field, name)
            )


def mutable_names() -> list[str]:
    return [o.name for o in OPTIONS if o.mutable]


def effective(cluster: Mapping[str, str], node: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Every mutable option's value and where it comes from ("node",
    "cluster" or "default"). A stored value this version does not take is
    ignored (logged): the default, which never weakens policy."""
    out: dict[str, tuple[str, str]] = {}
    for spec in OPTIONS:
        if not spec.mutable:
            continue
        out[spec.name] = (spec.default, "default")
        for source, values in (("cluster", cluster), ("node", node)):
            value = values.get(spec.name)
            if value is None:
                continue
            if value in spec.allowed:
                out[spec.name] = (value, source)
            else:
                log.error(
                    "ignoring an invalid runtime option",
                    extra={"option": spec.name, "value": value, "source": source},
                )
    return out


@dataclass(frozen=True)
class RuntimeOptions:
    """What a datapath applies. The defaults are what a datapath runs with
    before (or without) the policy service's answer: enforcement as the
    rules say, no audit."""

    enforcement: str = "default"
    audit: bool = False
    debug: bool = False
    # "": the datapath's --verdict-events; else all, enforced or none.
    verdict_events: str = ""

    @classmethod
    def of(cls, cluster: Mapping[str, str], node: Mapping[str, str]) -> RuntimeOptions:
        values = {name: value for name, (value, _) in effective(cluster, node).items()}
        aggregation = values["monitor-aggregation"]
        return cls(
            enforcement=values["policy-enforcement"],
            audit=values["policy-audit-mode"] == "true",
            debug=values["debug"] == "true",
            verdict_events=VERDICT_EVENTS.get(aggregation, ""),
        )

    def for_endpoint(self, overrides: Mapping[str, str]) -> RuntimeOptions:
        """With an endpoint's own options over the node's (a value this
        version does not take is ignored: the node's holds)."""
        enforcement = overrides.get("policy-enforcement", self.enforcement)
        audit = overrides.get("policy-audit-mode")
        return dataclasses.replace(
            self,
            enforcement=enforcement if enforcement in ENFORCEMENT else self.enforcement,
            audit=audit == "true" if audit in BOOL else self.audit,
        )
