"""A fused C++ attention kernel for the CPU (``attnkit/csrc/attention.cpp``), forward and backward.

Equals ``naive`` (and ``tiled``, its pure-PyTorch twin): ``softmax(q kᵀ · scale, masked) v`` with
FlashAttention's online softmax over (query tile × key tile), computed in one pass per tile in C++:
``at::parallel_for`` over (batch, head, query tile), oneDNN's GEMM micro-kernel
(``at::native::cpublas::brgemm``, in every torch CPU build) for the tile products, a vectorized exp.
The backward pass recomputes each tile's probabilities from the saved log-sum-exp (FlashAttention-2),
so training needs O(Tq + Tk) memory; it runs dK/dV parallel over key tiles and dQ over query tiles
when batch × kv heads is smaller than the thread count (so B=1 uses every core), and it is
**deterministic**: every accumulator is summed in a fixed order, so repeated backward passes are
bitwise equal (whatever the thread count). GQA reads each key/value head in place (never repeated).
The packed key/value (and, backward, query and output-gradient) tiles and each worker's tile buffers
are kept by their thread between calls, grow-only (the packed ones at most 32 MiB per calling
thread; a larger call packs into memory of its own): a call writes where the last one did, in pages
already mapped and warm in the caches, whatever was allocated in between.

The mask is read through its structure (:func:`attnkit.masks.tile_grid`): EMPTY tiles are skipped
and FULL tiles run with no mask work; PARTIAL tiles are masked in the kernel from the conjuncts' few
integers or index vectors (:func:`attnkit.masks.mask_params`) — band bounds (``Causal``,
``SlidingWindow``) and key lengths (``KeyPadding``) as one kept range per row, key validity
(``Padding``), document ids (``Document``), a block layout (``BlockSparse``) — and any other
conjunct (``Dense``, ``Custom``, ``Or``, ...) from a byte keep tile per PARTIAL tile computed here
with ``mask.evaluate``.

Score modifiers run in the kernel from their data (:meth:`attnkit.score_mods.ScoreModSpec.distance_form`):
an additive ``bias`` read through its strides, ALiBi and relative biases as one vector per (head,
relative distance), soft-caps, then the mask, and ``sinks`` in each row's normaliser — all on the
float32 (float64) scores, whatever the tiles' type. Gradients reach the bias, the sinks and, through
autograd on the distance vectors, ALiBi slopes and relative-bias tables (the distance vectors'
gradient is summed per query tile, then in a fixed order: deterministic, with ``B·Hq·Tq·Tk / block_q``
floats of scratch while learnable slopes or tables need it).

Precision: float32 and float64 run in their own type. bfloat16/float16 inputs run their tile
products **in the kernel in that type** (fp32 accumulation; scores, softmax statistics, the LSE and
the gradient accumulators in float32) on a CPU with instructions for that type's matrix products
(from its features, never a timing: :func:`attnkit.hardware.half_matmul_is_fast`, AVX512-BF16 or
AMX for bfloat16, AVX512-FP16 or AMX-FP16 for float16); elsewhere (e.g. AVX2-only CPUs, where they
are emulated) they are upcast to float32 tiles and
the output cast back. ``NativeOptions(half_tiles=True/False)`` forces either path;
``explain()`` and ``attnkit info`` say which one this machine uses and why.

The extension is built by ``python -m attnkit.csrc.build`` (``make install``); without it the backend
declines with the reason "native extension not built: ...". Its operators carry fake kernels and
autograd (:mod:`.native_ops`), so ``torch.compile(fullgraph=True)`` traces the backend, forward and
backward; traced, nothing is read on the host (the NaN/Inf flags are computed unconditionally). With
dynamic shapes one graph serves every length: offsets and band bounds are ``SymInt`` in the operators'
schemas, and the tile grid carries a spare tile row and column (no dimension is 1 for short calls only).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from .._validate import broadcast_shapes
from ..csrc import build as csrc_build, loader
from ..hardware import half_matmul_is_fast, half_matmul_reason
from ..inputs import AttentionInputs
from ..masks import And, Mask, mask_params
from ._common import nonfinite_keys, nonfinite_queries, zero_keys
from . import native_ops, nonfinite
from .nonfinite import all_finite, host_may_branch
from ..registry import Backend, Work, register_backend
from ._tiles import PARTIAL, tile_grid


@dataclass(frozen=True)
class NativeOptions:
    """Tile sizes of the kernel (queries × keys per tile; ``None``: chosen from the mask's structure,
    see :func:`default_options`) and the bfloat16/float16 path: ``half_tiles=None`` decides by this
    machine's measurement (:func:`half_tiles_note`), ``True`` runs the tiles in the input's type,
    ``False`` upcasts them to float32."""

    block_q: int | None = None
    block_k: int | None = None
    half_tiles: bool | None = None

    def __post_init__(self):
        if self.half_tiles not in (None, True, False):
            raise ValueError(f"NativeOptions(half_tiles={self.half_tiles!r}): expected None (measure), True or False.")
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 8 <= value <= 4096:
                raise ValueError(f"NativeOptions({name}={value!r}): expected an int in 8..4096 or None, "
                                 f"e.g. {name}=128.")


@functools.lru_cache(maxsize=1)
def load_extension():
    """``(module, None)`` when the built extension loads, else ``(None, reason)``."""
    reason = loader.load_library()
    if reason is not None:
        return None, reason
    try:
        native_ops.register()  # fake kernels and autograd: traceable by torch.compile
        return getattr(torch.ops, csrc_build.NAME), None
    except (ImportError, OSError, RuntimeError) as exc:
        return None, f"native extension not built: it fails to load ({exc})"


def unavailable_reason() -> str:
    """Why the extension cannot run (``""`` when it can): a constant to ``torch.compile``, which
    then neither traces the file checks nor breaks the graph on them."""
    return load_extension()[1] or ""


# What ``torch.compiler.assume_constant_result`` sets, without importing torch._dynamo (seconds)
# at ``import attnkit``; the fullgraph compile tests fail if a torch release changes the marker.
unavailable_reason._dynamo_marked_constant = True


_HALF = (torch.float16, torch.bfloat16)


def half_tiles(dtype: torch.dtype, options: "NativeOptions | None" = None) -> bool:
    """Whether a ``dtype`` input runs its tiles in ``dtype`` in the kernel (else upcast to float32)."""
    if dtype not in _HALF:
        return False
    if options is not None and options.half_tiles is not None:
        return options.half_tiles
    return half_matmul_is_fast(dtype)


def half_tiles_note(dtype: torch.dtype) -> str:
    """One sentence: which path ``dtype`` inputs take on this machine and why."""
    name = str(dtype).removeprefix("torch.")
    why = half_matmul_reason(dtype)
    if half_tiles(dtype):
        return f"{name} tiles in the kernel with float32 accumulation ({why}; NativeOptions(half_tiles=False) upcasts)"
    return f"{name} inputs upcast to float32 tiles ({why}; NativeOptions(half_tiles=True) forces {name} tiles)"


_EMPTY_BYTE = torch.empty(0, dtype=torch.uint8)


@dataclass(frozen=True, eq=False)
class _Plan:
    """The kernel's mask arguments for one (mask, shape, offsets): built once, cached."""

    mask: dict  # kernel_spec's mask keywords: left, right, grid, lengths, valid, doc, layout, layout_bs, extra...
    q_offset: int
    kv_offset: int
    block_q: int
    block_k: int


