"""Choosing a backend: the priority policy, ``select``, ``explain`` and ``use_backend``.

Rules:

* ``backend="auto"`` takes the first backend of :func:`priority` that is exact, available and has no
  reasons against the input. Approximate backends (``exact = False``) run only when named.
* A named backend is checked, never silently replaced: if it cannot run, ``NoBackendError`` says why.
* ``with use_backend("tiled"):`` makes ``"auto"`` mean ``"tiled"`` inside the block (a ContextVar,
  so threads and async tasks keep their own choice).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.compiler import is_compiling as _is_compiling

from . import calibration
from .csrc import loader
from .inputs import AttentionInputs
from .masks import Mask
from .masks.export import value_keyed
from .registry import Backend, Work, get_backend, list_backends, names_now, registered_names

__all__ = ["NoBackendError", "select", "resolve", "resolve_call", "explain", "use_backend", "priority", "Explanation",
           "Work", "builtin_order", "estimated_seconds", "kept_fraction", "autotune"]

_SCOPED: ContextVar[tuple[str, ...] | None] = ContextVar("attnkit_backend", default=None)

# Above this many materialized mask elements per call (B*H*Tq*Tk), a backend that builds the
# whole (Tq, Tk) mask costs more memory than one that reads the mask's structure: 2**26 bool
# elements = 64 MiB. A memory bound, not a speed crossover: such backends go last.
MATERIALIZE_LIMIT = 2**26


@functools.lru_cache(maxsize=16)
def builtin_order(registered: tuple[str, ...]) -> tuple[str, ...]:
    """The exact registered backends in the built-in order, from what each declares it skips and
    fuses (:class:`~attnkit.registry.Work`, ``Backend.work``): fused kernels first, then PyTorch
    ops over whole tensors, then Python loops over tiles, then the backends that materialize the
    mask; registration order breaks ties. For a call, a backend that would materialize its mask
    (:meth:`~attnkit.registry.Backend.dense_mask_elements`) ranks with the latter. The cost model
    reorders it from measured machine constants; close estimates keep this order."""
    known = list_backends()
    exact = [(known[n].work.rank(), i, n) for i, n in enumerate(registered) if known[n].exact]
    return tuple(n for _, _, n in sorted(exact))


#: Bytes moved per materialized mask element: the bool mask written and read, then the float bias
#: made from it written and read by the kernel.
_MASK_BYTES = 1 + 1 + 4 + 4
#: How much faster the cost model must estimate a backend before it passes one of a better kind
#: in :func:`builtin_order` (its estimates are within this factor of measurements; closer calls are
#: left to the built-in order, autotuning and calibration).
MODEL_MARGIN = 1.3
#: The same between backends of one kind (the fused kernels, say: their order in the registry
#: says nothing about their speed): estimates closer than this count as a tie.
SAME_KIND_MARGIN = 1.05
# forward + backward in forwards (the backward recomputes the scores and runs two more products), for
# constants without the backend's own measurement
_TRAIN_FLOPS = 3.0


class NoBackendError(ValueError):
    """No backend can run the input; the message lists every backend with its reasons."""


def kept_fraction(inp: AttentionInputs, tile: tuple[int, int]) -> float:
    """The fraction of ``tile``-sized (query, key) tiles that hold a kept pair, from the mask's
    structure: its band bounds (``Causal``, ``SlidingWindow``) and its BlockSparse layout. Other
    masks (padding, documents, dense) count as keeping everything (a safe over-estimate)."""
    mask = inp.mask
    if mask is None:
        return 1.0
    Tq, Tk, qo, ko = inp.Tq, inp.Tk, inp.q_offset, inp.kv_offset
    layout = mask.block_layout()
    if layout is not None and not torch.compiler.is_compiling():
        fraction = layout.density(Tq, Tk, q_offset=qo, kv_offset=ko, rows=min(Tq, 64))
    else:
        fraction = 1.0
    band = mask.band()
    if band.left is None and band.right is None:
        return fraction
    bq, bk = tile
    nq, nk = -(-Tq // bq), -(-Tk // bk)
    step = max(1, nq // 64)  # sample at most 64 query tiles: O(1) at any length
    kept = total = 0
    for i in range(0, nq, step):
        lo, hi = qo + i * bq, qo + min(Tq, (i + 1) * bq) - 1  # positions of the tile's first and last query
        first = ko if band.left is None else max(ko, lo - band.left)
        last = ko + Tk - 1 if band.right is None else min(ko + Tk - 1, hi + band.right)
        kept += 0 if last < first else (last - ko) // bk - (first - ko) // bk + 1
        total += nk
    return min(fraction, kept / total) if total else 0.0


def _mask_class(inp: AttentionInputs) -> str:
    if inp.Tq <= calibration.DECODE_QUERIES:
        return "decode"
    mask = inp.mask
    if mask is None or mask.is_causal():
        return "causal"
    return "layout" if mask.block_layout() is not None else "band"


def _keeps_every_block(inp: AttentionInputs) -> bool:
    """Whether the mask is a BlockSparse layout that keeps every block of this call (BigBird over a
    few blocks): a kernel that reads the mask's structure runs every tile whole, as with no mask."""
    mask = inp.mask
    # kept_fraction counts a layout as keeping everything while compiling (its safe over-estimate)
    return (mask is not None and mask.block_layout() is mask and not torch.compiler.is_compiling()
            and kept_fraction(inp, (1, 1)) >= 1.0)


