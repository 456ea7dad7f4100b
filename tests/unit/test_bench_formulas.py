"""The analytic communication model of boost-bench against hand-computed cases."""

from __future__ import annotations

from boost_compile.costmodel.formulas import analytic_table, bytes_per_layer, ring_bytes_per_rank


def test_bytes_per_layer_7b_by_hand():
    # 7B, seq 4096 x batch 4 = 16384 tokens, bf16: d 4096, d_ff 11008, r 1024
    b = bytes_per_layer(16384, 4096, 11008, 1024)
    assert b.full_rank == 2 * 16384 * 4096 * 2 == 268_435_456
    assert b.vanilla == 16384 * (5 * 4096 + 2 * 11008) * 2 == 1_392_508_928
    assert b.btp == 16384 * 7 * 1024 * 2 == 234_881_024
    # BOOST.md: ~0.25 / ~1.32 / ~0.22 GB per layer (GiB here)
    assert round(b.full_rank / 2**30, 2) == 0.25 and round(b.btp / 2**30, 2) == 0.22
    assert abs(b.vanilla / 2**30 - 1.32) < 0.03


def test_btp_is_seven_eighths_of_full_rank_at_quarter_rank():
    b = bytes_per_layer(100, 512, 1376, 128, elem=4)
    assert b.btp / b.full_rank == 7 * 128 / (2 * 512) == 0.875


def test_ring_traffic():
    assert ring_bytes_per_rank(1000, 2) == 1000
    assert ring_bytes_per_rank(1000, 4) == 1500
    assert ring_bytes_per_rank(800, 8) == 1400


def test_table_lists_every_shape_and_degree():
    table = analytic_table()
    for name in ("1B", "3B", "7B", "13B"):
        for world in (2, 4, 8):
            assert f"| {name} | {world} |" in table