def _build_plan(mask: Mask | None, B: int, H: int, Tq: int, Tk: int, q_offset: int, kv_offset: int,
                bq: int, bk: int) -> _Plan:
    grid = tile_grid(mask, Tq, Tk, q_offset, kv_offset, bq, bk, B, H, spare=True)  # no dimension of 1 to trace
    params = mask_params(mask, B)
    extra_index, extra = None, None
    if params.rest:
        rest = params.rest[0] if len(params.rest) == 1 else And(*params.rest)
        keep_tiles = _all_keep_tiles if torch.compiler.is_compiling() else _keep_tiles
        extra_index, extra = keep_tiles(rest, grid, Tq, Tk, q_offset, kv_offset, bq, bk, B, H)
    tensors = dict(grid=grid, lengths=params.lengths, valid=params.valid, doc=params.doc, layout=params.layout,
                   extra_index=extra_index, extra=extra)
    fields = {name: x.contiguous() for name, x in tensors.items() if x is not None}
    fields.update(left=params.band.left, right=params.band.right, layout_bs=params.layout_block_size)
    return _Plan(fields, q_offset, kv_offset, bq, bk)


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
    shape = broadcast_shapes(*(t.shape for t in tiles))
    return index, torch.stack([t.expand(shape) for t in tiles]).contiguous()


