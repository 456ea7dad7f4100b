"""``boost-bench``: side-by-side benchmarks, each a table of ratios against named baselines."""

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``boost-bench``; see :mod:`boost_compile.bench.cli`."""
    from boost_compile.bench.cli import main as cli_main

    return cli_main(argv)
