"""How an op picks its implementation: each implementation says which calls it takes and declines the others with a
reason; the op runs the first that takes the call, or the one `impl=` names (raising with its reason if it declines).

    IMPLEMENTATIONS = (mgpu.IMPLEMENTATION, triton.TWO_STAGE)       # in order of preference
    chosen = select(IMPLEMENTATIONS, call, impl=None)               # trace time, no device work
    out = chosen.run(call)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence


class Declined(ValueError):
    """The call is one no implementation takes (or the one `impl=` names declines it); the message gives the reasons."""


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One implementation of an op's contract.

    name: what `impl=` calls it. declines(call) -> None when it takes the call, else the reason it does not (a short
    phrase: "custom masks", "device sm_80 is not sm_90"). run(call) -> the op's result.
    """

    name: str
    declines: Callable[[Any], str | None]
    run: Callable[[Any], Any]


def select(implementations: Sequence[Implementation], call, impl: str | None = None) -> Implementation:
    """The implementation that runs `call`: `impl` by name, else the first that takes it.

    Raises ValueError when `impl` is unknown, and `Declined` (a ValueError) naming the reason when `impl` declines the
    call or when every implementation declines it (with each one's reason).
    """
    names = tuple(i.name for i in implementations)
    if impl is not None:
        chosen = next((i for i in implementations if i.name == impl), None)
        if chosen is None:
            raise ValueError(f"impl must be None or one of {names}; got {impl!r}")
        reason = chosen.declines(call)
        if reason is not None:
            raise Declined(f"impl={impl!r} cannot take this call: {reason}")
        return chosen
    reasons = []
    for candidate in implementations:
        reason = candidate.declines(call)
        if reason is None:
            return candidate
        reasons.append(f"{candidate.name}: {reason}")
    raise Declined("no implementation takes this call (" + "; ".join(reasons) + ")")


def declined(implementations: Sequence[Implementation], call) -> dict[str, str | None]:
    """{name: reason or None} for every implementation: what each would say of `call` (for docs and tests)."""
    return {i.name: i.declines(call) for i in implementations}