def _work_terms(name: str, impl: type[Backend], inp: AttentionInputs) -> tuple[float, float, float]:
    """(work, materialized mask elements, loop ops) of one forward call of ``impl`` on ``inp``. The
    work is the GEMM FLOPs, or for decoding (a few queries over a cache: its time is reading K and V
    once, whatever the number of queries) the bytes of the keys and values it reads (once per query
    head for a backend that repeats grouped K/V heads)."""
    work = impl.work
    materialized = impl.dense_mask_elements(inp)
    if work.materializes and inp.mask is not None:
        materialized = max(materialized, inp.B * inp.Hq * inp.Tq * inp.Tk)
    if work.skips == "nothing" or materialized:
        fraction = 1.0
    elif work.skips == "layout":
        layout = None if inp.mask is None else inp.mask.block_layout()
        fraction = kept_fraction(inp, (layout.block_size,) * 2) if layout is not None else 1.0
    else:
        fraction = kept_fraction(inp, work.tile)
    scores = fraction * inp.Tq * inp.Tk * inp.B * inp.Hq
    tiles = scores / (work.tile[0] * work.tile[1]) if work.loop_ops else 0.0
    if _mask_class(inp) == "decode":
        keys = fraction * inp.Tk * inp.B * (inp.Hq if work.gqa == "repeats" else inp.Hkv)
        return keys * (inp.D + inp.Dv) * _stored_bytes(inp.k), float(materialized), tiles * work.loop_ops
    return 2.0 * scores * (inp.D + inp.Dv), float(materialized), tiles * work.loop_ops


def _stored_bytes(k) -> float:
    """Bytes per stored key element: the tensor's, or a KV handle's storage (int8 values plus a
    float32 scale per vector)."""
    store = getattr(k, "k", k)  # a KVHandle keeps its storage in .k
    size = store.element_size()
    if getattr(k, "k_scale", None) is not None:
        size += 4 / store.shape[-1]
    return float(size)


@functools.lru_cache(maxsize=4)
def _reference_inputs(generation: int) -> dict[str, AttentionInputs]:
    inputs = {}
    problems = {**calibration.reference_problems(), "decode_small": calibration.decode_small_problem(),
                "decode_tiny": calibration.decode_tiny_problem()}
    for cls, ((B, H, Tq, Tk, D), mask) in problems.items():
        q, k = torch.empty(B, H, Tq, D, device="meta"), torch.empty(B, H, Tk, D, device="meta")
        inputs[cls] = AttentionInputs.create(q, k, k, mask=mask)
    return inputs


