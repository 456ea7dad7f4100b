"""``boost-bench``: side-by-side benchmarks, each a table of ratios against named baselines."""

from boost_compile.costmodel.formulas import (
    PAPER_SHAPES,
    PUBLISHED_7B_GB,
    LayerBytes,
    analytic_table,
    bytes_per_layer,
    ring_bytes_per_rank,
)

__all__ = ["main", "PAPER_SHAPES", "PUBLISHED_7B_GB", "LayerBytes", "analytic_table", "bytes_per_layer", "ring_bytes_per_rank"]


def main(argv: list[str] | None = None) -> int:
    """``boost-bench``; see :mod:`boost_compile.bench.cli`."""
    from boost_compile.bench.cli import main as cli_main

    return cli_main(argv)
