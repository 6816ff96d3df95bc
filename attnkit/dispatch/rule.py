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

Then the other registered backends, ``naive`` last. The caller takes the first exact backend with
no reasons against the input. Nothing here is timed or probed: the same input, install and table
give the same order in every process, whatever the machine's load.
"""

from __future__ import annotations

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


def _static_key(impl: type[Backend], materialized) -> tuple[bool, bool, bool, bool]:
    """Smaller first: a backend that materializes this call's mask last; Python loops over tiles after
    whole-tensor ops; PyTorch ops after one fused kernel; repeated grouped K/V after reading them in place."""
    work = impl.work
    return (_flag(materialized > 0), work.loop_ops > 0, not work.fused, work.gqa == "repeats")


def _flag(condition) -> bool:
    """``condition`` as a plain bool; traced with dynamic shapes, a guard on it (``if`` specializes
    a symbolic comparison, where ``bool()`` may leave it symbolic)."""
    return True if condition else False


def _ordered(inp: AttentionInputs, names: list[str], known: dict) -> list[str]:
    """``names`` in the rule's order for ``inp`` (steps 2–4 of the module docstring). Plain tuples of
    bools are sorted (no key functions): a ``torch.compile`` trace with dynamic shapes sorts them too."""
    elements = [_materialized(known[n], inp) for n in names]
    decoding = _flag(inp.Tq <= DECODE_QUERIES and inp.Tk >= inp.Tq) and not inp.requires_grad
    keys = [(_flag(e > MATERIALIZE_LIMIT), not (decoding and _flag(known[n].decodes(inp))),
             *_static_key(known[n], e), i) for i, (n, e) in enumerate(zip(names, elements))]
    return [names[key[-1]] for key in sorted(keys)]  # the index last: registration order breaks ties


def uses_table(inp: AttentionInputs) -> bool:
    """Whether the measured table may rank ``inp``: it times ``Tq == Tk``, so never a decoding
    step's few queries (step 1 of the module docstring)."""
    return inp.Tq > DECODE_QUERIES


def builtin_order(inp: AttentionInputs) -> tuple[str, ...]:
    """Steps 2–4 of the rule for ``inp``: the exact registered backends but ``naive``, decode
    kernels first for a decoding step, then the static order, the memory guard applied."""
    known = list_backends()
    return tuple(_ordered(inp, [n for n in registered_names() if known[n].exact and n != "naive"], known))


def priority(inp: AttentionInputs) -> tuple[str, ...]:
    """The order in which ``auto`` tries backends for ``inp`` (the whole rule; see the module
    docstring): the measured table's ranking where it has a row, else :func:`builtin_order`; the
    memory guard; then every other registered backend, ``naive`` last."""
    known, registered = list_backends(), registered_names()
    measured = table.preferred(inp) if uses_table(inp) else None
    if measured is None:
        order = list(builtin_order(inp))
    else:  # the table's ranking, the memory guard applied
        order = [n for n in measured if n in known and n != "naive"]
        heavy = {n for n in order if _materialized(known[n], inp) > MATERIALIZE_LIMIT}
        order = [n for n in order if n not in heavy] + [n for n in order if n in heavy]
    order += [n for n in registered if n not in order and n != "naive"]
    return tuple(order + ["naive"] * ("naive" in registered))
