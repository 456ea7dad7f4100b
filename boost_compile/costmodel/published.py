"""BOOST.md section 6's published iteration times (A100, bf16, seq 4096, batch 4): what the scale
model is compared with and the planner's published settings start from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Published:
    """A row of BOOST.md section 6 (A100, bf16, seq 4096, batch 4): iteration times in s."""

    model: str
    tp: int
    pp: int
    full_rank: float
    vanilla: float
    btp: float

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def times(self) -> dict[str, float]:
        return {"full-rank": self.full_rank, "vanilla": self.vanilla, "btp": self.btp}


PUBLISHED = (
    Published("1B", 1, 1, 0.85, 0.56, 0.59),
    Published("3B", 2, 1, 1.14, 1.41, 0.78),
    Published("7B", 4, 1, 1.06, 1.64, 0.72),
    Published("13B", 4, 2, 2.07, 2.42, 1.30),
)