def estimated_seconds(name: str, inp: AttentionInputs, constants: dict) -> float | None:
    """The cost model: seconds ``name`` would take on ``inp`` on this machine (from its declared
    ``work``), or None when the probe did not measure it.

    ``overhead + flops / rate + mask bytes / bandwidth + loop ops * op cost``, where ``rate`` is the
    backend's own rate on the probe's reference problem of the same mask class (measured time less
    the other terms), scaled for half-precision inputs by the backend's own half/float32 speed on the
    causal reference (else the machine's GEMM ratio), and for training by the backend's own ratio
    of forward and backward to forward on the causal reference (:func:`_train_passes`) with its
    measured per-call cost of a forward and backward on a tiny input. Decoding is
    priced by the K/V bytes read, through the backend's times on three decode problems (16 keys, 1
    and 32 MiB each of K and V): past the small one, a cost per byte between the two larger; below
    it, the line from the 16-key call (a step's fixed part) to the small one (without those two: its
    bytes per second on the larger after the tiny input's overhead)."""
    impl = list_backends().get(name)
    overhead = constants["backend_seconds"].get(name)
    measured = constants["reference_seconds"].get(name, {})
    if impl is None or overhead is None or not measured:
        return None
    bandwidth, op = constants["bandwidth_gbs"] * 1e9, constants["op_seconds"]
    cls = _mask_class(inp)
    flops, materialized, loops = _work_terms(name, impl, inp)
    if cls == "layout" and not materialized and _keeps_every_block(inp):
        cls = "causal"  # no mask to this backend: priced at its rate without one (the causal class's)
    if cls not in measured:  # a class the backend cannot run at the reference: its slowest measured rate
        # (of the same kind of work: decoding's rate is in bytes, the other classes' in FLOPs)
        same = [c for c in measured if (c == "decode") == (cls == "decode")]
        if not same:
            return None
        cls = max(same, key=measured.get)
    refs = _reference_inputs(calibration.generation())
    small = constants.get("decode_small_seconds", {}).get(name)
    tiny = constants.get("decode_tiny_seconds", {}).get(name)
    if cls == "decode" and small is not None and tiny is not None and not inp.requires_grad:
        # Through the decode calls (16 keys, 1 and 32 MiB each of K, V): past the small one, its time
        # plus the cost per byte between the two larger; below it, the line from the 16-key call to
        # the small one (a small cache is read from the CPU's caches, faster per byte than a long one
        # from memory, and a step costs at least its fixed part).
        bytes_small, bytes_ref = (_work_terms(name, impl, refs[c])[0] for c in ("decode_small", "decode"))
        per_byte = max((measured[cls] - small) / (bytes_ref - bytes_small), 0.1 * measured[cls] / bytes_ref)
        work = flops  # decoding's work: the K/V bytes it reads
        if work >= bytes_small:
            return small + per_byte * (work - bytes_small)
        bytes_tiny = _work_terms(name, impl, refs["decode_tiny"])[0]
        return tiny + (small - tiny) * max(work - bytes_tiny, 0.0) / (bytes_small - bytes_tiny)
    ref = refs[cls]
    flops_ref, mat_ref, loops_ref = _work_terms(name, impl, ref)
    compute_ref = max(measured[cls] - overhead - mat_ref * _MASK_BYTES / bandwidth - loops_ref * op,
                      0.1 * measured[cls])
    rate = flops_ref / compute_ref
    work = impl.work
    dtype = str(inp.dtype).removeprefix("torch.")
    if dtype != "float32" and work.half != "never" and cls != "decode":  # decoding's work is bytes, not GEMMs
        half = constants.get("half_reference_seconds", {}).get(name, {}).get(dtype)
        single = measured.get("causal")
        if half and single:  # this backend's own half/float32 speed, measured on the causal reference
            rate *= max(single - overhead, 0.1 * single) / max(half - overhead, 0.1 * half)
        else:  # the machine's GEMM rates
            gemm = constants["gemm_gflops"]
            ratio = gemm.get(dtype, gemm["float32"]) / gemm["float32"]
            rate *= max(ratio, 1.0) if work.half == "when_fast" else ratio
    passes = 1.0
    if inp.requires_grad:  # a backward's own per-call cost, measured on the tiny input
        train_overhead = constants.get("train_backend_seconds", {}).get(name, overhead)
        passes = _train_passes(name, constants, overhead, train_overhead)
        overhead = train_overhead
    return overhead + passes * (flops / rate + loops * op) + materialized * _MASK_BYTES / bandwidth


def _train_passes(name: str, constants: dict, overhead: float, train_overhead: float) -> float:
    """A forward and backward's compute in forwards' compute, for ``name``: its own, measured on the
    causal reference (forward and backward less the training overhead, over the forward less the
    forward's), else :data:`_TRAIN_FLOPS` (an older probe's constants)."""
    both = constants.get("train_reference_seconds", {}).get(name)
    single = constants["reference_seconds"].get(name, {}).get("causal")
    if not both or not single:
        return _TRAIN_FLOPS
    return max(max(both - train_overhead, 0.1 * both) / max(single - overhead, 0.1 * single), 1.0)


