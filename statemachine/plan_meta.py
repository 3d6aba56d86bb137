"""What the planner records in the ledger's meta table, in the batch's own transaction: the
slice of the source it planned from, how far it got and how many bytes a token's dump takes.
The keys are spelled here alone; the planner writes them, the daemon reads them back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from eagle3d.statemachine.ledger import Ledger

# The [data] keys a plan was made from: a config that changes any of them is another dataset.
SLICE = ("source", "first", "max_tokens", "responses")


class PlanMeta(NamedTuple):
    source: str | None = None  # None: nothing planned yet
    first: int = 0
    max_tokens: int = 0
    # A ledger planned before [data] responses existed has the dataset's answers.
    responses: str = "dataset"
    bytes_per_token: int = 0  # 0: nothing planned yet
    through: int | None = None  # the last source index planned
    exhausted: bool = False  # the source ended before first + limit

    def entries(self) -> dict[str, str]:
        """The meta rows to record with a planned batch."""
        rows = {f"plan.{k}": str(getattr(self, k)) for k in (*SLICE, "bytes_per_token")}
        if self.through is not None:
            rows["plan.through"] = str(self.through)
        if self.exhausted:
            rows["plan.exhausted"] = "1"
        return rows


def read(ledger: Ledger) -> PlanMeta:
    """The plan this ledger records (PlanMeta() where nothing was planned)."""
    meta = ledger.meta
    through = meta("plan.through")
    default = PlanMeta()
    return PlanMeta(source=meta("plan.source"),
                    first=int(meta("plan.first") or default.first),
                    max_tokens=int(meta("plan.max_tokens") or default.max_tokens),
                    responses=meta("plan.responses") or default.responses,
                    bytes_per_token=int(meta("plan.bytes_per_token") or 0),
                    through=None if through is None else int(through),
                    exhausted=meta("plan.exhausted") == "1")
