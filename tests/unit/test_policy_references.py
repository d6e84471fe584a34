"""Identity references in a replica's mirror: the anonymous count of a node
and its owners' references (one key each), counted together per
(identity, node), and the keys they live under."""

from __future__ import annotations

import random

import pytest
from policy_world import FakeKV, World

from flagella.common.errors import InvalidArgument
from flagella.policy import keys
from flagella.policy.state import PolicyState
from flagella.policy.validation import MAX_OWNER, check_owner

OWNER = "3f2a9c0d1e4b5a6978b0c1d2e3f4a5b6c7d8e9f00112233445566778899aabbc/eth0"


def test_owner_keys_round_trip_and_sit_under_the_node() -> None:
    labels = "k8s:app.kubernetes.io/name=a%b;k8s:x=y;"
    for owner in (OWNER, "a", "100%/x%2F/", "c/eth0.100"):
        key = keys.owner_key(labels, "node-1", owner)
        assert key.startswith(keys.owners_prefix(labels, "node-1"))
        assert key.startswith(keys.ref_prefix(labels))
        assert not key.startswith(keys.owners_prefix(labels, "node-10"))
        parsed = keys.parse_key(key)
        assert (parsed.kind, parsed.a, parsed.b, parsed.c) == ("ref", labels, "node-1", owner)
    anonymous = keys.parse_key(keys.ref_key(labels, "node-1"))
    assert (anonymous.kind, anonymous.b, anonymous.c) == ("ref", "node-1", "")
    # a node's owners are not under another node whose name extends it
    assert not keys.owner_key(labels, "node-10", "a").startswith(
        keys.owners_prefix(labels, "node-1")
    )
    for bad in ("x", "x/", "x/n/", "x//o", "x/n/o/p"):
        assert keys.parse_key(keys.VALUE_PREFIX + bad).kind == ""


def test_owner_validation() -> None:
    assert check_owner("") == ""
    assert check_owner(OWNER) == OWNER
    assert check_owner("x" * MAX_OWNER)
    for bad in ("x" * (MAX_OWNER + 1), "a\nb", "tab\there", "nul\0"):
        with pytest.raises(InvalidArgument) as info:
            check_owner(bad)
        assert info.value.field == "owner"


class Refs:
    """Reference keys of one identity put into a World's state, and into
    model (key -> value) as etcd would hold them."""

    def __init__(self, world: World, ident: int, model: dict[str, bytes] | None = None) -> None:
        self.world = world
        self.ident = ident
        self.model = {} if model is None else model
        gid = world.state.identities[ident]
        self.labels = gid.label_string

    def _put(self, key: str, value: bytes) -> None:
        self.world._put(key, value, 7)
        self.model[key] = value

    def _delete(self, key: str) -> None:
        self.world._delete(key)
        self.model.pop(key, None)

    def anonymous(self, node: str, refs: int) -> None:
        self._put(keys.ref_key(self.labels, node), keys.dumps({"id": self.ident, "refs": refs}))

    def drop_anonymous(self, node: str) -> None:
        self._delete(keys.ref_key(self.labels, node))

    def owner(self, node: str, owner: str) -> None:
        self._put(keys.owner_key(self.labels, node, owner), keys.dumps({"id": self.ident}))

    def drop_owner(self, node: str, owner: str) -> None:
        self._delete(keys.owner_key(self.labels, node, owner))


def test_anonymous_and_owned_references_count_together() -> None:
    world = World()
    web = world.pod("web", "shop", app="web")
    refs = Refs(world, web)
    state = world.state

    refs.anonymous("n1", 2)
    refs.owner("n1", OWNER)
    refs.owner("n1", "c2/eth0")
    refs.owner("n2", OWNER)  # the same owner name on another node is another owner
    change = world.commit()
    assert change.nodes == {"n1": {web}, "n2": {web}}
    assert state.refs_by_id[web] == {"n1": 4, "n2": 1}
    assert state.node_refs == {"n1": {web: 4}, "n2": {web: 1}}
    assert state.referenced_by(web) == ["n1", "n2"]
    assert state.node_identities("n1") == {web}
    held = state.owner_ref(refs.labels, "n1", OWNER)
    assert held is not None
    assert (held.id, held.lease) == (web, 7)
    assert state.owner_ref(refs.labels, "n1", "nobody") is None
    assert web not in {g.id for g in state.unreferenced_identities()}

    # an owner's repeat put (same key) counts once
    refs.owner("n1", OWNER)
    world.commit()
    assert state.node_refs["n1"][web] == 4

    refs.drop_anonymous("n1")
    change = world.commit()
    assert change.nodes == {"n1": {web}}
    assert state.node_refs["n1"] == {web: 2}
    refs.drop_owner("n1", OWNER)
    world.commit()
    assert state.node_refs["n1"] == {web: 1}
    assert state.owner_ref(refs.labels, "n1", OWNER) is None
    refs.drop_owner("n1", "c2/eth0")
    change = world.commit()
    assert change.nodes == {"n1": {web}}
    assert "n1" not in state.node_refs
    assert state.referenced_by(web) == ["n2"]
    assert (refs.labels, "n1") not in state.owners
    refs.drop_owner("n2", OWNER)
    world.commit()
    assert web not in state.refs_by_id
    assert state.node_refs == {}
    assert state.owners == {}
    assert web in {g.id for g in state.unreferenced_identities()}
    # deleting what is not there changes nothing
    refs.drop_owner("n2", OWNER)
    assert not world.commit().nodes