def _cost_order(inp: AttentionInputs, registered: tuple[str, ...]) -> tuple[str, ...]:
    """The built-in order, stably sorted by :func:`estimated_seconds` (unmodelled backends after
    the modelled ones, in registration order)."""
    if torch.compiler.is_compiling() and not calibration.constants_loaded():
        constants = None  # never probe inside a trace: the built-in order
    else:
        constants = calibration.machine_constants()
    known = list_backends()
    # The built-in order for this call: a backend that would materialize this mask (SDPA given a
    # window, padding or a layout) ranks with the backends that materialize it, after those that
    # read its structure, however fused its kernel.
    static = builtin_order(registered)
    kinds = {n: known[n].work.rank(inp.mask is not None and known[n].dense_mask_elements(inp) > 0) for n in static}
    builtin = sorted(static, key=lambda n: (kinds[n], static.index(n)))
    modelled = [n for n in builtin if n != "naive"]
    if constants is None:
        return tuple(modelled)
    costs = {n: estimated_seconds(n, inp, constants) for n in modelled}
    inf = float("inf")
    order: list[str] = []
    # Decoding is priced by the bytes each backend reads per second on a reference of the same kind
    # (a few queries over 32 MiB each of K and V), whatever its kind for prefill: the estimates alone decide.
    decoding = _mask_class(inp) == "decode"
    for name in sorted(modelled, key=lambda n: inf if costs.get(n) is None else costs[n]):
        # The model's uncertainty: a backend passes one earlier in the built-in order only when
        # estimated more than MODEL_MARGIN times faster where that one is of a better kind (a fused
        # kernel, say, where it loops PyTorch ops), SAME_KIND_MARGIN times where both are of one
        # kind: there the order says nothing about speed (autotuning and calibration settle the rest).
        at = len(order)
        while at > 0 and builtin.index(order[at - 1]) > builtin.index(name) and (costs.get(name) or inf) <= (
                MODEL_MARGIN if not decoding and kinds[order[at - 1]] != kinds[name]
                else SAME_KIND_MARGIN) * (costs.get(order[at - 1]) or inf):
            at -= 1
        order.insert(at, name)
    return tuple(order)


def _memory_guard(order: tuple[str, ...], inp: AttentionInputs) -> tuple[str, ...]:
    """Backends that would materialize more than MATERIALIZE_LIMIT mask elements go last."""
    known = list_backends()
    heavy = set()
    for name in order:
        impl = known.get(name)
        if impl is None:
            continue
        elements = impl.dense_mask_elements(inp)
        if impl.work.materializes and inp.mask is not None:
            elements = max(elements, inp.B * inp.Hq * inp.Tq * inp.Tk)
        if elements > MATERIALIZE_LIMIT:
            heavy.add(name)
    return tuple(n for n in order if n not in heavy) + tuple(n for n in order if n in heavy)


_PRIORITY_CACHE: dict = {}
_PRIORITY_CACHE_SIZE = 1024
_IDENTITY_CACHE: dict = {}
_IDENTITY_CACHE_SIZE = 8
_CACHE_STATE: list = [None]  # (calibration generation, registered names) the cache was filled under


def _shape_class(inp: AttentionInputs) -> tuple:
    """Everything :func:`priority` reads. Offsets are in it: which tiles a mask keeps, and whether
    SDPA needs a mask at all, depend on the exact positions."""
    return (inp.q.shape, inp.k.shape, inp.v.shape, inp.q.dtype, inp.q.device, inp.mask, inp.q_offset, inp.kv_offset,
            inp.requires_grad, torch.compiler.is_compiling())


def priority(inp: AttentionInputs) -> tuple[str, ...]:
    """The order in which ``auto`` tries backends for this input (the whole policy).

    1. A measured table (``python -m attnkit bench``, see :mod:`attnkit.calibration`) with an entry
       for this device, dtype, mask kind, pass, heads and head dim: its ranking at the nearest
       measured length, where the leaders differ beyond the measured noise.
    2. Otherwise the built-in order (:func:`builtin_order`, from each backend's declared ``work``:
       fused kernels before loops of PyTorch ops over the same tiles) sorted by the cost model
       (:func:`estimated_seconds`), whose constants are probed on this machine on first use
       (:func:`attnkit.calibration.machine_constants`).
    3. Backends that would materialize more than MATERIALIZE_LIMIT mask elements go after the
       others; backends registered later and not modelled come next; ``naive`` last.

    The order is cached per shape class (:func:`_shape_class`): a decode loop pays a dict lookup.
    Each backend's reasons are still checked on every call."""
    state = (calibration.generation(), registered_names(), torch.get_num_threads())
    if _CACHE_STATE[0] != state:  # a new table, new constants, a new backend or thread count: decide afresh
        _PRIORITY_CACHE.clear()
        _IDENTITY_CACHE.clear()
        _CACHE_STATE[0] = state
    key = _shape_class(inp)
    # A mask holding tensors (padding lengths, a layout, a dense bool) hashes by identity: such
    # entries go to a small cache (a forward's layers share one mask), so few of them stay alive.
    cache, size = ((_PRIORITY_CACHE, _PRIORITY_CACHE_SIZE) if inp.mask is None or value_keyed(inp.mask)
                   else (_IDENTITY_CACHE, _IDENTITY_CACHE_SIZE))
    try:
        return cache[key]
    except TypeError:  # an unhashable mask or score part: decide without the cache
        return _priority(inp)
    except KeyError:
        pass
    order = _priority(inp)
    if len(cache) >= size:
        cache.clear()
    cache[key] = order
    return order


def _priority(inp: AttentionInputs) -> tuple[str, ...]:
    registered = registered_names()
    measured = calibration.preferred(inp)
    preferred = measured if measured is not None else _cost_order(inp, registered)
    return _order(_memory_guard(tuple(preferred), inp), registered)


