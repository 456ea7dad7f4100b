"""Communication volume of one Llama layer under each TP plan (BOOST.md section 2)."""

from __future__ import annotations

from dataclasses import dataclass

#: (name, d, d_ff, layers, heads): the Llama shapes of BOOST.md section 6; CoLA rank r = d/4.
PAPER_SHAPES = [
    ("1B", 2048, 5461, 24, 32),
    ("3B", 3200, 8640, 26, 32),
    ("7B", 4096, 11008, 32, 32),
    ("13B", 5120, 13824, 40, 40),
]
#: BOOST.md section 6: 7B communication per layer (seq 4096, batch 4, bf16), GB.
PUBLISHED_7B_GB = {"full-rank TP": 0.25, "vanilla low-rank TP": 1.32, "btp": 0.22}


@dataclass
class LayerBytes:
    full_rank: int
    vanilla: int
    btp: int


def bytes_per_layer(tokens: int, d: int, d_ff: int, rank: int, elem: int = 2) -> LayerBytes:
    """Forward all-reduce payload of one layer, per BOOST.md section 2."""
    return LayerBytes(
        full_rank=2 * tokens * d * elem,
        vanilla=tokens * (5 * d + 2 * d_ff) * elem,
        btp=tokens * 7 * rank * elem,
    )


def ring_bytes_per_rank(payload: int, world: int) -> int:
    """What each rank sends in a ring all-reduce of ``payload`` bytes."""
    return 2 * (world - 1) * payload // world


def analytic_table(seq: int = 4096, batch: int = 4) -> str:
    """Markdown: bytes per layer for the paper's shapes at TP 2/4/8, and 7B beside the published figures."""
    tokens = seq * batch
    lines = [
        f"Forward all-reduce payload per layer, seq {seq} x batch {batch}, bf16 (GiB; per-rank ring traffic in brackets)",
        "",
        "| model | TP | full-rank TP | vanilla low-rank | btp | btp / full | btp / vanilla |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    gib = 1024**3
    for name, d, d_ff, _layers, _heads in PAPER_SHAPES:
        b = bytes_per_layer(tokens, d, d_ff, d // 4)
        for world in (2, 4, 8):
            cells = [f"{x / gib:.3f} [{ring_bytes_per_rank(x, world) / gib:.3f}]" for x in (b.full_rank, b.vanilla, b.btp)]
            lines.append(
                f"| {name} | {world} | {' | '.join(cells)} | {b.btp / b.full_rank:.3f} | {b.btp / b.vanilla:.3f} |"
            )
    b7 = bytes_per_layer(tokens, 4096, 11008, 1024)
    lines += [
        "",
        "7B beside BOOST.md (GiB per layer): "
        + ", ".join(
            f"{k} {v:.3f} (published ~{PUBLISHED_7B_GB[k]})"
            for k, v in zip(PUBLISHED_7B_GB, (b7.full_rank / gib, b7.vanilla / gib, b7.btp / gib), strict=True)
        ),
    ]
    return "\n".join(lines)
