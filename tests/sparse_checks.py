"""Shared check for the tiled / sliding_window / block_sparse tests: outputs, LSE and gradients
against the float64 oracle under flash-attn's rule (naive in the same dtype sets the tolerance)."""

from __future__ import annotations

import torch

import attnkit
from tests.reference import flash_rule_ok, max_error, reference_attention, reference_attention_lowp
from tests.inputs import qkv


def make_qkv(B, Hq, Hkv, Tq, Tk, D, dtype=torch.float32, seed=0):
    return qkv(B, Hq, Hkv, Tq, Tk, D, dtype=dtype, seed=seed, requires_grad=True)


def check_against_reference(backend, q, k, v, *, mask=None, bias=None, options=None, q_offset=None, kv_offset=0,
                            grads=True):
    """Assert the flash-attn rule for out (2x), LSE and grads (3x); returns the outputs."""
    dtype = q.dtype
    out, lse = attnkit.attention(q, k, v, mask=mask, bias=bias, backend=backend, options=options,
                                 q_offset=q_offset, kv_offset=kv_offset, return_lse=True)
    # the yardstick: the independent low-precision reference (not a backend under test)
    n_out, n_lse = reference_attention_lowp(q, k, v, mask=mask, bias=bias, q_offset=q_offset, kv_offset=kv_offset)
    r_out, r_lse = reference_attention(q, k, v, mask=mask, bias=bias, q_offset=q_offset, kv_offset=kv_offset)
    assert out.shape == r_out.shape and out.dtype == dtype
    out_d, lse_d, n_out, n_lse, r_out_d, r_lse_d = (x.detach() for x in (out, lse, n_out, n_lse, r_out, r_lse))
    assert flash_rule_ok(max_error(out_d, r_out_d), max_error(n_out, r_out_d), factor=2, dtype=dtype), (
        max_error(out_d, r_out_d), max_error(n_out, r_out_d))
    assert torch.equal(torch.isinf(lse), torch.isinf(r_lse)), "fully masked rows must have LSE -inf"
    fin = ~torch.isinf(r_lse)
    assert flash_rule_ok(max_error(lse_d[fin], r_lse_d[fin]), max_error(n_lse[fin], r_lse_d[fin]), factor=2,
                         dtype=torch.float32)
    if not grads:
        return out, lse
    g = torch.Generator().manual_seed(1)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    inputs = [x for x in (q, k, v, bias) if x is not None and x.requires_grad]

    def grads_of(o, ls):
        loss = (o.double() * w).sum() + 0.5 * ls.double().masked_fill(~fin, 0).sum()
        return torch.autograd.grad(loss, inputs)

    n_out, n_lse = reference_attention_lowp(q, k, v, mask=mask, bias=bias, q_offset=q_offset, kv_offset=kv_offset)
    got, naive, ref = grads_of(out, lse), grads_of(n_out, n_lse), grads_of(r_out, r_lse)
    for a, n, r in zip(got, naive, ref):
        a, n, r = a.detach(), n.detach(), r.detach()
        assert torch.isfinite(a).all()
        assert flash_rule_ok(max_error(a, r), max_error(n, r), factor=3, dtype=dtype), (
            max_error(a, r), max_error(n, r))
    return out, lse