@functools.lru_cache(maxsize=64)
def _order(preferred: tuple[str, ...], registered: tuple[str, ...]) -> tuple[str, ...]:
    """``preferred`` first, then the other registered backends, ``naive`` last (cached: the
    registry rarely changes, and attention() is called per layer per token)."""
    order = [name for name in preferred if name in registered]
    order += [name for name in registered if name not in order and name != "naive"]
    return tuple(order + ["naive"] * ("naive" in registered and "naive" not in order))


def _candidates(backend: str) -> tuple[list[str], bool]:
    """Names to try and whether they were named explicitly (by argument or ``use_backend``)."""
    if backend != "auto":
        get_backend(backend)
        return [backend], True
    scoped = _SCOPED.get()
    if scoped is not None:
        return list(scoped), True
    return [], False


def resolve(inp: AttentionInputs, backend: str = "auto") -> tuple[type[Backend], AttentionInputs]:
    """The backend that will run ``inp`` and the inputs it runs on: ``inp`` itself, or, when K/V
    are a cache handle that no candidate reads in place (or the one that reads it cannot run this
    call), ``inp.dense()``, the handle's declared conversion to contiguous K/V."""
    if inp.kv_format != "dense":
        reader = _reader(inp, backend)
        if reader is not None:
            return reader, inp
        inp = inp.dense()
    return select(inp, backend), inp


# -- the per-call cache of attention()'s hot path -------------------------------------------------

_CALLS: dict = {}  # call key -> (backend, AttentionInputs.cache_fields(), generation, registered names, on the CPU)
_CALLS_SIZE = 512
_CALLS_STATE: list = [None]  # (calibration generation, registered names) the cache was filled under
_CONTEXT_VARS: list = [((), ())]  # (registered names, their backends' reason_contexts)


def resolve_call(q, k, v, mask, scale, dropout_p, q_offset, kv_offset, return_lse, kv_finite,
                 backend: str) -> tuple[type[Backend], AttentionInputs, bool | None]:
    """``attention()``'s common call (dense tensors, no bias, score modifier or sinks): the backend,
    validated inputs and whether the host may branch on them (:func:`attnkit.backends.nonfinite.host_may_branch`;
    None: not known here), cached per call class: shapes, dtypes, devices, mask, offsets, scale,
    dropout, LSE, ``kv_finite``, whether gradients are needed, the backend asked for, the scope
    (``use_backend``, autotuning, each backend's ``reason_contexts``) and the thread count (the
    machine constants are per count). A hit skips validation and selection, both pure functions of
    that key (strides are not in it: neither reads them). Each entry remembers the calibration
    generation (table and machine constants) and the registry it was decided under and is used only
    while both still hold, so a choice never outlives a new calibration or backend, even one made
    while another thread recalibrated. Anything else goes through :meth:`AttentionInputs.create`
    and :func:`resolve` as before. With the built extension the tensors and the scalar arguments
    are keyed in one C call (:func:`attnkit.csrc.loader.fastpath`), which also proves the tensors
    plain (no subclass or ``torch.func`` wrapper): the host may then branch on CPU tensors."""
    if _is_compiling():
        return (*_resolve_slow(q, k, v, mask, scale, dropout_p, q_offset, kv_offset, return_lse, kv_finite, backend),
                None)
    # With the built extension, a hit is one C call (key, lookup, checks and the inputs, as below);
    # a miss returns the key it built, None a call it does not key.
    found = _cached_call(q, k, v, mask, scale, dropout_p, q_offset, kv_offset, return_lse, kv_finite, backend)
    if found is not None and len(found) == 3:
        return found
    generation, names = calibration.generation(), names_now()
    if found is not None:
        return _decide(found, generation, names, True, q, k, v, mask, scale, dropout_p, q_offset, kv_offset,
                       return_lse, kv_finite, backend)
    # Shapes, dtypes, devices, whether gradients are needed, the thread count (the machine
    # constants are per count) and the scalars with their types (1 == True == 1.0 as Python keys,
    # but a call validation would refuse must never hit): one C call with the built extension.
    scalars = loader.key(q, k, v, scale, dropout_p, q_offset, kv_offset, return_lse, kv_finite)
    plain = scalars is not None
    if not plain:
        if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
            return (*_resolve_slow(q, k, v, mask, scale, dropout_p, q_offset, kv_offset, return_lse, kv_finite,
                                   backend), None)
        scalars = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
                   torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
                   torch.get_num_threads(), scale, dropout_p, q_offset, kv_offset, return_lse, kv_finite,
                   type(scale), type(dropout_p), type(q_offset), type(kv_offset), type(return_lse), type(kv_finite))
    generation, names = calibration.generation(), names_now()
    contexts = _CONTEXT_VARS[0]
    if contexts[0] is not names:
        known = list_backends()
        names = names_now()
        contexts = _CONTEXT_VARS[0] = (names, tuple(var for name in names for var in known[name].reason_contexts))
    contexts = contexts[1]
    key = (scalars, mask, backend, _SCOPED.get(), _AUTOTUNE[0], contexts and tuple([var.get() for var in contexts]))
    try:
        hit = _CALLS.get(key)
    except (TypeError, RuntimeError):  # an unhashable or tensor-valued argument (a scale tensor): no cache
        return (*_resolve_slow(q, k, v, mask, scale, dropout_p, q_offset, kv_offset, return_lse, kv_finite, backend),
                None)
    if hit is not None and hit[2] == generation and hit[3] is names:
        return hit[0], AttentionInputs.trusted(hit[1], q, k, v), plain and hit[4]
    return _decide(key, generation, names, plain, q, k, v, mask, scale, dropout_p, q_offset, kv_offset, return_lse,
                   kv_finite, backend)


