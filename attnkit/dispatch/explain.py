"""``explain()``: which backend a call would run, why the others would not, and the one line of
policy behind the choice (the measured table's figures, the static rule, or autotuning)."""

from __future__ import annotations

from dataclasses import dataclass

from ..inputs import AttentionInputs
from ..registry import list_backends
from . import table, tuning
from .calls import candidates, describe_input, reader
from .rule import DECODE_QUERIES, priority, uses_table

__all__ = ["Explanation", "explain", "policy_line"]


@dataclass(frozen=True)
class Explanation:
    """What ``auto`` (or a named backend) would do for an input, and why."""

    chosen: str | None
    reasons: dict[str, list[str]]  # backend name -> reasons it cannot run ([] = it could)
    order: list[str]  # the order tried
    description: str
    plan: str = ""  # how the chosen backend runs it, in words
    measured: str = ""  # the policy behind auto's order, in one line
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


def policy_line(inp: AttentionInputs, chosen: str | None) -> str:
    """Why ``auto``'s order is what it is for ``inp``, in one line a user can act on."""
    measured = table.describe(inp) if uses_table(inp) else None
    if measured is not None:
        return measured
    known = list_backends()
    if chosen is not None and inp.Tq <= DECODE_QUERIES and known[chosen].decodes(inp):
        return f"the static rule: a decoding step ({inp.Tq} queries over {inp.Tk} keys) goes to a decode kernel"
    return ("the static rule (fused kernels that read the mask's structure first; see attnkit.dispatch.rule); "
            f"{table.status()}; `python -m attnkit bench` measures this machine's own ranking")


def explain(q, k, v, *, backend: str = "auto", **kwargs) -> Explanation:
    """Say which backend ``attention(q, k, v, **kwargs)`` would run and why the others would not.

    Takes the same keyword arguments as :func:`attnkit.attention`; runs nothing."""
    inp = AttentionInputs.create(q, k, v, **kwargs)
    kv = ""
    if inp.kv_format != "dense":
        handle, found = inp.k, reader(inp, backend)
        if found is not None:
            return _explain(inp, backend, f"{handle!r} read in place by {found.name}")
        why = {name: impl.not_supported_reasons(inp) for name, impl in list_backends().items()
               if inp.kv_format in impl.kv_formats}
        kv = (f"{handle!r} converted to contiguous {inp.dtype} K/V (a copy), because "
              + "; ".join(f"{name}, which reads it in place: {'; '.join(r) or 'not a candidate'}"
                          for name, r in why.items()))
        inp = inp.dense()
    return _explain(inp, backend, kv)


def _explain(inp: AttentionInputs, backend: str, kv: str) -> Explanation:
    known = list_backends()
    names, named = candidates(backend)
    tried = list(names if named else priority(inp))
    reasons = {}
    for name in known:
        why = list(known[name].not_supported_reasons(inp))
        if not named and not known[name].exact:
            why.append("approximate: runs only when named")
        reasons[name] = why
    order = tried + [name for name in known if name not in tried]
    chosen = next((name for name in tried if not reasons[name]), None)
    measured = ""
    if not named:
        measured = policy_line(inp, chosen)
        if tuning.enabled() and inp.dropout_p == 0:
            winner, line = tuning.tuned_description(inp, known)
            if winner is not None:
                chosen, measured = winner, f"{line}; {measured}"
    plan = known[chosen].describe(inp) if chosen else ""
    return Explanation(chosen, reasons, order, describe_input(inp), plan, measured, tuple(names) if named else (), kv)