def test_one_owner_holds_two_identities() -> None:
    world = World()
    old = world.pod("old", "shop", app="web", version="1")
    new = world.pod("new", "shop", app="web", version="2")
    Refs(world, old).owner("n1", OWNER)
    Refs(world, new).owner("n1", OWNER)
    world.commit()
    assert world.state.node_refs["n1"] == {old: 1, new: 1}
    assert set(world.state.node_policies("n1")) == {old, new}
    Refs(world, old).drop_owner("n1", OWNER)
    change = world.commit()
    assert change.nodes == {"n1": {old}}
    assert world.state.node_refs["n1"] == {new: 1}


def test_an_unreadable_owner_value_changes_nothing() -> None:
    world = World()
    web = world.pod("web", "shop", app="web")
    refs = Refs(world, web)
    refs.owner("n1", OWNER)
    world.commit()
    world._put(keys.owner_key(refs.labels, "n1", OWNER), b'{"no": "id"}', 7)
    world.commit()
    held = world.state.owner_ref(refs.labels, "n1", OWNER)
    assert held is not None
    assert world.state.node_refs["n1"] == {web: 1}


@pytest.mark.parametrize("seed", range(5))
def test_incremental_references_equal_a_fresh_snapshot(seed: int) -> None:
    """Random puts and deletes of anonymous counts and owners' references
    leave the state a snapshot of the resulting keys gives, and the counts
    the keys say."""
    rng = random.Random(seed)
    world = World()
    ids = [world.pod(f"p{i}", "ns", app=f"a{i}") for i in range(3)]
    model: dict[str, bytes] = {}
    all_refs = [Refs(world, i, model) for i in ids]
    nodes = ["n1", "n2", "n3"]
    owners = ["", "c1/eth0", "c2/eth0", "c3/eth1"]
    for _ in range(300):
        refs, node, owner = rng.choice(all_refs), rng.choice(nodes), rng.choice(owners)
        if rng.random() < 0.55:
            if owner:
                refs.owner(node, owner)
            else:
                refs.anonymous(node, rng.randint(1, 3))
        elif owner:
            refs.drop_owner(node, owner)
        else:
            refs.drop_anonymous(node)
        if rng.random() < 0.3:
            world.commit()
    world.commit()

    expected: dict[str, dict[int, int]] = {}
    for key, value in model.items():
        parsed = keys.parse_key(key)
        refs_here = 1 if parsed.c else int(keys.loads(value)["refs"])
        ident = int(keys.loads(value)["id"])
        on_node = expected.setdefault(parsed.b, {})
        on_node[ident] = on_node.get(ident, 0) + refs_here
    assert world.state.node_refs == expected

    id_keys = [
        FakeKV(keys.id_key(i), keys.dumps({"labels": [str(lb) for lb in gid.labels]}), 1, 1)
        for i, gid in world.state.identities.items()
    ]
    ref_keys = [FakeKV(k, v, 2, 2, 7) for k, v in model.items()]
    fresh = PolicyState.from_snapshot([*id_keys, *ref_keys], world.rev)
    assert world.state.refs_by_id == fresh.refs_by_id
    assert world.state.node_refs == fresh.node_refs
    assert {k: set(v) for k, v in world.state.owners.items()} == {
        k: set(v) for k, v in fresh.owners.items()
    }
    assert world.state.refs.keys() == fresh.refs.keys()
    assert world.state.lease_keys == fresh.lease_keys
    assert {g.id for g in world.state.unreferenced_identities()} == {
        g.id for g in fresh.unreferenced_identities()
    }