def _decide(key, generation, names, plain, q, k, v, mask, scale, dropout_p, q_offset, kv_offset, return_lse,
            kv_finite, backend):
    """:func:`resolve_call` on a miss: validate, select, and store the decision under ``key``."""
    impl, inp = _resolve_slow(q, k, v, mask, scale, dropout_p, q_offset, kv_offset, return_lse, kv_finite, backend)
    if mask is not None and not (isinstance(mask, Mask) and value_keyed(mask)):
        return impl, inp, None  # not stored: an entry would keep the mask's tensors alive (and equals no other mask)
    if _CALLS_STATE[0] != (generation, names) or len(_CALLS) >= _CALLS_SIZE:
        _CALLS.clear()  # entries of an older generation or registry can never hit again
        _CALLS_STATE[0] = (generation, names)
    _CALLS[key] = (impl, inp.cache_fields(), generation, names, inp.q.is_cpu)
    return impl, inp, None


def _cached_call(*args):
    """The extension's ``call`` (:func:`attnkit.csrc.loader.fastpath`), told once where this module
    keeps its cache; without the extension a function that keys nothing. Bound on first use."""
    global _cached_call
    fast = loader.fastpath()
    if fast is None or not hasattr(fast, "call"):
        _cached_call = _no_call
    else:
        from . import registry

        fast.configure(globals(), vars(registry), vars(calibration), AttentionInputs)
        _cached_call = fast.call
    return _cached_call(*args)


def _no_call(*args):
    return None


def _resolve_slow(q, k, v, mask, scale, dropout_p, q_offset, kv_offset, return_lse, kv_finite, backend):
    inp = AttentionInputs.create(q, k, v, mask=mask, scale=scale, dropout_p=dropout_p, q_offset=q_offset,
                                 kv_offset=kv_offset, return_lse=return_lse, kv_finite=kv_finite)
    return resolve(inp, backend)


def _reader(inp: AttentionInputs, backend: str) -> type[Backend] | None:
    """The first candidate that reads ``inp``'s KV handle in place and can run it, or None."""
    known = list_backends()
    names, named = _candidates(backend)
    for name in names if named else priority(inp):
        impl = known[name]
        if (named or impl.exact) and inp.kv_format in impl.kv_formats and impl.can_run(inp):
            return impl
    return None


def select(inp: AttentionInputs, backend: str = "auto") -> type[Backend]:
    """The backend that will run ``inp``; ``NoBackendError`` with every reason if none can.
    K/V given as a cache handle are converted when no candidate reads them (:func:`resolve`)."""
    if inp.kv_format != "dense":
        return resolve(inp, backend)[0]
    known = list_backends()
    if backend == "auto" and _SCOPED.get() is None:  # the common case, kept lean: per layer per token
        if _AUTOTUNE[0] and not torch.compiler.is_compiling():
            tuned = _autotuned(inp, known)
            if tuned is not None:
                return known[tuned]
        for name in priority(inp):
            impl = known[name]
            if impl.exact and impl.can_run(inp):
                return impl
        raise NoBackendError(_no_backend_message(inp, list(known)))
    names, _ = _candidates(backend)
    for name in names:
        if known[name].can_run(inp):
            return known[name]
    raise NoBackendError(_no_backend_message(inp, names))


# -- autotuning (opt-in, as torch.backends.cudnn.benchmark) ---------------------------------------

_AUTOTUNE = [os.environ.get("ATTNKIT_AUTOTUNE", "").strip().lower() in ("1", "true", "yes", "on")]
_TUNED: dict = {}  # (shape class, candidates) -> (winner, {name: seconds})
_TUNE_LOCK = threading.Lock()
#: How many of the leading candidates the first call of a shape class times, and its time bound.
AUTOTUNE_CANDIDATES = 3
AUTOTUNE_BUDGET_S = 1.0


