"""A fused C++ attention kernel for the CPU (``attnkit/csrc/attention.cpp``), forward and backward.

Equals ``naive`` (and ``tiled``, its pure-PyTorch twin): ``softmax(q kᵀ · scale, masked) v`` with
FlashAttention's online softmax over (query tile × key tile), statistics in float32 (float64 for
float64 inputs), computed in one pass per tile in C++ (``at::parallel_for`` over (batch, head,
query tile), the CPU BLAS for the tile products, a vectorized exp). The backward pass recomputes
each tile's probabilities from the saved log-sum-exp (flash style), parallel over (batch, key/value
head), so training needs O(Tq + Tk) memory. GQA reads each key/value head in place (never repeated).

The mask is read through its structure (:func:`attnkit.masks.tile_grid`): EMPTY tiles
are skipped and FULL tiles run unmasked; PARTIAL tiles are masked per element in the kernel from
the conjuncts' few integers or index vectors (:func:`attnkit.masks.mask_params`) — band bounds (``Causal``, ``SlidingWindow``), key
lengths (``KeyPadding``), key validity (``Padding``), document ids (``Document``), a block layout
(``BlockSparse``) — and any other conjunct (``Dense``, ``Custom``, ``Or``, ...) from a byte keep
tile per PARTIAL tile computed here with ``mask.evaluate``.

float16/bfloat16 inputs run in float32 (their tiles upcast; the output is cast back). The
extension is built by ``python -m attnkit.csrc.build`` (``make install``); without it the backend
declines with the reason "native extension not built: ...".
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch
from torch import Tensor

from ..csrc import build as csrc_build
from ..inputs import AttentionInputs
from ..masks import And, Mask, mask_params
from ..score_mods import score_mod_spec
from ._common import nonfinite_keys, nonfinite_queries, poison_rows, zero_keys
from .nonfinite import all_finite
from ..registry import Backend, register_backend
from ._tiles import PARTIAL, tile_grid


@dataclass(frozen=True)
class NativeOptions:
    """Tile sizes of the kernel (queries × keys per tile)."""

    block_q: int = 128
    block_k: int = 256

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 8 <= value <= 4096:
                raise ValueError(f"NativeOptions({name}={value!r}): expected an int in 8..4096, e.g. {name}=128.")


@functools.lru_cache(maxsize=1)
def load_extension():
    """``(module, None)`` when the built extension loads, else ``(None, reason)``."""
    path = csrc_build.library_path()
    if not path.exists():
        return None, f"native extension not built: run `python -m attnkit.csrc.build` (or `make install`); no {path.name}"
    try:
        stamp = json.loads(csrc_build.STAMP.read_text())
    except (OSError, ValueError):
        stamp = {}
    if stamp.get("torch") != torch.__version__:
        return None, (f"native extension not built for this torch: built against {stamp.get('torch')}, running "
                      f"{torch.__version__}; rebuild with `python -m attnkit.csrc.build`")
    missing = set(stamp.get("cpu_flags", ())) - csrc_build.cpu_flags()
    if missing and csrc_build.cpu_flags():
        return None, (f"native extension built for another CPU: this one lacks {', '.join(sorted(missing)[:6])}; "
                      "rebuild here with `python -m attnkit.csrc.build`")
    try:
        torch.ops.load_library(str(path))
        return getattr(torch.ops, csrc_build.NAME), None
    except (ImportError, OSError, RuntimeError) as exc:
        return None, f"native extension not built: it fails to load ({exc})"


_EMPTY_LONG = torch.empty(0, dtype=torch.long)
_EMPTY_BOOL = torch.empty(0, dtype=torch.bool)
_EMPTY_BYTE = torch.empty(0, dtype=torch.uint8)
_EMPTY_F = torch.empty(0)


@dataclass(frozen=True, eq=False)
class _Plan:
    """The kernel's mask arguments for one (mask, shape, offsets): built once, cached."""

    args: tuple  # grid, band, lengths, valid, doc, layout, layout_bs, extra_index, extra
    q_offset: int
    kv_offset: int
    block_q: int
    block_k: int


def _build_plan(mask: Mask | None, B: int, H: int, Tq: int, Tk: int, q_offset: int, kv_offset: int, bq: int, bk: int) -> _Plan:
    grid = tile_grid(mask, Tq, Tk, q_offset, kv_offset, bq, bk, B, H)
    params = mask_params(mask, B)
    extra_index, extra = _EMPTY_LONG, _EMPTY_BYTE
    if params.rest:
        rest = params.rest[0] if len(params.rest) == 1 else And(*params.rest)
        extra_index, extra = _keep_tiles(rest, grid, Tq, Tk, q_offset, kv_offset, bq, bk, B, H)
    left, right = params.band.left, params.band.right
    band = [int(left is not None), left or 0, int(right is not None), right or 0]
    args = (grid, band, _or(params.lengths, _EMPTY_LONG), _or(params.valid, _EMPTY_BOOL), _or(params.doc, _EMPTY_LONG),
            _or(params.layout, _EMPTY_BOOL), params.layout_block_size, extra_index, extra)
    return _Plan(tuple(a.contiguous() if isinstance(a, Tensor) else a for a in args), q_offset, kv_offset, bq, bk)


