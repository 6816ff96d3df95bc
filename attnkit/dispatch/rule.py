"""The rule ``auto`` follows: which backends it tries for an input, and in what order.

Read top to bottom, for one call:

1. **The measured table** (``python -m attnkit bench``, :mod:`attnkit.dispatch.table`): where this
   machine has a verified row for the call's device, dtype, mask kind, pass, heads and head dim,
   its ranking at the nearest measured length leads.
2. **The decode rule**: a few queries (``Tq <= DECODE_QUERIES``) over at least as many keys, for
   inference, go first to a backend with a kernel built for decoding (:meth:`Backend.decodes`: one
   pass over each K/V row for every query head of its group).
3. **The static order**, from what each backend declares (:class:`~attnkit.registry.Work`): fused
   kernels before PyTorch ops over whole tensors, before Python loops over tiles; among fused
   kernels, one that reads grouped K/V in place before one that repeats them; a backend that would
   materialize this call's mask after every backend that reads its structure; registration order
   breaks ties.
4. **The memory guard**: a backend that would materialize more than :data:`MATERIALIZE_LIMIT` mask
   elements goes last (a memory bound, not a speed crossover).

5. **Key lists**: a mask of per-query key lists (a ``TopK`` conjunct) goes first to the backends
   that declare the ``"key_lists"`` mask form: they compute the listed pairs only, O(Tq·k), where any
   other backend evaluates the lists over every (query, key) pair.

Then the other registered backends, ``naive`` last. The caller takes the first exact backend with
no reasons against the input. Nothing here is timed or probed: the same input, install and table
give the same order in every process, whatever the machine's load.
"""

from __future__ import annotations

from torch.compiler import is_compiling

from ..inputs import AttentionInputs
from ..registry import Backend, list_backends, registered_names
from . import table

__all__ = ["priority", "builtin_order", "MATERIALIZE_LIMIT", "DECODE_QUERIES"]

#: Above this many materialized mask elements per call (B*H*Tq*Tk), a backend that builds the whole
#: (Tq, Tk) mask costs more memory than one that reads the mask's structure: 2**26 bool elements =
#: 64 MiB. Such backends go last.
MATERIALIZE_LIMIT = 2**26
#: At most this many queries per call count as a decoding step (one token, or a few speculative ones).
DECODE_QUERIES = 16


def _materialized(impl: type[Backend], inp: AttentionInputs) -> int:
    """Mask elements ``impl`` would materialize for ``inp`` (0: it reads the mask's structure)."""
    if inp.mask is None:
        return 0
    elements = impl.dense_mask_elements(inp)
    return max(elements, inp.B * inp.Hq * inp.Tq * inp.Tk) if impl.work.materializes else elements


def _work_key(impl: type[Backend]) -> tuple[bool, bool, bool]:
    """Smaller first: Python loops over tiles after whole-tensor ops; PyTorch ops after one fused kernel;
    repeated grouped K/V after reading them in place."""
    work = impl.work
    return (work.loop_ops > 0, not work.fused, work.gqa == "repeats")


def _flag(condition) -> bool:
    """``condition`` as a plain bool; traced with dynamic shapes, a guard on it (``if`` specializes
    a symbolic comparison, where ``bool()`` may leave it symbolic)."""
    return True if condition else False


_SORTED: dict = {}  # registered names -> the exact ones but naive, sorted by _work_key (registration breaks ties)


def _by_work(registered: tuple[str, ...], known: dict) -> list[str]:
    # Traced, sorted afresh and never stored: a graph that read or filled the cache would be guarded
    # on its contents, and the next call (the cache filled since) would compile again.
    found = None if is_compiling() else _SORTED.get(registered)
    if found is None:
        names = [n for n in registered if known[n].exact and n != "naive"]
        found = [n for _, _, n in sorted((_work_key(known[n]), i, n) for i, n in enumerate(names))]
        if not is_compiling():
            _SORTED[registered] = found
    return found


def _ordered(inp: AttentionInputs, names: list[str], known: dict) -> list[str]:
    """``names`` (sorted by Work) in the rule's order for ``inp``: stable partitions, so registration
    order still breaks ties. First the backends within the memory guard, then those past it; in each,
    for a decoding step the decode kernels first; then those that read the mask's structure, then
    those that would materialize it."""
    decoding = _flag(inp.Tq <= DECODE_QUERIES and inp.Tk >= inp.Tq) and not inp.requires_grad
    decodes = {n for n in names if decoding and _flag(known[n].decodes(inp))}
    if inp.mask is None:
        return [n for n in names if n in decodes] + [n for n in names if n not in decodes]
    elements = {n: 0 if n in decodes else _materialized(known[n], inp) for n in names}  # a decode kernel reads it
    heavy = {n for n in names if _flag(elements[n] > MATERIALIZE_LIMIT)}
    order = []
    reads = {n for n in names if not _flag(elements[n] > 0)}
    for group in ([n for n in names if n not in heavy], [n for n in names if n in heavy]):
        for first in (True, False):
            part = [n for n in group if (n in decodes) is first]
            order += [n for n in part if n in reads] + [n for n in part if n not in reads]
    return order


def uses_table(inp: AttentionInputs) -> bool:
    """Whether the measured table may rank ``inp``: it times ``Tq == Tk``, so never a decoding
    step's few queries (step 1 of the module docstring)."""
    return inp.Tq > DECODE_QUERIES


def builtin_order(inp: AttentionInputs) -> tuple[str, ...]:
    """Steps 2–4 of the rule for ``inp``: the exact registered backends but ``naive``, decode
    kernels first for a decoding step, then the static order, the memory guard applied."""
    known = list_backends()
    return tuple(_ordered(inp, _by_work(registered_names(), known), known))


def priority(inp: AttentionInputs) -> tuple[str, ...]:
    """The order in which ``auto`` tries backends for ``inp`` (the whole rule; see the module
    docstring): the measured table's ranking where it has a row, else :func:`builtin_order`; the
    memory guard; then every other registered backend; the key lists' backends first for a
    ``TopK`` mask; ``naive`` last."""
    known, registered = list_backends(), registered_names()
    measured = table.preferred(inp) if uses_table(inp) else None
    if measured is None:
        order = list(builtin_order(inp))
    else:  # the table's ranking, the memory guard applied
        order = [n for n in measured if n in known and n != "naive"]
        heavy = {n for n in order if _materialized(known[n], inp) > MATERIALIZE_LIMIT}
        order = [n for n in order if n not in heavy] + [n for n in order if n in heavy]
    order += [n for n in registered if n not in order and n != "naive"]
    if inp.mask is not None and inp.mask.topk() is not None:  # step 5: the key lists' own backends first
        gathers = [n for n in order if "key_lists" in known[n].mask_support.forms]
        order = gathers + [n for n in order if n not in gathers]
    return tuple(order + ["naive"] * ("naive" in registered))
