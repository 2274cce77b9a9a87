"""What happens when an operator breaks the bookkeeping contract: raise, or warn once and count.

Delivery finds violations (a missing tombstone, an early close, a false order claim) and hands them
here as plain values; in strict mode the first one raises ``ContractViolation``, otherwise each is
counted and one ``ContractWarning`` is shown per kind, operator and epoch.
"""

from __future__ import annotations

import logging
import warnings
from typing import NamedTuple

from zephon.errors import ContractViolation, ContractWarning

log = logging.getLogger("zephon")


class Violation(NamedTuple):
    """One broken contract, found at delivery."""

    kind: str  # "missing-tombstone", "early-close" or "order"
    operators: tuple[str, ...]  # the operators that may be at fault
    lane: int
    epoch: int  # -1 when not tied to an epoch
    message: str

    def text(self) -> str:
        names = ", ".join(self.operators) if self.operators else "unknown operator"
        return f"contract violation ({self.kind}) by {names}: {self.message}"


class ContractPolicy:
    """Raises (``strict``) or counts and warns once per kind, operator and epoch."""

    def __init__(self, strict: bool):
        self.strict = strict
        self.count = 0
        self._warned: set[tuple] = set()

    def report(self, violations: list[Violation]) -> None:
        for violation in violations:
            if self.strict:
                raise ContractViolation(violation.text()).add_context(lane=violation.lane)
            self.count += 1
            key = (violation.kind, violation.operators, violation.epoch)
            if key not in self._warned:
                self._warned.add(key)
                log.warning("%s", violation.text())
                warnings.warn(violation.text(), ContractWarning, stacklevel=4)
