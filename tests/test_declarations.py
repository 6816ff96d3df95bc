"""What the code reads of a backend or a cache is declared on its base class and read directly (no
``getattr(x, name, default)`` or ``hasattr`` probing), and a class is what it says it is."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.cache import BaseLayerCache, LayerCache, PagedKVCache, PagedLayerCache, StateCache
from attnkit.registry import Backend


def test_every_backend_declares_whether_it_compiles():
    assert Backend.compiles is False
    assert {name for name, impl in attnkit.list_backends().items() if impl.compiles} <= {"flex"}


def test_a_recurrent_state_cache_is_a_layer_cache_base_but_no_key_value_cache():
    state = StateCache.recurrent("linear", 8)
    assert isinstance(state, BaseLayerCache) and not isinstance(state, LayerCache)
    assert not hasattr(state, "update")  # it computes attention itself: step(q, k, v)


def test_only_a_paged_cache_takes_packed_sequences_and_the_others_say_so():
    assert LayerCache.update_packed is not PagedLayerCache.update_packed
    with pytest.raises(TypeError, match="PagedKVCache"):
        attnkit.cache.DynamicLayerCache().update_packed(torch.zeros(3, 2, 4), torch.zeros(3, 2, 4),
                                                        torch.tensor([0, 3]))


def test_a_paged_layer_cache_is_initialised_by_its_base():
    calls = []
    original = LayerCache.__init__

    def spy(self):
        calls.append(type(self).__name__)
        original(self)

    LayerCache.__init__ = spy
    try:
        PagedKVCache(1, num_blocks=4, block_size=2)
    finally:
        LayerCache.__init__ = original
    assert calls == ["PagedLayerCache"]


def test_only_kernelized_backends_have_a_recurrent_state_and_the_others_say_why():
    assert Backend.feature_maps is None and Backend.no_recurrent_reason.startswith("Fix:")
    with_state = {name for name, impl in attnkit.list_backends().items() if impl.feature_maps is not None}
    assert with_state == {"linear", "performer"}
    for name in ("lsh", "sdpa"):
        with pytest.raises(ValueError, match=rf"^backend: '{name}' has no recurrent state.* Fix:"):
            attnkit.RecurrentState.create(name, 8)
