"""The pure logic of the runtime configuration and of labels with sources:
option validation, how the cluster's, a node's and an endpoint's values
merge (never weaker than the defaults on a value this version does not
take), how enforcement and audit shape an endpoint's policy, and how an
endpoint's labels split by source."""

from __future__ import annotations

import pytest

from flagella.common import runtimeconfig as rc
from flagella.common.errors import InvalidArgument
from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf.policy import PolicyEntry
from flagella.datapath.service import IdentityPolicy, _with_runtime
from flagella.endpoint.labelsources import LabelPatch, custom_key, label_sources, pod_label_key
from flagella.endpoint.model import Endpoint


def test_patch_validation_names_the_option() -> None:
    rc.validate_patch({"policy-audit-mode": "true", "monitor-aggregation": "maximum"}, ["debug"])
    for values, reset, field in [
        ({"policy-audit-mode": "yes"}, [], "set[policy-audit-mode]"),
        ({"cluster-cidr": "10.0.0.0/8"}, [], "set[cluster-cidr]"),
        ({"nope": "1"}, [], "set[nope]"),
        ({}, ["debug", "bpf-root"], "reset[1]"),
        ({"debug": "true"}, ["debug"], "reset[0]"),
    ]:
        with pytest.raises(InvalidArgument) as err:
            rc.validate_patch(values, reset)
        assert err.value.field == field
    with pytest.raises(InvalidArgument) as err:
        rc.validate_endpoint_options({"debug": "true"}, "set")
    assert err.value.field == "set[debug]"


def test_values_merge_node_over_cluster_and_unreadable_ones_are_the_defaults() -> None:
    eff = rc.effective({"debug": "true", "policy-audit-mode": "true"}, {"policy-audit-mode": "x"})
    assert eff["debug"] == ("true", "cluster")
    # An invalid stored value never turns audit on.
    assert eff["policy-audit-mode"] == ("true", "cluster")
    assert rc.effective({"policy-audit-mode": "maybe"}, {})["policy-audit-mode"] == (
        "false",
        "default",
    )
    opts = rc.RuntimeOptions.of(
        {"monitor-aggregation": "medium", "policy-audit-mode": "true"},
        {"policy-enforcement": "always"},
    )
    assert opts == rc.RuntimeOptions("always", True, False, "enforced")
    assert rc.RuntimeOptions.of({}, {}) == rc.RuntimeOptions()
    ep = opts.for_endpoint({"policy-audit-mode": "false", "policy-enforcement": "bogus"})
    assert (ep.enforcement, ep.audit) == ("always", False)


ALLOW_ALL_EGRESS = PolicyEntry(identity=0, direction=L.Direction.EGRESS)
FROM_WEB = PolicyEntry(identity=300, direction=L.Direction.INGRESS, protocol=6, port=80)


def policy(error: str = "") -> IdentityPolicy:
    return IdentityPolicy(
        identity=400,
        revision=7,
        ingress_enforced=True,
        egress_enforced=False,
        entries=(ALLOW_ALL_EGRESS, FROM_WEB),
        error=error,
    )


def test_enforcement_and_audit_shape_the_endpoint_policy() -> None:
    pol = policy()
    assert _with_runtime(pol, rc.RuntimeOptions()) == pol
    always = _with_runtime(pol, rc.RuntimeOptions(enforcement="always"))
    # The allow-all of the direction no rule selects goes: deny all there.
    assert (always.ingress_enforced, always.egress_enforced, always.entries) == (
        True,
        True,
        (FROM_WEB,),
    )
    never = _with_runtime(pol, rc.RuntimeOptions(enforcement="never"))
    assert (never.ingress_enforced, never.egress_enforced) == (False, False)
    assert _with_runtime(pol, rc.RuntimeOptions(audit=True)).audit
    # A policy sent fail-closed is never audited.
    assert not _with_runtime(policy(error="over budget"), rc.RuntimeOptions(audit=True)).audit


def endpoint(**kw: object) -> Endpoint:
    ep = Endpoint(id=5, container_id="c", ifname="eth0", netns_path="/n", node="n1")
    ep.pod_namespace = "shop"
    ep.labels = {"app": "web", "pod-template-hash": "5d4f"}
    ep.identity = 900
    for k, v in kw.items():
        setattr(ep, k, v)
    return ep


def test_label_sources_and_patches() -> None:
    assert custom_key("tier", "f") == "unspec:tier"
    assert custom_key("container:tier", "f") == "container:tier"
    for bad in ("reserved:host", "cidr:x"):
        with pytest.raises(InvalidArgument):
            custom_key(bad, "f")
    with pytest.raises(InvalidArgument):
        pod_label_key("k8s:io.kubernetes.pod.namespace", "f")

    ep = endpoint(custom_labels={"container:tier": "db"}, disabled_labels=["k8s:app"])
    in_identity = {("k8s", "io.kubernetes.pod.namespace", "shop"), ("container", "tier", "db")}
    s = label_sources(ep, in_identity)
    assert s.orchestration_identity == [("k8s", "io.kubernetes.pod.namespace", "shop")]
    assert s.orchestration_info == [("k8s", "pod-template-hash", "5d4f")]
    assert s.custom == [("container", "tier", "db")]
    assert s.disabled == [("k8s", "app", "web")]

    patch = LabelPatch(delete_custom=("container:tier",), enable=("k8s:app",))
    assert patch.applied(ep, ep.labels) == ({}, [])
    # A disabled label the pod loses is no longer disabled; one it never had is refused.
    assert LabelPatch().applied(ep, {"pod-template-hash": "5d4f"}) == (
        {"container:tier": "db"},
        [],
    )
    with pytest.raises(InvalidArgument) as err:
        LabelPatch(disable=("k8s:nope",)).applied(ep, ep.labels)
    assert err.value.field == "disable[0]"