def _all_keep_tiles(mask: Mask, grid: Tensor, Tq, Tk, q_offset, kv_offset, bq, bk, B, H) -> tuple[Tensor, Tensor]:
    """:func:`_keep_tiles` for every tile of ``grid``, with no host read (traced: which tiles are PARTIAL
    is data): ``mask`` evaluated over the whole call, ``Tq x Tk`` bytes per batch row and head it
    distinguishes (what a backend that materializes the mask holds), cut into the grid's tiles."""
    nQ, nK = grid.shape  # the spare tile row and column too: the pads below are never 0 wide
    keep = mask.evaluate((q_offset, q_offset + Tq), (kv_offset, kv_offset + Tk), q_offset=q_offset,
                         kv_offset=kv_offset, batch_size=B, num_heads=H).cpu()  # (Bx, Hx, Tq, Tk)
    Bx, Hx = keep.shape[:2]
    keep = torch.nn.functional.pad(keep.to(torch.uint8), (0, nK * bk - Tk, 0, nQ * bq - Tq))
    tiles = keep.view(Bx, Hx, nQ, bq, nK, bk).permute(2, 4, 0, 1, 3, 5).reshape(nQ * nK, Bx, Hx, bq, bk)
    return torch.arange(nQ * nK).view(nQ, nK), tiles.contiguous()


def default_options(inp: AttentionInputs, given: NativeOptions | None = None) -> NativeOptions:
    """``given`` with its unset tile sizes chosen so a structured mask costs its density: tiles
    aligned with a block layout are exactly FULL or EMPTY (no per-element work); a band (sliding
    window) spanning at most 2048 keys gets 64 x 64 tiles, so the tiles across its edges waste
    little; else 128 x 256, or square 128 x 128 tiles across another band edge (``Causal()``'s
    diagonal, a wide window) where that saves more than a sixteenth of the scores computed: a tile
    across an edge computes about half its scores in vain, so each edge costs a query row about
    ``(block_q + block_k) / 2`` wasted scores (192 with 128 x 256, 128 with square tiles) beside the
    keys the row keeps, and smaller tiles cost their own per-tile work (so long rows keep the wider
    tiles; at n=256 causal, 128 x 256 tiles compute every score)."""
    given = given or NativeOptions()
    bq, bk = 128, 256
    mask = inp.mask
    layout = None if mask is None else mask.block_layout()
    band = None if mask is None else mask.band()
    if layout is not None and layout.block_size <= 256:
        bq = bk = layout.block_size * -(-32 // layout.block_size)
    elif band is not None and band.left is not None and band.left + (band.right or 0) <= 2048:
        bq = bk = 64
    elif band is not None and (band.left is not None or band.right is not None):
        edges = (band.left is not None) + (band.right is not None)
        if 16 * edges * (192 - 128) > _mean_row_keys(band, inp):
            bq = bk = 128
    return NativeOptions(given.block_q or bq, given.block_k or bk, given.half_tiles)


def _mean_row_keys(band, inp: AttentionInputs) -> float:
    """The keys a query row keeps under ``band`` (offsets, Tk), averaged over the first and last rows."""
    first, last = inp.kv_offset, inp.kv_offset + inp.Tk - 1

    def keys(p: int) -> int:
        lo = first if band.left is None else max(first, p - band.left)
        hi = last if band.right is None else min(last, p + band.right)
        return max(hi - lo + 1, 0)

    return (keys(inp.q_offset) + keys(inp.q_offset + inp.Tq - 1)) / 2


_PLANS: dict = {}
_MAX_PLANS = 32


def plan_for(inp: AttentionInputs, options: NativeOptions) -> _Plan:
    """The cached plan for ``inp`` (a model's layers share one mask object: built once per forward).

    Keyed on the mask object's identity (it is held with the plan, so its id cannot be reused), never
    on mask equality: two ``Custom`` masks with one function that reads changing state compare equal
    but must each get their own plan."""
    mask = inp.mask
    if torch.compiler.is_compiling():  # traced once per graph: no Python-side cache (as masks' own caches)
        return _build_plan(mask, inp.B, inp.Hq, inp.Tq, inp.Tk, inp.q_offset, inp.kv_offset, options.block_q,
                           options.block_k)
    key = (id(mask), None if mask is None else mask.structure_key(), inp.B, inp.Hq, inp.Tq, inp.Tk, inp.q_offset,
           inp.kv_offset, options.block_q, options.block_k)
    entry = _PLANS.get(key)
    if entry is None or entry[0] is not mask:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)))
        entry = _PLANS[key] = (mask, _build_plan(mask, inp.B, inp.Hq, inp.Tq, inp.Tk, inp.q_offset, inp.kv_offset,
                                                 options.block_q, options.block_k))
    return entry[1]