class autotune:
    """Turn autotuning on (``attnkit.autotune()``) or off (``attnkit.autotune(False)``) for the
    process; as a context manager (``with attnkit.autotune():``) it restores the previous setting
    on exit. ``ATTNKIT_AUTOTUNE=1`` turns it on at import.

    While on, the first ``auto`` call of each shape class (shapes, dtype, mask, offsets, pass,
    and the backends that can run it) times the :data:`AUTOTUNE_CANDIDATES` leading candidates of
    :func:`priority` (forward, without gradients, at most about :data:`AUTOTUNE_BUDGET_S` seconds)
    and remembers the fastest; later calls of the class take it. Thread-safe; never inside
    ``torch.compile`` tracing; inputs with dropout are not tuned (timing would draw random numbers).
    ``explain()`` quotes the measured times."""

    def __init__(self, enabled: bool = True):
        if not isinstance(enabled, bool):
            raise TypeError(f"autotune: expected True or False, got {enabled!r}. Fix: attnkit.autotune(True).")
        self._previous = _AUTOTUNE[0]
        _AUTOTUNE[0] = enabled

    def __enter__(self) -> autotune:
        return self

    def __exit__(self, *exc) -> None:
        _AUTOTUNE[0] = self._previous


def _tune_key(inp: AttentionInputs, known: dict) -> tuple[tuple, list[str]]:
    candidates = [n for n in priority(inp) if known[n].exact and known[n].can_run(inp)][:AUTOTUNE_CANDIDATES]
    return (_shape_class(inp), tuple(candidates)), candidates


def _autotuned(inp: AttentionInputs, known: dict) -> str | None:
    """The measured winner for ``inp``'s shape class (timing the candidates on the first call)."""
    if inp.dropout_p > 0:
        return None
    try:
        key, candidates = _tune_key(inp, known)
        hash(key)
    except TypeError:
        return None
    if len(candidates) < 2:
        return None
    found = _TUNED.get(key)
    if found is None:
        with _TUNE_LOCK:
            found = _TUNED.get(key)
            if found is None:
                found = _TUNED[key] = _time_candidates(inp, candidates, known)
    return found[0]


def _time_candidates(inp: AttentionInputs, candidates: list[str], known: dict) -> tuple[str, dict[str, float]]:
    import time

    deadline = time.perf_counter() + AUTOTUNE_BUDGET_S
    times: dict[str, float] = {}
    with torch.no_grad():
        for name in candidates:
            runs = []
            for _ in range(3):  # a warm-up call, then the best of two (fewer when over budget)
                start = time.perf_counter()
                known[name].forward(inp, None)
                runs.append(time.perf_counter() - start)
                if time.perf_counter() > deadline:
                    break
            times[name] = min(runs[1:] or runs)
            if time.perf_counter() > deadline:
                break
    return min(times, key=times.get), times


def _tuned_description(inp: AttentionInputs) -> str:
    try:
        found = _TUNED.get(_tune_key(inp, list_backends())[0])
    except TypeError:
        return ""
    if found is None:
        return ""
    figures = ", ".join(f"{n} {t * 1e3:.3g} ms" for n, t in sorted(found[1].items(), key=lambda x: x[1]))
    return f"autotuned on this machine (first call of this shape class, forward): {figures}"


def _estimates(inp: AttentionInputs, runnable: list[str]) -> str:
    """The cost model's figures for the leading runnable backends (for ``explain``)."""
    if torch.compiler.is_compiling() and not calibration.constants_loaded():
        return ""
    constants = calibration.machine_constants()
    figures = [(n, estimated_seconds(n, inp, constants)) for n in runnable[:AUTOTUNE_CANDIDATES]]
    figures = [f"{n} {t * 1e3:.3g} ms" for n, t in figures if t is not None]
    return f"; estimated from the probed constants: {', '.join(figures)}" if figures else ""


def _describe(inp: AttentionInputs) -> str:
    mask = "no mask" if inp.mask is None else repr(inp.mask)
    return (
        f"q {tuple(inp.q.shape)}, k {tuple(inp.k.shape)}, v {tuple(inp.v.shape)}, {inp.dtype}, "
        f"{inp.device.type}, {mask}, q_offset={inp.q_offset}, kv_offset={inp.kv_offset}"
    )


def _no_backend_message(inp: AttentionInputs, names: Sequence[str]) -> str:
    known = list_backends()
    lines = [f"no attention backend can run this input ({_describe(inp)}):"]
    for name in names:
        reasons = known[name].not_supported_reasons(inp)
        if not known[name].exact and not reasons:
            reasons = ["approximate: runs only when named, e.g. backend='%s'" % name]
        lines.append(f"  {name}: {'; '.join(reasons) or 'can run'}")
    lines.append("Fix: relax the unsupported option, or name a backend that lists no reasons above.")
    return "\n".join(lines)


