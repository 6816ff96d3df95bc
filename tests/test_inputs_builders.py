"""The shared test builders give what they say: shapes, GQA, dtype, layout, offset, seeding."""

import torch

from .inputs import qkv, tiny_gpt


def test_qkv_shapes_layouts_and_seeding():
    q, k, v = qkv(2, 6, 2, 5, 7, 8, Dv=3)
    assert (q.shape, k.shape, v.shape) == ((2, 6, 5, 8), (2, 2, 7, 8), (2, 2, 7, 3))
    assert all(torch.equal(a, b) for a, b in zip(qkv(seed=4), qkv(seed=4)))
    assert not torch.equal(qkv(seed=4)[0], qkv(seed=5)[0])
    strided = qkv(non_contiguous=True, offset=3, dtype=torch.float64)
    assert all(not x.is_contiguous() and x.storage_offset() == 3 and x.dtype == torch.float64 for x in strided)
    assert all(x.requires_grad and x.is_leaf for x in qkv(requires_grad=True))


def test_tiny_gpt_is_seeded_and_configurable():
    a, b = tiny_gpt(num_kv_heads=2), tiny_gpt(num_kv_heads=2)
    assert not a.training and a.config.num_kv_heads == 2
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