@register_backend
class NativeBackend(Backend):
    name = "native"
    work = Work(fused=True)
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
        return not unavailable_reason()

    @classmethod
    def extra_reasons(cls, inp: AttentionInputs):
        reason = unavailable_reason()
        if reason:
            yield reason

    @classmethod
    def describe(cls, inp: AttentionInputs) -> str:
        mask = "no mask" if inp.mask is None else "tiles skipped or masked from the mask's structure"
        cast = f", {half_tiles_note(inp.dtype)}" if inp.dtype in _HALF else ""
        mods = "" if inp.score_mod is None else f", score modifiers {inp.score_mod!r} in the kernel"
        mods += "" if inp.bias is None else ", the bias added per tile"
        mods += "" if inp.sinks is None else ", sinks in the normaliser"
        return f"fused C++ kernel with {mask}{cast}{mods}"

    @classmethod
    def forward(cls, inp: AttentionInputs, options: NativeOptions | None):
        reason = unavailable_reason()  # loads the ops and registers their autograd before any call
        if reason:
            raise RuntimeError(f"native: {reason}")
        options = default_options(inp, options)
        plan = plan_for(inp, options)
        # NaN/Inf contract, row by row: flagged keys are zeroed (a copy only on that rare path) and the
        # kernel marks the rows that keep one. GEMM shapes never depend on the data, so every other row
        # is bitwise what it is without the flag. Eager, the host branches on the policy's one cheap
        # check (a CPU kernel: asking costs no stall); traced (torch.compile, torch.func) nothing is read
        # on the host: keys are flagged and rows marked unconditionally, which changes no finite result.
        host = host_may_branch(inp)
        clean = host and all_finite(inp)
        bad = None if clean else nonfinite_keys(inp)
        if host and bad is not None and not bool(bad.any()):
            bad = None
        bad_q = None if clean else nonfinite_queries(inp.q)
        if host and bad_q is not None and not bool(bad_q.any()):
            bad_q = None
        q, k, v = inp.q, inp.k, inp.v
        if bad is not None:
            k, v = zero_keys(k, v, bad)
        if bad_q is not None:  # zeroed, so the row's backward reads no Inf/NaN (nonfinite.poison gives its NaNs)
            q = q.masked_fill(bad_q[..., None], 0)
        if inp.dtype in _HALF and not half_tiles(inp.dtype, options):
            q, k, v = q.float(), k.float(), v.float()  # O(n) copies; autograd casts the grads back
        flags = _EMPTY_BYTE if bad is None else bad.to(torch.uint8).contiguous()
        stat = torch.promote_types(q.dtype, torch.float32)  # scores, statistics and modifiers
        bias = None
        if inp.bias is not None:  # cast in its own (broadcast) shape, expanded with stride 0: never materialized
            bias = inp.bias.reshape((1,) * (4 - inp.bias.dim()) + tuple(inp.bias.shape)).to(stat)
            bias = bias.expand(inp.B, inp.Hq, inp.Tq, inp.Tk)
        spec = native_ops.kernel_spec(inp.scale, q_offset=plan.q_offset, kv_offset=plan.kv_offset, **plan.mask,
                                      bias=bias, score_mod=inp.score_mod, sinks=inp.sinks, num_heads=inp.Hq,
                                      Tq=inp.Tq, Tk=inp.Tk, stat=stat, distance_vectors=True)
        out, lse, seen = native_ops.forward(q.contiguous(), k.contiguous(), v.contiguous(), spec, plan.block_q,
                                            plan.block_k, flags)
        # a NaN/Inf query makes its own row NaN (a row with no allowed key stays 0), whatever the kernel skips
        hit = None if bad is None else seen.bool()
        if bad_q is not None:
            # rows that see a key: LSE above -inf (above the sink's logit with sinks; NaN, from a bias, counts as seen)
            floor = float("-inf") if inp.sinks is None else inp.sinks.to(lse.dtype).view(1, -1, 1)
            sees = bad_q & ~(lse <= floor)
            hit = sees if hit is None else hit | sees
        if hit is not None:  # NaN rows, and NaN gradients for what they read (the contract's gradient rule)
            out, lse = nonfinite.poison(inp, hit, host, [out, lse])
        out = out.to(inp.dtype)
        return (out, lse) if inp.return_lse else out