@dataclass(frozen=True)
class Explanation:
    """What ``auto`` (or a named backend) would do for an input, and why."""

    chosen: str | None
    reasons: dict[str, list[str]]  # backend name -> reasons it cannot run ([] = it could)
    order: list[str]  # the order tried
    description: str
    plan: str = ""  # how the chosen backend runs it, in words
    measured: str = ""  # the measured figures behind auto's order, or why built-in defaults apply
    named: tuple[str, ...] = ()  # the backends named (backend= or use_backend); () for auto
    kv: str = ""  # how a KV cache handle is read: in place, or converted to dense K/V and why

    def __str__(self) -> str:
        lines = [f"input: {self.description}"]
        named = ", ".join(self.named)
        if self.chosen:
            lines.append(f"chosen: {self.chosen}")
        elif self.named:
            lines.append(f"chosen: none: the backend(s) named ({named}) cannot run this input")
        else:
            lines.append("chosen: none (no backend can run this input)")
        for name in self.order:
            why = self.reasons[name]
            if name == self.chosen:
                first = "the first named" if self.named else "first in priority order"
                lines.append(f"  {name}: runs ({first} with no reasons against it): {self.plan}")
            elif why:
                lines.append(f"  {name}: not used: {'; '.join(why)}")
            elif self.named and name not in self.named:
                lines.append(f"  {name}: could run, but was not named ({named} was)")
            else:
                lines.append(f"  {name}: could run, but comes after {self.chosen} in priority order")
        if self.kv:
            lines.append(f"kv cache: {self.kv}")
        if self.measured:
            lines.append(f"policy: {self.measured}")
        return "\n".join(lines)


def explain(q, k, v, *, backend: str = "auto", **kwargs) -> Explanation:
    """Say which backend ``attention(q, k, v, **kwargs)`` would run and why the others would not.

    Takes the same keyword arguments as :func:`attnkit.attention`; runs nothing."""
    inp = AttentionInputs.create(q, k, v, **kwargs)
    kv = ""
    if inp.kv_format != "dense":
        handle, reader = inp.k, _reader(inp, backend)
        if reader is not None:
            kv = f"{handle!r} read in place by {reader.name}"
            return _explain(inp, backend, kv)
        why = {name: impl.not_supported_reasons(inp) for name, impl in list_backends().items()
               if inp.kv_format in impl.kv_formats}
        kv = (f"{handle!r} converted to contiguous {inp.dtype} K/V (a copy), because "
              + "; ".join(f"{name}, which reads it in place: {'; '.join(r) or 'not a candidate'}"
                          for name, r in why.items()))
        inp = inp.dense()
    return _explain(inp, backend, kv)


def _explain(inp: AttentionInputs, backend: str, kv: str) -> Explanation:
    known = list_backends()
    names, named = _candidates(backend)
    order = list(names if named else priority(inp))
    reasons = {}
    for name in known:
        why = list(known[name].not_supported_reasons(inp))
        if not named and not known[name].exact:
            why.append("approximate: runs only when named")
        reasons[name] = why
    order = order + [name for name in known if name not in order]
    chosen = next((name for name in (names if named else priority(inp)) if not reasons[name]), None)
    measured = "" if named else calibration.describe(inp)
    if not named and calibration.preferred(inp) is None:
        measured += _estimates(inp, [n for n in order if not reasons[n]])
    if not named and _AUTOTUNE[0] and inp.dropout_p == 0:
        tuned = _tuned_description(inp)
        if tuned:
            try:
                chosen = _TUNED[_tune_key(inp, known)[0]][0]
            except (KeyError, TypeError):
                pass
            measured = f"{tuned}; {measured}"
    plan = known[chosen].describe(inp) if chosen else ""
    return Explanation(chosen, reasons, order, _describe(inp), plan, measured, tuple(names) if named else (), kv)


@contextlib.contextmanager
def use_backend(*names: str | Sequence[str]) -> Iterator[None]:
    """Within the block, ``backend="auto"`` means the first of ``names`` that can run.

    ``with use_backend("tiled"):`` or ``with use_backend("sliding_window", "tiled"):``."""
    flat: list[str] = []
    for name in names:
        flat.extend([name] if isinstance(name, str) else list(name))
    if not flat:
        raise ValueError("use_backend: expected at least one backend name, e.g. use_backend('tiled').")
    for name in flat:
        get_backend(name)
    token = _SCOPED.set(tuple(flat))
    try:
        yield
    finally:
        _SCOPED.reset(token)
