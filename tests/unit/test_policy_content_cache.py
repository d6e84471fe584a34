"""The policy servicer's cache of serialized contents keeps an entry only
while its content lives (the resolver holds the contents in use)."""

from __future__ import annotations

import gc

from flagella.policy.convert import ContentCache, content_bytes
from flagella.policy.resolve import PolicyContent


def _content(ingress: bool) -> PolicyContent:
    return PolicyContent(ingress_enforced=ingress, egress_enforced=not ingress, entries=())


def test_a_content_is_encoded_once_while_it_lives_and_its_entry_goes_with_it() -> None:
    cache = ContentCache()
    held = _content(True)
    raw = cache.get(held)
    assert raw == content_bytes(held)
    assert cache.get(held) is raw  # encoded once
    for _ in range(1000):
        cache.get(_content(False))  # dropped at once, as replaced contents are
    gc.collect()
    assert len(cache) == 1
    del held
    gc.collect()
    assert len(cache) == 0


def test_the_size_still_bounds_live_contents_and_a_reused_id_is_not_a_hit() -> None:
    cache = ContentCache(size=2)
    live = [_content(i % 2 == 0) for i in range(3)]
    for c in live:
        cache.get(c)
    assert len(cache) == 2
    for _ in range(100):
        # A dead content's id is often reused at once by the next one: the
        # answer must be the new content's bytes, never the cached ones.
        cache.get(_content(True))
        other = _content(False)
        assert cache.get(other) == content_bytes(other)
