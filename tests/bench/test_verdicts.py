"""The verdicts printed after a sweep, from records of known times."""

from hpcjobs.bench.sweep import Record
from hpcjobs.bench.verdicts import auto_against_best, ours_against


def rec(size, impl, t):
    return Record(size, size // 4, "float32", "sum", impl, 2, 10, t, 0.0, 0.0, 0)


def test_auto_is_compared_with_the_fastest_of_our_other_algorithms_per_size():
    records = [rec(8, "ring", 14), rec(8, "recursive_doubling", 8), rec(8, "auto", 8.8), rec(8, "mpi", 4),
               rec(32768, "ring", 30), rec(32768, "recursive_doubling", 20), rec(32768, "auto", 22.2),
               rec(32768, "mpi", 1)]
    assert auto_against_best(records) == "within 10% at 1 of 2 sizes; worst 1.11x at 32K (recursive_doubling)"
    assert auto_against_best([r for r in records if r.impl != "ring"]) is None  # one of ours: nothing to pick from


def test_auto_is_what_is_held_against_a_baseline_where_it_ran():
    """The verdict had held the fastest of every row of ours at each size against the baseline: with ten rows
    as fast as MPI and noisy, the luckiest median won, and a tie read as "faster at 22 of 24 sizes"."""
    records = [rec(8, "ring", 4), rec(8, "tree", 3), rec(8, "auto", 8), rec(8, "mpi", 4),
               rec(4096, "ring", 20), rec(4096, "auto", 10.5), rec(4096, "mpi", 10),
               rec(1 << 20, "ring", 10), rec(1 << 20, "auto", 80), rec(1 << 20, "mpi", 120)]
    assert ours_against(records, "mpi") == ("auto", "0.50x at 8, 0.95x at 4K, 1.50x at 1M; faster at 1, slower at 1, "
                                                    "within 10% at 1 of 3 sizes")
    assert ours_against(records, "gloo") is None


def test_without_auto_our_fastest_row_is_held_against_a_baseline_and_said_so():
    records = [rec(8, "ring", 14), rec(8, "tree", 8), rec(8, "mpi", 4), rec(8, "ring+check", 1),
               rec(4096, "ring", 20), rec(4096, "mpi", 10),
               rec(1 << 20, "ring", 100), rec(1 << 20, "ring_pipelined/64K", 80), rec(1 << 20, "mpi", 120),
               rec(1 << 21, "shm", 50), rec(1 << 21, "mpi", 200)]
    # a +check row is not ours; a size missing the baseline is left out
    assert ours_against(records, "mpi") == ("our best", "0.50x at 8, 0.50x at 4K, 1.50x at 1M; faster at 2, "
                                                        "slower at 2, within 10% at 0 of 4 sizes")
    # one row of ours: named; no size of the usual ones: the first and the last
    assert ours_against([rec(16, "ring", 10), rec(16, "mpi", 5), rec(64, "ring", 10), rec(64, "mpi", 30)], "mpi") == \
        ("ring", "0.50x at 16, 3.00x at 64; faster at 1, slower at 1, within 10% at 0 of 2 sizes")
    # one size of no usual kind: said once; hierarchical per segment size is ours
    assert ours_against([rec(3 << 20, "hierarchical/1M", 10), rec(3 << 20, "mpi", 28)], "mpi") == \
        ("hierarchical/1M", "2.80x at 3M; faster at 1, slower at 0, within 10% at 0 of 1 sizes")


def test_a_ratio_within_the_band_is_a_tie_either_way():
    records = [rec(8, "auto", 10), rec(8, "mpi", 10.9), rec(16, "auto", 10), rec(16, "mpi", 9.1),
               rec(32, "auto", 10), rec(32, "mpi", 11.1), rec(64, "auto", 10), rec(64, "mpi", 9.0)]
    assert ours_against(records, "mpi")[1].endswith("faster at 1, slower at 1, within 10% at 2 of 4 sizes")


def test_a_row_with_wrong_results_is_no_best():
    """A row fast and wrong at a size was "our best" there, and the verdict
    counted its win."""
    fast_wrong = Record(8, 2, "float32", "sum", "tree", 2, 10, 1.0, 0.0, 0.0, 5)
    records = [rec(8, "ring", 10), fast_wrong, rec(8, "mpi", 5)]
    assert ours_against(records, "mpi") == ("ring", "0.50x at 8; faster at 0, slower at 1, within 10% at 0 of 1 sizes")
    assert auto_against_best([*records, rec(8, "auto", 10), rec(8, "shm", 20)]) == \
        "within 10% at 1 of 1 sizes; worst 1.00x at 8 (ring)"


def test_a_late_rows_times_are_corrected_by_its_anchors_drift():
    """Horovod's pass ran later: MPI_Allreduce beside it took 2x its first
    pass's time, and the verdict compared Horovod's times as measured."""
    from dataclasses import replace

    from hpcjobs.bench.verdicts import drift_corrected

    records = [rec(8, "ring", 10), replace(rec(8, "horovod", 40), anchor_drift=2.0),
               rec(1 << 20, "ring", 100), replace(rec(1 << 20, "horovod", 90), anchor_drift=1.5)]
    assert ours_against(records, "horovod")[1] == \
        "4.00x at 8, 0.90x at 1M; faster at 1, slower at 1, within 10% at 0 of 2 sizes"
    assert ours_against(drift_corrected(records, "horovod"), "horovod")[1] == \
        "2.00x at 8, 0.60x at 1M; faster at 1, slower at 1, within 10% at 0 of 2 sizes"
    assert drift_corrected(records, "mpi") is None  # no anchor: nothing to correct


def test_a_size_where_auto_was_wrong_is_left_out_not_given_our_best():
    wrong_auto = Record(8, 2, "float32", "sum", "auto", 2, 10, 1.0, 0.0, 0.0, 3)
    records = [rec(8, "ring", 2), rec(8, "tree", 1), wrong_auto, rec(8, "mpi", 4),
               rec(64, "ring", 10), rec(64, "auto", 10), rec(64, "mpi", 5)]
    assert ours_against(records, "mpi") == ("auto", "0.50x at 64; faster at 0, slower at 1, within 10% at 0 of 1 sizes")