def _or(x, default):
    return default if x is None else x


def _keep_tiles(mask: Mask, grid: Tensor, Tq, Tk, q_offset, kv_offset, bq, bk, B, H) -> tuple[Tensor, Tensor]:
    """Byte keep tiles ``(n, Bx, Hx, bq, bk)`` of ``mask`` for the PARTIAL tiles of ``grid`` and
    their index ``(nQ, nK)`` (-1 elsewhere)."""
    rows, cols = torch.nonzero(grid == PARTIAL, as_tuple=True)
    index = torch.full(grid.shape, -1, dtype=torch.long)
    index[rows, cols] = torch.arange(rows.numel())
    tiles = []
    for r, c in zip(rows.tolist(), cols.tolist()):
        q0, k0 = r * bq, c * bk
        q1, k1 = min(q0 + bq, Tq), min(k0 + bk, Tk)
        keep = mask.evaluate((q_offset + q0, q_offset + q1), (kv_offset + k0, kv_offset + k1),
                             q_offset=q_offset, kv_offset=kv_offset, batch_size=B, num_heads=H).cpu()
        tiles.append(torch.nn.functional.pad(keep.to(torch.uint8), (0, bk - (k1 - k0), 0, bq - (q1 - q0))))
    if not tiles:
        return index, torch.zeros((0, 1, 1, bq, bk), dtype=torch.uint8)
    shape = torch.broadcast_shapes(*(t.shape for t in tiles))
    return index, torch.stack([t.expand(shape) for t in tiles]).contiguous()


_PLANS: dict = {}
_MAX_PLANS = 32


def plan_for(inp: AttentionInputs, options: NativeOptions) -> _Plan:
    """The cached plan for ``inp`` (a model's layers share one mask object: built once per forward).

    Keyed on the mask object's identity (it is held with the plan, so its id cannot be reused), never
    on mask equality: two ``Custom`` masks with one function that reads changing state compare equal
    but must each get their own plan."""
    mask = inp.mask
    key = (id(mask), None if mask is None else mask.structure_key(), inp.B, inp.Hq, inp.Tq, inp.Tk, inp.q_offset,
           inp.kv_offset, options.block_q, options.block_k)
    entry = _PLANS.get(key)
    if entry is None or entry[0] is not mask:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)))
        entry = _PLANS[key] = (mask, _build_plan(mask, inp.B, inp.Hq, inp.Tq, inp.Tk, inp.q_offset, inp.kv_offset,
                                                 options.block_q, options.block_k))
    return entry[1]


@dataclass(frozen=True)
class _Mods:
    """The score modifiers' static kernel arguments (:meth:`ScoreModSpec.distance_form`)."""

    dmin: int = 0
    ops: tuple[int, ...] = ()
    caps: tuple[float, ...] = ()


class _NativeFunction(torch.autograd.Function):
    """``(out, lse, seen) = f(q, k, v, bias, dist, sinks, ...)``, differentiable in q, k, v, the
    additive ``bias (B|1, Hq|1, Tq|1, Tk|1)``, the modifiers' per-distance vectors ``dist`` (autograd
    carries their gradient on to ALiBi slopes and relative-bias tables) and ``sinks (Hq,)``."""

    @staticmethod
    def forward(ctx, q, k, v, bias, dist, sinks, scale, plan, flags, mods: _Mods):
        ext, _ = load_extension()
        # the bias is cast in its own (broadcast) shape, then expanded with stride 0: never materialized
        bias_x = _EMPTY_F if bias is None else bias.to(q.dtype).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        dist_x, sinks_x = (_EMPTY_F if t is None else t.to(q.dtype).contiguous() for t in (dist, sinks))
        out, lse, seen = ext.forward(q, k, v, scale, plan.q_offset, plan.kv_offset, plan.block_q, plan.block_k,
                                     *plan.args, flags, bias_x, dist_x, mods.dmin, list(mods.ops), list(mods.caps),
                                     sinks_x)
        ctx.save_for_backward(q, k, v, out, lse, bias_x, dist_x, sinks_x)
        ctx.scale, ctx.plan, ctx.mods = scale, plan, mods
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.mark_non_differentiable(seen)
        return out, lse, seen

    @staticmethod
    def backward(ctx, dout, dlse, dseen):
        q, k, v, out, lse, bias_x, dist_x, sinks_x = ctx.saved_tensors
        plan, mods = ctx.plan, ctx.mods
        # delta_i = sum_j p_ij dp_ij = rowsum(dout * out); the LSE's own gradient enters as -dlse.
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)
        if dlse is not None:
            delta = delta - dlse
        need_bias, need_dist, need_sinks = ctx.needs_input_grad[3:6]
        ext, _ = load_extension()
        dq, dk, dv, d_dist, dbias = ext.backward(
            q, k, v, dout, lse, delta.contiguous(), ctx.scale, plan.q_offset, plan.kv_offset, plan.block_q,
            plan.block_k, *plan.args, bias_x, dist_x, mods.dmin, list(mods.ops), list(mods.caps), sinks_x,
            bool(need_dist), bool(need_bias))
        if need_bias:  # (B, Hq, Tq, Tk) -> the bias's own broadcast shape
            dims = [d for d in range(4) if ctx.bias_shape[d] == 1 and dbias.shape[d] > 1]
            dbias = dbias.sum(dim=dims, keepdim=True) if dims else dbias
        dsinks = None
        if need_sinks:  # d loss / d sink_h = -sum over h's rows of p_sink * delta, p_sink = exp(sink - lse)
            dsinks = -(torch.exp(sinks_x.view(1, -1, 1) - lse) * delta).sum(dim=(0, 2))
        return (dq, dk, dv, dbias if need_bias else None, d_dist.sum(0) if need_dist else None, dsinks,
                None, None, None, None)


@register_backend
class Native(Backend):
    name = "native"
    summary = "fused C++ online-softmax kernel (CPU): fwd+bwd, skips masked tiles, masks evaluated in the kernel"
    devices = frozenset({"cpu"})
    supports_lse = True
    supports_bias = True
    supports_score_mod = True
    score_mod_kinds = frozenset({"alibi", "relative_bias", "softcap"})  # in the kernel, from ScoreModSpec data
    supports_sinks = True
    nonfinite = "self"  # flagged keys are marked per row in the kernel (same GEMM shapes either way)
    Options = NativeOptions

    @classmethod
    def available(cls) -> bool:
        return load_extension()[0] is not None

    @classmethod
    def extra_reasons(cls, inp: AttentionInputs):
        reason = load_extension()[1]
        if reason:
            yield reason

    @classmethod
    def describe(cls, inp: AttentionInputs) -> str:
        mask = "no mask" if inp.mask is None else "tiles skipped or masked from the mask's structure"
        cast = ", float32 tiles for %s inputs" % str(inp.dtype).removeprefix("torch.") if inp.dtype in (
            torch.float16, torch.bfloat16) else ""
        mods = "" if inp.score_mod is None else f", score modifiers {inp.score_mod!r} in the kernel"
        mods += "" if inp.bias is None else ", the bias added per tile"
        mods += "" if inp.sinks is None else ", sinks in the normaliser"
        return f"fused C++ kernel with {mask}{cast}{mods}"

    @classmethod
    def forward(cls, inp: AttentionInputs, options: NativeOptions | None):
        if options is None:
            options = NativeOptions()
            layout = None if inp.mask is None else inp.mask.block_layout()
            if layout is not None and layout.block_size <= 256:
                # Tiles aligned with the layout's blocks are exactly FULL or EMPTY (no per-element work).
                side = layout.block_size * -(-32 // layout.block_size)
                options = NativeOptions(side, side)
        plan = plan_for(inp, options)
        # NaN/Inf contract, row by row: flagged keys are zeroed (a copy only on that rare path) and the
        # kernel marks the rows that keep one. GEMM shapes never depend on the data, so every other row
        # is bitwise what it is without the flag. (A CPU-only kernel: asking the host costs no stall.)
        clean = all_finite(inp)  # the policy's one cheap check (a CPU kernel: the host may branch)
        bad = None if clean else nonfinite_keys(inp)
        if bad is not None and not bool(bad.any()):
            bad = None
        q, k, v = inp.q, inp.k, inp.v
        if bad is not None:
            k, v = zero_keys(k, v, bad)
        if inp.dtype in (torch.float16, torch.bfloat16):
            q, k, v = q.float(), k.float(), v.float()  # O(n) copies; autograd casts the grads back
        flags = _EMPTY_BYTE if bad is None else bad.to(torch.uint8).contiguous()
        dist, mods = None, _Mods()
        if inp.score_mod is not None:
            dist, dmin, ops, caps = score_mod_spec(inp.score_mod).distance_form(
                inp.q_offset, inp.Tq, inp.kv_offset, inp.Tk, inp.Hq, q.dtype)
            mods = _Mods(dmin, tuple(ops), tuple(caps))
        bias = None if inp.bias is None else inp.bias.reshape((1,) * (4 - inp.bias.dim()) + tuple(inp.bias.shape))
        out, lse, seen = _NativeFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(), bias, dist, inp.sinks,
                                               inp.scale, plan, flags, mods)
        # a NaN/Inf query makes its own row NaN (a row with no allowed key stays 0), whatever the kernel skips
        hit = None
        if not clean:
            # rows that see a key: LSE above -inf (above the sink's logit with sinks; NaN counts as seen)
            floor = float("-inf") if inp.sinks is None else inp.sinks.to(lse.dtype).view(1, -1, 1)
            hit = nonfinite_queries(inp.q) & ~(lse <= floor)
            if bad is not None:
                hit = hit | seen.bool()
        out, lse = poison_rows(out, lse, hit)
        out = out.to(inp.dtype)
        return (out, lse) if inp.return_lse else out
