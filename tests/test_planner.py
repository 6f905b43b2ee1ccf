"""The planner (hpcjobs/planner.py, ``hpcjobs plan``): the system model
against its closed forms (the α-β formulas of costs.py, the overlap
schedule worked by hand), the black-box fit, time to a target, the
recommendation, and the command's output and errors."""

import json
import math
import subprocess
import sys

import pytest

from hpcjobs.collectives.costs import (ACROSS, COSTS, across_path, default_segment_bytes, evaluate,
                                      hierarchical_segments)
from hpcjobs.planner import (Linear, Network, Payload, Target, Workload, allreduce_s, bucket_sizes, fit_runs,
                             flat_shapes, iteration, plan, recommend)
from hpcjobs.cli.plan import table
from launch import clean_env, hpcjobs, hpcjobs_here

NODE = Linear(alpha=5e-6, beta=1e-10, gamma=2e-11)  # 10 GB/s inside a node
NET = Linear(alpha=30e-6, beta=8e-10)  # 10 Gbit/s between nodes
MB = 1 << 20


def step(f=1.0, b=2.0, u=0.5, tensors=((MB, 0.5, (MB // 4,)), (MB, 1.0, (MB // 4,))), batch=32):
    return Workload(batch, f, b, u, tensors)


def ring(N, P, c=NODE):
    return evaluate(COSTS["ring"].formula, P=P, N=N, alpha=c.alpha, beta=c.beta, gamma=c.gamma)


def test_without_overlap_a_step_is_compute_plus_every_buckets_allreduce():
    r = iteration(step(), 4, Network(4, NODE), "ring", overlap=False, fusion_bytes=MB)
    assert r["buckets"] == 2
    assert r["iteration_s"] == pytest.approx(3.5 + 2 * ring(MB, 4), rel=1e-12)
    assert r["comm_s"] == pytest.approx(2 * ring(MB, 4), rel=1e-12)


def test_with_overlap_a_bucket_starts_when_ready_and_after_the_one_before():
    # buckets ready at forward + 0.5 and 1.0 of backward; each allreduce costs c
    slow = Linear(alpha=0.0, beta=1.5 / MB)  # c = 2(P-1)/P * MB * beta = 2.25 s at P = 4
    c = ring(MB, 4, slow)
    r = iteration(step(), 4, Network(4, slow), "ring", fusion_bytes=MB)
    first = 1.0 + 1.0 + c  # starts at 2.0
    second = max(first, 3.0) + c  # backward ends at 3.0; the first bucket is still going
    assert r["iteration_s"] == pytest.approx(max(3.0, second) + 0.5, rel=1e-12)
    assert r["exposed_s"] == pytest.approx(r["iteration_s"] - 3.5, rel=1e-12)
    fused = iteration(step(), 4, Network(4, slow), "ring", fusion_bytes=2 * MB)  # one bucket, ready at the end
    assert fused["buckets"] == 1
    assert fused["iteration_s"] == pytest.approx(3.0 + ring(2 * MB, 4, slow) + 0.5, rel=1e-12)


def test_fast_links_hide_behind_backward_and_one_device_sends_nothing():
    r = iteration(step(), 4, Network(4, NODE), "ring", fusion_bytes=MB)
    assert r["iteration_s"] == pytest.approx(3.5 + ring(MB, 4), rel=1e-12)  # only the last bucket shows
    one = iteration(step(), 1, Network(4, NODE))
    assert one["iteration_s"] == 3.5 and one["comm_s"] == 0 and one["algorithm"] == "none"


def test_across_nodes_the_two_level_formula_is_used():
    N, P, L = 8 * MB, 16, 4
    t, name = allreduce_s(N, P, Network(L, NODE, NET), "hierarchical")
    want = evaluate(ACROSS["hierarchical"].formula, P=P, L=L, N=N, alpha=NODE.alpha, beta=NODE.beta,
                    gamma=NODE.gamma, net_alpha=NET.alpha, net_beta=NET.beta)
    assert across_path("hierarchical", N, P, L, NODE, NET) == pytest.approx(want, rel=1e-12)  # in one piece
    assert name == "hierarchical" and t == pytest.approx(across_path("hierarchical", N, P, L, NODE, NET, 2),
                                                         rel=1e-12)  # pipelined: 2 segments of 256 KiB x 4 x 4
    t_ring, _ = allreduce_s(N, P, Network(L, NODE, NET), "ring")
    assert t_ring == pytest.approx(evaluate(ACROSS["ring"].formula, P=P, L=L, N=N, gamma=NODE.gamma,
                                            net_alpha=NET.alpha, net_beta=NET.beta), rel=1e-12)
    each = {a: allreduce_s(N, P, Network(L, NODE, NET), a)[0]
            for a in ("hierarchical", "ring", "recursive_doubling", "rabenseifner")}
    best, chosen = allreduce_s(N, P, Network(L, NODE, NET))
    assert best == min(each.values()) and each[chosen] == best
    # Rabenseifner, halving near first, sends hierarchical's bytes across in
    # 2log2(M) network rounds instead of 2(M-1): cheaper than hierarchical in
    # 8 segments of 1 MiB (8 x 2(M-1) network latencies), dearer than in the
    # 2 segments of 4 MiB it runs at 4 x 4.
    assert chosen == "hierarchical" and t < each["rabenseifner"] < across_path("hierarchical", N, P, L, NODE, NET, 8)


def test_hierarchical_across_nodes_is_costed_pipelined_as_it_runs():
    """Across real nodes hierarchical pipelines a buffer in segments of
    1/32 of it, at least 256 KiB per ring step across the nodes (256 KiB x
    L x M; hierarchical.py): the planner costs it so, and a small bucket in
    one piece."""
    net = Network(4, NODE, NET)  # 16 devices: 4 nodes of 4, segments of at least 4 MiB
    for N, segments in ((16 * MB, 4), (64 * MB, 16), (128 * MB, 32), (256 * MB, 32), (MB // 2, 1)):
        assert hierarchical_segments(N, 4, 4) == segments
        t, _ = allreduce_s(N, 16, net, "hierarchical")
        assert t == pytest.approx(across_path("hierarchical", N, 16, 4, NODE, NET, segments), rel=1e-12)
    # The floor follows the layout: 1 MiB at 2 x 2 (as measured on the emulated cluster), 64 MiB at 8 x 32,
    # where a 25 MB bucket goes in one piece (1 MiB segments would pay 62 latencies for 4 KiB steps)
    assert [hierarchical_segments(16 * MB, 2, 2), hierarchical_segments(25e6, 8, 32)] == [16, 1]
    assert default_segment_bytes(0, 2, 2) == MB and default_segment_bytes(0, 8, 32) == 64 * MB


def test_the_cheapest_is_the_most_efficient_within_reach_not_the_fewest_devices():
    """Without a time to target, device-hours per sample are 1 / efficiency:
    of the counts within 10% of the fastest, the most efficient, which need
    not be the fewest (a fold makes 15 devices less efficient than 16)."""
    rows = [{"devices": 15, "samples_per_s": 95.0, "efficiency": 0.95},
            {"devices": 16, "samples_per_s": 100.0, "efficiency": 0.97},
            {"devices": 14, "samples_per_s": 85.0, "efficiency": 0.99}]  # 85 < 100 / 1.1: out of reach
    assert recommend(rows) == {"fastest": 16, "cheapest_within": 0.1, "cheapest": 16, "by": "samples/s"}
    rows[0]["efficiency"] = 0.97  # a tie goes to fewer devices
    assert recommend(rows)["cheapest"] == 15


def test_auto_names_the_algorithm_that_carried_the_most_bytes():
    """``auto`` costs each bucket with its cheapest formula, so a step can use
    two: big buckets bandwidth-bound, a small last one latency-bound. The row
    names the one that carried most of the gradient, with every algorithm's
    bytes beside it, not whichever the last bucket took."""
    tensors = ((4 * MB, 0.5, (MB,)), (4 * MB, 0.9, (MB,)), (1024, 1.0, (256,)))  # the last one small
    net = Network(1, NODE, NET)
    r = iteration(step(tensors=tensors), 16, net, "auto", fusion_bytes=MB)
    picks = [allreduce_s(n, 16, net)[1] for n, _, _ in bucket_sizes(step(tensors=tensors), MB)]
    assert picks[0] == picks[1] != picks[2]  # the test is only worth having where they differ
    assert r["algorithm"] == picks[0]
    assert r["algorithms"] == {picks[0]: 8 * MB, picks[2]: 1024}
    assert f" {picks[0]}+{picks[2]} |" in table(plan(step(tensors=tensors), [16], net, fusion_bytes=MB))
    one = iteration(step(tensors=tensors), 16, net, "ring", fusion_bytes=MB)
    assert one["algorithm"] == "ring" and one["algorithms"] == {"ring": 8 * MB + 1024}


@pytest.mark.parametrize("P,net,algorithm,words", [
    (6, Network(4, NODE, NET), "ring", "do not fill nodes"),
    (8, Network(4, NODE), "ring", "no network between nodes"),
    (4, Network(4, NODE), "bogus", "unknown algorithm"),
    (12, Network(4, NODE, NET), "recursive_doubling", "no two-level formula"),
])
def test_layouts_without_a_formula_are_refused_with_the_reason(P, net, algorithm, words):
    with pytest.raises(ValueError, match=words):
        allreduce_s(MB, P, net, algorithm)


def test_buckets_close_as_the_optimizer_closes_them():
    w = Workload.from_throughput([(100,), (300,), (50,)], throughput=10.0, batch=10)
    assert [b[0] for b in bucket_sizes(w, 1600)] == [1600, 200]  # 400 + 1200 reaches 1600; the rest
    assert [b[1] for b in bucket_sizes(w, 1600)] == pytest.approx([1600 / 1800, 1.0])
    assert [b[0] for b in bucket_sizes(w, 1, fused=False)] == [400, 1200, 200]
    assert w.step_s == pytest.approx(1.0) and w.backward_s == pytest.approx(2 / 3)
    assert sum(s[0] for s in flat_shapes(1_000_001, chunk=1000)) == 1_000_001


def test_a_summable_compressor_reduces_its_payload_and_the_others_gather_it():
    w = step(tensors=((MB, 1.0, (MB // 4,)),))
    half = iteration(w, 4, Network(4, NODE), "ring", overlap=False, fusion_bytes=MB,
                     payload=Payload(lambda n, shape: n // 2, True, True))
    assert half["comm_s"] == pytest.approx(ring(MB // 2, 4), rel=1e-12)
    # parts reduced one after another (PowerSGD's P, then Q): each pays the ring's latencies; it had been costed
    # as one allreduce of their sum
    two = iteration(w, 4, Network(4, NODE), "ring", overlap=False, fusion_bytes=MB,
                    payload=Payload(lambda n, shape: (n // 4, n // 4), True, False))
    assert two["comm_s"] == pytest.approx(2 * ring(MB // 4, 4), rel=1e-12)
    assert two["comm_s"] - ring(MB // 2, 4) == pytest.approx(6 * NODE.alpha, rel=1e-9)  # 2(P - 1) more
    gathered = iteration(w, 4, Network(4, NODE), "ring", overlap=False, fusion_bytes=MB,
                         payload=Payload(lambda n, shape: 1000, False, False, parts=2))
    # P - 1 rows of the size table (8 bytes a part), then P - 1 payloads (ring.allgatherv)
    assert gathered["comm_s"] == pytest.approx(3 * (2 * NODE.alpha + (16 + 1000) * NODE.beta), rel=1e-12)
    assert gathered["algorithm"] == "allgather"
    # a measured codec time per bucket, and the payload's own cost per byte reduced
    slow = iteration(w, 4, Network(4, NODE), "ring", overlap=False, fusion_bytes=MB,
                     payload=Payload(lambda n, shape: n // 2, True, True, lambda n, shape, P: 0.25, 5e-9))
    want = evaluate(COSTS["ring"].formula, P=4, N=MB // 2, alpha=NODE.alpha, beta=NODE.beta, gamma=5e-9)
    assert slow["comm_s"] == pytest.approx(want + 0.25, rel=1e-12)


def test_a_gathered_payload_is_decoded_once_per_device_and_a_summed_one_once():
    """compressed_allreduce decompresses and adds every device's payload when
    it gathers them (top-k, QSGD, sign): the measured codec grows by one
    decompress and one add a device. A summable payload (fp16, PowerSGD's
    factors) is decoded once, whatever P. The payload's arrays are counted
    for the size table the allgather sends first."""
    from hpcjobs.cli.plan import _payload

    gathered, summed = _payload("topk:0.01", True, None), _payload("fp16", True, None)
    assert gathered.parts == 2 and not gathered.summable and summed.parts == 1
    n, shape = 4 * 65536, (65536,)
    c2, c3, c4 = (gathered.codec_s(n, shape, P) for P in (2, 3, 4))
    assert c4 - c3 == pytest.approx(c3 - c2, rel=1e-9) and c3 > c2 > 0
    assert summed.codec_s(n, shape, 2) == summed.codec_s(n, shape, 64) > 0


def test_the_black_box_fit_recovers_its_terms_and_stays_non_negative():
    truth = (0.2, 0.05, 0.001)
    runs = [(p, truth[0] + truth[1] * 2 * (p - 1) / p + truth[2] * (p - 1)) for p in (1, 2, 4, 8)]
    theta, predict = fit_runs(runs)
    assert theta == pytest.approx(list(truth), rel=1e-9)
    assert predict(16) == pytest.approx(truth[0] + truth[1] * 30 / 16 + truth[2] * 15, rel=1e-9)
    theta, predict = fit_runs([(1, 0.2), (2, 0.3)])  # two counts: two terms
    assert theta == pytest.approx([0.2, 0.1, 0.0]) and predict(4) == pytest.approx(0.2 + 0.1 * 1.5)
    theta, _ = fit_runs([(1, 0.3), (2, 0.2)])  # faster at 2 would need a negative term: clamped
    assert min(theta) >= 0
    with pytest.raises(ValueError, match="devices >= 1"):
        fit_runs([])


def test_time_to_target_scales_epochs_by_the_noise_scale_and_recommends():
    w = step()  # 32 samples in 3.5 s on one device
    target = Target(loss=0.5, epochs=10.0, low=9.0, high=11.0, base_batch=32, samples_per_epoch=3200,
                    noise_scale=64.0)
    rows = plan(w, [1, 2, 4], Network(4, NODE), "ring", fusion_bytes=MB, target=target)
    for r in rows:
        factor = (1 + 32 * r["devices"] / 64) / (1 + 32 / 64)
        assert r["epochs"] == pytest.approx(10 * factor) and r["epochs_low"] == pytest.approx(9 * factor)
        assert r["time_to_target_s"] == pytest.approx(r["epochs"] * 3200 / r["samples_per_s"])
        assert r["device_hours"] == pytest.approx(r["time_to_target_s"] * r["devices"] / 3600)
    assert rows[0]["efficiency"] == 1.0
    best = recommend(rows)
    fastest = min(rows, key=lambda r: r["time_to_target_s"])
    assert best["fastest"] == fastest["devices"] and best["by"] == "time to target"
    near = [r for r in rows if r["time_to_target_s"] <= 1.1 * fastest["time_to_target_s"]]
    assert best["cheapest"] == min(near, key=lambda r: r["device_hours"])["devices"]
    no_target = recommend([{"devices": d, "samples_per_s": s, "efficiency": s / (100.0 * d)}
                           for d, s in ((1, 100.0), (2, 195.0), (4, 210.0))])
    assert no_target == {"fastest": 4, "cheapest_within": 0.1, "cheapest": 2, "by": "samples/s"}


def test_plan_prints_the_table_and_writes_the_json_rows(tmp_path):
    out = tmp_path / "plan.json"
    r = hpcjobs("plan", "--params", "25.6M", "--throughput", "400", "--batch-per-device", "64",
                "--devices-per-node", "8", "--intra-bw", "100", "--inter-bw", "100", "--devices", "1,8,16-32",
                "--algorithm", "ring", "--fusion-bytes", "64M", "--json", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert [row["devices"] for row in data["rows"]] == [1, 8, 16, 24, 32]
    w = Workload.from_throughput(flat_shapes(25_600_000), 400.0, 64)
    for row in data["rows"]:
        want = iteration(w, row["devices"], Network(8, Linear(5e-6, 1e-11), Linear(20e-6, 8e-11)), "ring",
                         fusion_bytes=64 << 20)
        assert row["iteration_s"] == pytest.approx(want["iteration_s"], rel=1e-9)
        assert row["efficiency"] == pytest.approx(64 / want["iteration_s"] / 400, rel=1e-9)
        assert row["samples_per_s"] == pytest.approx(row["devices"] * 64 / want["iteration_s"], rel=1e-9)
    assert "| devices |" in r.stdout and "# fastest:" in r.stdout
    assert data["recommendation"]["fastest"] in (1, 8, 16, 24, 32)


def test_plan_predicts_time_to_target_from_a_metrics_file(tmp_path):
    metrics = tmp_path / "run.jsonl"
    b0, b1, b2 = 0.5, 1.0, 0.1  # Optimus's curve: loss 0.2 at (1/0.1 - 1)/0.5 = 18 epochs
    metrics.write_text("".join(json.dumps({"epoch": k, "step": 10 * k, "global_batch": 64, "noise_scale": 128.0,
                                           "loss": 1 / (b0 * k + b1) + b2}) + "\n" for k in range(1, 9)))
    out = tmp_path / "plan.json"
    r = hpcjobs("plan", "--params", "1M", "--throughput", "640", "--batch-per-device", "64", "--devices", "1,2",
                "--intra-bw", "10", "--devices-per-node", "2", "--metrics", str(metrics), "--target-loss", "0.2",
                "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["epochs"] == pytest.approx(18, rel=2e-3)
    assert rows[1]["epochs"] == pytest.approx(18 * (1 + 128 / 128) / (1 + 64 / 128), rel=2e-3)
    assert rows[0]["time_to_target_s"] == pytest.approx(rows[0]["epochs"] * 640 / 640, rel=1e-9)
    target = json.loads(out.read_text())["target"]  # what the rows were scaled from
    assert target["epochs"] == pytest.approx(18, rel=2e-3) and target["low"] <= target["epochs"] <= target["high"]
    assert (target["loss"], target["base_batch"], target["samples_per_epoch"], target["noise_scale"], target["fit"],
            target["metrics"]) == (0.2, 64, 640, 128.0, "optimus", str(metrics))


def test_plan_json_is_strict_json_with_every_rows_keys_in_every_plan(tmp_path):
    """A curve whose interval has no upper end (a left-out fit that never reaches the target) wrote
    "high": Infinity, which jq and strict parsers refuse; and the rows' device_hours, time_to_target_s and
    fit_iteration_s were there only in plans with a target or runs: a tool reading them got a KeyError."""
    metrics = tmp_path / "run.jsonl"  # (found by the planner's interface review: a noisy Optimus curve)
    losses = [0.76795, 0.609556, 0.500812, 0.432755, 0.390645, 0.350795, 0.325858, 0.298538]
    metrics.write_text("".join(json.dumps({"epoch": k, "step": 100 * k, "global_batch": 128, "loss": loss}) + "\n"
                               for k, loss in enumerate(losses, 1)))
    out, plain = tmp_path / "plan.json", tmp_path / "plain.json"
    r = hpcjobs("plan", "--params", "10M", "--throughput", "200", "--devices-per-node", "4", "--intra-bw", "10",
                "--devices", "1,2,4", "--metrics", str(metrics), "--target-loss", "0.11", "--json", str(out))
    assert r.returncode == 0 and ", inf]" in r.stdout, r.stdout + r.stderr  # the interval printed
    def strict(c):
        raise ValueError(f"not JSON: {c}")
    data = json.loads(out.read_text(), parse_constant=strict)
    assert data["target"]["high"] is None and data["target"]["epochs"] > 1
    r = hpcjobs("plan", "--params", "10M", "--throughput", "200", "--devices-per-node", "4", "--intra-bw", "10",
                "--devices", "1,2,4", "--json", str(plain))
    assert r.returncode == 0, r.stderr
    rows = json.loads(plain.read_text(), parse_constant=strict)["rows"]
    keys = ("fit_iteration_s", "epochs", "epochs_low", "epochs_high", "time_to_target_s", "device_hours")
    assert all(row[k] is None for row in rows for k in keys) and rows[0]["efficiency"] == 1.0
    assert all(set(row) == set(rows_t) for row, rows_t in zip(rows, data["rows"]))


def test_plan_fits_the_power_law_when_asked(tmp_path):
    metrics = tmp_path / "run.jsonl"
    a, alpha, b = 2.0, 1.5, 1.0  # loss 0.05 at (2/0.05)^(1/1.5) - 1 = 10.696 epochs; epoch 1 is left out
    metrics.write_text("".join(json.dumps({"epoch": k, "step": 10 * k, "global_batch": 64,
                                           "loss": 9.0 if k == 1 else a * (k + b) ** -alpha}) + "\n"
                               for k in range(1, 7)))
    out = tmp_path / "plan.json"
    r = hpcjobs("plan", "--params", "1M", "--throughput", "640", "--batch-per-device", "64", "--devices", "1",
                "--metrics", str(metrics), "--target-loss", "0.05", "--loss-model", "power", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "(power-law fit of" in r.stdout
    assert json.loads(out.read_text())["rows"][0]["epochs"] == pytest.approx((a / 0.05) ** (1 / alpha) - b, rel=1e-6)


def test_plan_measures_one_of_our_models_here(tmp_path):
    out = tmp_path / "plan.json"
    r = hpcjobs("plan", "--model", "mlp", "--width", "64", "--measure", "--measure-steps", "2",
                "--batch-per-device", "8", "--devices", "1,2", "--threads", "1", "--inter-bw", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["efficiency"] == 1.0 and rows[1]["devices"] == 2
    # mlp 40 -> 64 -> 64 -> 10: every parameter's gradient is counted once
    assert "measured" in r.stdout and f"{40 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10} parameters" in r.stdout
    fp16 = hpcjobs("plan", "--model", "mlp", "--width", "64", "--measure", "--measure-steps", "2",
                   "--batch-per-device", "8", "--devices", "1,2", "--threads", "1", "--inter-bw", "1",
                   "--algorithm", "ring", "--compression", "fp16", "--json", str(out))
    assert fp16.returncode == 0, fp16.stderr
    # the ring of half the bytes on a 1 Gbit/s link (one bucket: 2(P-1)·(A + N/P·B) at P = 2), plus a measured
    # codec and reduction time above nothing ("auto" would cost recursive doubling's one exchange)
    params = 40 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10
    wire = 2 * (20e-6 + 2 * params / 2 * 8e-9)
    assert wire < json.loads(out.read_text())["rows"][1]["comm_s"] < wire + 1.0
    # bfloat16's reduction is timed on its bits, as ours reduce it (numpy has no bfloat16: it was a traceback)
    bf16 = hpcjobs("plan", "--model", "mlp", "--width", "64", "--measure", "--measure-steps", "2",
                   "--batch-per-device", "8", "--devices", "1,2", "--threads", "1", "--inter-bw", "1",
                   "--algorithm", "ring", "--compression", "bf16", "--json", str(out))
    assert bf16.returncode == 0, bf16.stderr
    assert wire < json.loads(out.read_text())["rows"][1]["comm_s"] < wire + 1.0


def test_plan_compression_none_is_train_spelling_of_no_compression(tmp_path):
    """`train --compression none` is a run without compression: plan takes the same flag to mean the same."""
    rows = {}
    for extra in ([], ["--compression", "none"]):
        out = tmp_path / f"plan{len(extra)}.json"
        r = hpcjobs("plan", "--params", "25M", "--throughput", "100", "--devices", "1,2,4", "--inter-bw", "10",
                    *extra, "--json", str(out))
        assert r.returncode == 0, r.stderr
        rows[len(extra)] = json.loads(out.read_text())["rows"]
    assert rows[0] == rows[2] and rows[0][2]["comm_s"] > 0


def test_an_algorithm_a_gathered_payload_never_runs_is_not_checked_against_the_layout():
    """tree has no two-level formula, so plan refuses it across nodes; with
    top-k, which gathers, it was refused too, though nothing runs it."""
    flags = ["--params", "25M", "--throughput", "400", "--devices", "4,8", "--devices-per-node", "2", "--intra-bw",
             "100", "--inter-bw", "10", "--algorithm", "tree"]
    r = hpcjobs("plan", *flags, "--compression", "topk:0.01")
    assert r.returncode == 0 and "| allgather |" in r.stdout, r.stderr
    # said, not silent: the rows cost no tree
    assert "--compression topk:0.01 sends through an allgather: --algorithm tree is not used" in r.stderr
    r = hpcjobs("plan", *flags)
    assert r.returncode == 2 and "tree has no two-level formula for 4 devices" in r.stderr, r.stderr


def _run(path, ranks, epochs):
    """A train --metrics file: (epoch_s, wait_s) per epoch, 10 steps each."""
    path.write_text("".join(json.dumps({"epoch": k, "step": 10 * k, "ranks": ranks, "epoch_s": e, "wait_s": w,
                                        "comm_s": w}) + "\n" for k, (e, w) in enumerate(epochs, 1)))
    return str(path)


def test_runs_at_another_batch_per_device_are_refused(tmp_path):
    """A run's step at 256 samples a device was fitted and held against a plan at --batch-per-device 64 without
    a word (the planner interface review): the steps are another batch's. Refused, for --runs and --against
    alike; a run that does not write global_batch is taken as the plan's."""
    runs = []
    for ranks in (1, 2):
        path = tmp_path / f"r{ranks}.jsonl"
        path.write_text("".join(json.dumps({"epoch": k, "step": 10 * k, "ranks": ranks, "epoch_s": 1.0,
                                            "global_batch": 256 * ranks}) + "\n" for k in (1, 2, 3)))
        runs.append(str(path))
    for flag, value in (("--runs", ",".join(runs)), ("--against", runs[1])):
        r = hpcjobs("plan", "--params", "1M", "--throughput", "100", "--batch-per-device", "64", "--devices", "1,2",
                    "--inter-bw", "10", flag, value)
        assert r.returncode == 2 and f"{runs[1] if flag == '--against' else runs[0]}: a run of 256 samples per " \
            f"device a step (global_batch {256 * (2 if flag == '--against' else 1)} on" in r.stderr, r.stderr
        assert "this plan's --batch-per-device is 64" in r.stderr and "Traceback" not in r.stderr
        r = hpcjobs("plan", "--params", "1M", "--throughput", "100", "--batch-per-device", "256", "--devices", "1,2",
                    "--inter-bw", "10", flag, value)
        assert r.returncode == 0, r.stderr
    for gb in ("256", None, True):  # not a number: said, not a TypeError's traceback
        (tmp_path / "bad.jsonl").write_text(json.dumps({"epoch": 1, "step": 10, "ranks": 1, "epoch_s": 1.0,
                                                        "global_batch": gb}) + "\n")
        r = hpcjobs("plan", "--params", "1M", "--throughput", "100", "--devices", "1", "--against",
                    str(tmp_path / "bad.jsonl"))
        assert r.returncode == 2 and f"the line of epoch 1: global_batch must be a positive number, not {gb!r}" \
            in r.stderr and "Traceback" not in r.stderr, r.stderr
    (tmp_path / "none.jsonl").write_text(json.dumps({"epoch": 1, "step": 10, "ranks": 1, "epoch_s": 1.0}) + "\n")
    r = hpcjobs("plan", "--params", "1M", "--throughput", "100", "--devices", "1", "--against",
                str(tmp_path / "none.jsonl"))
    assert r.returncode == 0, r.stderr  # no global_batch written: taken as the plan's


def test_plan_holds_its_rows_against_measured_runs(tmp_path):
    """--against: each run's median step from epoch 2 on, beside the planned row of its device count, split into
    the time waited for reductions and the rest."""
    p1 = _run(tmp_path / "p1.jsonl", 1, [(9.0, 0.0), (1.0, 0.0), (1.2, 0.0), (1.1, 0.0)])
    p2 = _run(tmp_path / "p2.jsonl", 2, [(9.0, 5.0), (2.0, 1.0), (3.0, 2.2), (2.4, 1.6)])
    p4 = _run(tmp_path / "p4.jsonl", 4, [(3.0, 1.8), (5.0, 3.5)])
    out = tmp_path / "plan.json"
    r = hpcjobs("plan", "--params", "25M", "--throughput", "100", "--batch-per-device", "32", "--devices", "1,2,4",
                "--inter-bw", "10", "--runs", f"{p1},{p2}", "--against", f"{p2},{p4}", "--json", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    rows = {row["devices"]: row for row in data["rows"]}
    got = {c["devices"]: c for c in data["against"]}
    for P, step, waited in [(2, 0.24, 0.16), (4, 0.5, 0.35)]:  # medians of epoch_s / 10 over epochs 2 on
        c, row = got[P], rows[P]
        assert c["measured_s"] == pytest.approx(step) and c["waited_s"] == pytest.approx(waited)
        assert c["rest_s"] == pytest.approx(step - waited)
        assert c["predicted_s"] == row["iteration_s"] and c["error"] == pytest.approx(row["iteration_s"] / step - 1)
        assert c["exposed_s"] == row["exposed_s"] and c["compute_s"] == row["compute_s"] == pytest.approx(0.32)
        assert c["fit_error"] == pytest.approx(row["fit_iteration_s"] / step - 1)
    assert got[2]["fit_s"] == pytest.approx(0.24)  # the fit goes through its own runs
    assert "| devices |" in r.stdout and f"{(rows[4]['iteration_s'] / 0.5 - 1):+.1%}" in r.stdout


def test_a_metrics_file_appended_to_is_held_against_its_last_run(tmp_path):
    """train appends to --metrics: a 4-rank run, then a 2-rank one. The
    file's step was the median over both runs' epochs, filed under the first
    line's 4 devices."""
    p2 = tmp_path / "p2.jsonl"
    _run(tmp_path / "four.jsonl", 4, [(9.0, 4.0), (5.0, 3.0), (5.0, 3.0), (5.0, 3.0)])
    _run(tmp_path / "two.jsonl", 2, [(9.0, 5.0), (2.0, 1.0), (3.0, 2.2), (2.4, 1.6)])
    p2.write_text((tmp_path / "four.jsonl").read_text() + (tmp_path / "two.jsonl").read_text())
    out = tmp_path / "plan.json"
    r = hpcjobs("plan", "--params", "25M", "--throughput", "100", "--batch-per-device", "32", "--devices", "1,2,4",
                "--inter-bw", "10", "--against", str(p2), "--json", str(out))
    assert r.returncode == 0, r.stderr
    (c,) = json.loads(out.read_text())["against"]
    assert c["devices"] == 2 and c["measured_s"] == pytest.approx(0.24) and c["waited_s"] == pytest.approx(0.16)
    assert c["fit_s"] is None and c["fit_error"] is None  # no --runs: null, the keys there in every plan
    (tmp_path / "one.jsonl").write_text(p2.read_text().replace('"epoch": 1,', '"epoch": 0.5,'))  # one run of 8 lines
    r = hpcjobs("plan", "--params", "25M", "--throughput", "100", "--devices", "1,2,4", "--inter-bw", "10",
                "--against", str(tmp_path / "one.jsonl"))
    assert r.returncode == 2 and "its last run's ranks change (4, 4, 4, 4, 2, 2, 2, 2)" in r.stderr, r.stderr


@pytest.mark.parametrize("field,value,words", [
    ("step", '"100"', "the line of epoch 2: step must be a positive number, not '100'"),
    ("wait_s", "-1", "the line of epoch 2: wait_s must be a number >= 0, not -1"),
    ("ranks", "2.5", "the line of epoch 2: ranks must be a positive whole number, not 2.5"),
    ("epoch_s", "0", "the line of epoch 2: epoch_s must be a positive number, not 0"),
])
def test_a_runs_line_without_its_numbers_is_refused_naming_it(tmp_path, field, value, words):
    path = tmp_path / "p2.jsonl"
    lines = _run(path, 2, [(9.0, 5.0), (2.0, 1.0), (3.0, 2.2)]) and path.read_text().splitlines()
    record = json.loads(lines[1])
    record[field] = json.loads(value)
    path.write_text("\n".join([lines[0], json.dumps(record), lines[2]]) + "\n")
    for flag in ("--runs", "--against"):
        r = hpcjobs("plan", "--params", "1M", "--throughput", "10", "--devices", "1,2", "--inter-bw", "1", flag,
                    str(path))
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_plan_says_which_counts_it_left_out_and_refuses_runs_that_are_not_its_kind(tmp_path):
    """A range's counts that are not whole nodes were dropped without a word
    (the JSON's inputs still listed them, and --against a run on one said to
    add it); --runs at one device count printed a constant 'fit' (perfect
    scaling); an async run's metrics were held against the synchronous
    prediction, and as --metrics got advice about its fit, not its mode."""
    out = tmp_path / "plan.json"
    r = hpcjobs("plan", "--params", "1M", "--throughput", "10", "--devices", "1-10", "--devices-per-node", "3",
                "--intra-bw", "10", "--inter-bw", "10", "--json", str(out))
    assert r.returncode == 0 and "# plan: --devices: left out 4, 5, 7, 8, 10 (not whole nodes of 3)" in r.stderr
    data = json.loads(out.read_text())
    assert data["inputs"]["devices"] == [1, 2, 3, 6, 9] == [row["devices"] for row in data["rows"]]
    p2, q2 = _run(tmp_path / "p2.jsonl", 2, [(9.0, 5.0), (2.0, 1.0)]), _run(tmp_path / "q2.jsonl", 2, [(2.0, 1.0)])
    r = hpcjobs("plan", "--params", "1M", "--throughput", "10", "--devices", "1,2", "--inter-bw", "1", "--runs",
                f"{p2},{q2}")
    assert r.returncode == 2 and "--runs: the black-box fit needs runs on two device counts at least, got [2]" \
        in r.stderr, r.stderr
    lines = [dict(json.loads(line), mode="local", loss=2.0 / k, global_batch=64)
             for k, line in enumerate(open(p2).read().splitlines(), 1)]
    (tmp_path / "local.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines * 3))
    for flag in ("--against", "--runs", "--metrics"):
        extra = ["--target-loss", "0.5"] if flag == "--metrics" else []
        r = hpcjobs("plan", "--params", "1M", "--throughput", "10", "--devices", "1,2", "--inter-bw", "1", flag,
                    str(tmp_path / "local.jsonl"), *extra)
        assert r.returncode == 2 and "a run of --mode local; plan predicts synchronous training" in r.stderr, \
            (flag, r.stderr)


def test_plan_refuses_a_run_it_does_not_plan_for_or_cannot_read(tmp_path):
    p3 = _run(tmp_path / "p3.jsonl", 3, [(1.0, 0.5), (1.0, 0.5)])
    r = hpcjobs("plan", "--params", "1M", "--throughput", "10", "--devices", "1,2", "--inter-bw", "1",
                "--against", p3)
    assert r.returncode == 2 and "a run on 3 devices" in r.stderr and "add 3 to --devices" in r.stderr, r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"epoch": 1}\nnot json\n')
    for flag in ("--runs", "--against"):
        r = hpcjobs("plan", "--params", "1M", "--throughput", "10", "--devices", "1", flag, str(bad))
        assert r.returncode == 2 and "not JSON lines" in r.stderr and "Traceback" not in r.stderr, r.stderr
    for text in ('{"epoch": 1, "step": 10}\n', "[1, 2]\n"):
        bad.write_text(text)
        r = hpcjobs("plan", "--params", "1M", "--throughput", "10", "--devices", "1", "--against", str(bad))
        assert r.returncode == 2 and "not a train --metrics file" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,words", [
    (["--params", "1M", "--throughput", "10", "--devices-per-node", "4"], "--intra-bw"),
    (["--params", "1M", "--measure"], "give --model"),
    (["--params", "1M", "--throughput", "10", "--devices", "0-4"], "expected counts"),
    (["--params", "1M", "--throughput", "10", "--devices", "1-"], "expected counts"),  # was the count 1 alone
    (["--params", "1M", "--throughput", "10", "--devices", "1,12-"], "expected counts"),
    (["--params", "1M", "--throughput", "10", "--inter-latency", "5"], "no network is given: give --inter-bw"),
    (["--params", "lots", "--throughput", "10"], "parameter count"),
    (["--params", "1M", "--throughput", "10", "--devices", "1,2"], "no network between nodes"),
    # flags that would be ignored, and counts that leave nothing to plan
    (["--params", "1M", "--throughput", "10", "--devices", "1,2", "--intra-bw", "1"], "--devices-per-node is 1"),
    (["--params", "1M", "--throughput", "10", "--noise-scale", "100"], "give --metrics and --target-loss"),
    (["--model", "mlp", "--measure", "--backward-share", "0.5"], "--backward-share would be ignored"),
    (["--params", "1M", "--throughput", "10", "--devices", "9-15", "--devices-per-node", "8", "--intra-bw", "1",
      "--inter-bw", "1"], "no count fills whole nodes of 8"),
    (["--params", "1M", "--throughput", "10", "--devices", "1,2", "--inter-bw", "1", "--compression", "powersgd:4"],
     "give --model"),
    (["--params", "1M", "--throughput", "10", "--target-loss", "0.1"], "go together"),
    (["--params", "1M", "--throughput", "10", "--loss-model", "power"], "give --metrics and --target-loss"),
    (["--params", "1M", "--throughput", "10", "--cost-model", "/nonexistent.json"], "--cost-model"),
    (["--params", "1M", "--throughput", "10", "--json", "/dev/null/plan.json"], "cannot create the directory"),
    (["--params", "1M", "--throughput", "10", "--json", "/tmp"], "is a directory"),
    # no file can be made in /proc, even by root, whom permissions do not stop: it failed with a traceback
    # after the plan was printed
    (["--params", "1M", "--throughput", "10", "--json", "/proc/plan.json"],
     "--json /proc/plan.json: cannot write a file in the directory /proc"),
    (["--params", "1M", "--throughput", "10", "--devices", "1", "--runs", "/nonexistent.jsonl"], "cannot read it"),
    (["--params", "1M", "--throughput", "10", "--amp", "bf16"], "give --model and --measure"),
    (["--model", "mlp", "--throughput", "10", "--device", "cuda"], "give --model and --measure"),
    (["--model", "mlp", "--measure", "--amp", "fp16", "--devices", "1"], "--amp fp16 is for GPUs"),
    (["--model", "mlp", "--measure", "--device", "cuda", "--compression", "fp16"], "codec on the CPU"),
    # taken and ignored before 2026-11-30
    (["--params", "1M", "--throughput", "10", "--width", "64"], "--width shapes one of our models"),
    (["--model", "resnet18", "--throughput", "10", "--width", "64"], "--width shapes mlp and cnn1d, not resnet18"),
    (["--model", "mlp", "--throughput", "10", "--image-size", "32"], "--image-size shapes the ResNets, not mlp"),
    (["--model", "resnet18", "--throughput", "10", "--image-size", "512"], "--image-size sets the images --measure"),
    (["--params", "1M", "--throughput", "10", "--threads", "2", "--measure-steps", "3"],
     "--threads, --measure-steps say how --measure times the step"),
    # a format matplotlib cannot write failed after the plan, with a traceback; no extension wrote PATH.png
    (["--params", "1M", "--throughput", "10", "--devices", "1", "--plot", "/tmp/plan.xyz"],
     "--plot /tmp/plan.xyz: name a file matplotlib writes"),
])
def test_plan_refuses_bad_input_with_the_rule(args, words):
    # a login-node command: main in this process, no Python of its own
    r = hpcjobs_here("plan", *args)
    assert r.returncode == 2 and words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_measuring_on_a_gpu_that_is_not_there_is_refused():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: tests/gpu/test_profile.py measures on it")
    r = hpcjobs("plan", "--model", "mlp", "--measure", "--device", "cuda", "--devices", "1")
    assert r.returncode == 2 and "--device cuda: no CUDA GPU is visible" in r.stderr and "Traceback" not in r.stderr


def test_the_cost_model_of_hpcjobs_model_costs_both_links(tmp_path):
    from hpcjobs.machine import Machine

    sizes = [1024, MB // 2, MB, 16 * MB]  # the sizes costed below, so no interpolation comes in
    node = Machine(1e-6, 1e-10, 1e-10, 1e-11, "float32", sizes, [1e-6 + n * 1e-10 for n in sizes],
                   [1e-6 + n * 1e-10 for n in sizes], [n * 1e-11 for n in sizes])
    net = Machine(5e-5, 1e-8, 8e-9, 1e-11, "float32", sizes, [5e-5 + n * 1e-8 for n in sizes],
                  [5e-5 + n * 8e-9 for n in sizes], [n * 1e-11 for n in sizes])
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"ranks": 4, "machine": net.to_dict(), "node_machine": node.to_dict(), "rows": []}))
    out = tmp_path / "plan.json"
    r = hpcjobs_here("plan", "--params", "524288", "--throughput", "100", "--batch-per-device", "10", "--devices",
                     "2,4", "--devices-per-node", "2", "--cost-model", str(model), "--algorithm", "ring",
                     "--no-overlap", "--fusion-bytes", "64M", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    N = 2 * MB
    inside = evaluate(COSTS["ring"].formula, P=2, N=N, alpha=1e-6, beta=1e-10, gamma=1e-11)
    assert rows[0]["comm_s"] == pytest.approx(inside, rel=1e-6)
    # between nodes: one direction's cost (the smallest message's one-way time + n x the largest's per byte)
    per_byte = (5e-5 + 16 * MB * 8e-9) / (16 * MB)
    across = 2 * 3 * (5e-5 + 1024 * 8e-9 + N / 4 * per_byte) + 3 * (N / 4) * 1e-11
    assert rows[1]["comm_s"] == pytest.approx(across, rel=1e-6)
    assert math.isclose(rows[1]["iteration_s"], 0.1 + across, rel_tol=1e-6)


@pytest.mark.parametrize("flags,counts", [
    ([], [1]), (["--devices-per-node", "8", "--intra-bw", "150"], [1, 2, 4, 8]),
    (["--devices-per-node", "2", "--intra-bw", "150", "--inter-bw", "1"], [1, 2, 4, 8, 16, 32, 64, 128, 256]),
])
def test_without_a_network_the_default_counts_stop_at_a_node(tmp_path, flags, counts):
    """They went on to 2 nodes and more, and the plan was refused for a count no one asked for."""
    out = tmp_path / "plan.json"
    r = hpcjobs("plan", "--params", "25.6M", "--throughput", "400", *flags, "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert [row["devices"] for row in json.loads(out.read_text())["rows"]] == counts


def test_the_default_counts_fill_whole_nodes_of_any_size(tmp_path):
    out = tmp_path / "plan.json"
    r = hpcjobs("plan", "--params", "1M", "--throughput", "10", "--devices-per-node", "6", "--intra-bw", "100",
                "--inter-bw", "100", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert [row["devices"] for row in json.loads(out.read_text())["rows"]] == [1, 2, 4, 6, 12, 24, 48, 96, 192]
    assert json.loads(out.read_text())["rows"][0]["algorithm"] == "none"


def _curve(path, runs, b2=0.2):
    """Optimus's curve 1/(0.5k + 1) + b2 over 8 epochs, once per (batch, noise scale) in ``runs``."""
    path.write_text("".join(json.dumps({"epoch": k, "step": 10 * k, "global_batch": batch, "loss": 1 / (0.5 * k + 1)
                                        + b2, **({"noise_scale": noise} if noise else {})}) + "\n"
                            for batch, noise in runs for k in range(1, 9)))
    return path


@pytest.mark.parametrize("target,words", [
    ("0.1", "never reaches it (its loss levels off at 0.2)"),  # the fit's asymptote: time inf
    ("5", "reached the target within its first epoch"),  # above epoch 1's loss: time 0
])
def test_a_target_the_fit_never_reaches_or_the_run_had_passed_is_refused(tmp_path, target, words):
    metrics = _curve(tmp_path / "run.jsonl", [(64, None)])
    r = hpcjobs("plan", "--params", "1M", "--throughput", "640", "--devices", "1", "--metrics", str(metrics),
                "--target-loss", target)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_flat_run_is_said_to_level_off_where_it_is(tmp_path):
    """A run stuck at chance (ln 10): a flat fit fits any beta2, and the
    refusal named one (0.29) below the target it said was never reached."""
    metrics = tmp_path / "run.jsonl"
    metrics.write_text("".join(json.dumps({"epoch": k, "step": 10 * k, "global_batch": 64, "loss": 2.302585})
                               + "\n" for k in range(1, 6)))
    r = hpcjobs("plan", "--params", "1M", "--throughput", "640", "--devices", "1", "--metrics", str(metrics),
                "--target-loss", "1.0")
    assert r.returncode == 2 and "never reaches it (its loss levels off at 2.303)" in r.stderr, r.stderr


def test_a_fit_that_puts_the_target_before_the_first_epoch_is_refused(tmp_path):
    """The power law leaves epoch 1 out: here its curve, 10 (k + 5)^-1 from
    epoch 2, reaches 3 before epoch 1, where the run was at 5. It planned a
    time to target of 0 on every row."""
    metrics = tmp_path / "run.jsonl"
    metrics.write_text("".join(json.dumps({"epoch": k, "step": 10 * k, "global_batch": 64,
                                           "loss": 5.0 if k == 1 else 10 / (k + 5)}) + "\n" for k in range(1, 9)))
    r = hpcjobs("plan", "--params", "1M", "--throughput", "640", "--devices", "1", "--metrics", str(metrics),
                "--target-loss", "3", "--loss-model", "power")
    assert r.returncode == 2 and "before the run's first line (epoch 1, loss 5)" in r.stderr, r.stderr
    assert "try --loss-model optimus" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("line,words", [
    ("[1, 2]", "line 9 is not"), ('{"epoch": 9, "loss": null}', "line 9 is not"),
    ('{"epoch": "9", "loss": 0.3}', "line 9 is not"),
])
def test_a_metrics_line_without_numbers_is_refused_with_its_line(tmp_path, line, words):
    metrics = _curve(tmp_path / "run.jsonl", [(64, None)])
    metrics.write_text(metrics.read_text() + line + "\n")
    r = hpcjobs("plan", "--params", "1M", "--throughput", "640", "--devices", "1", "--metrics", str(metrics),
                "--target-loss", "0.3")
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_batch_that_is_not_a_number_is_refused_not_repeated(tmp_path):
    metrics = tmp_path / "run.jsonl"
    metrics.write_text(_curve(metrics, [(64, None)]).read_text().replace('"global_batch": 64', '"global_batch": "64"'))
    r = hpcjobs("plan", "--params", "1M", "--throughput", "640", "--devices", "1", "--metrics", str(metrics),
                "--target-loss", "0.3")
    assert r.returncode == 2 and "numeric global_batch" in r.stderr, r.stderr


def test_the_noise_scale_comes_from_the_run_that_was_fitted(tmp_path):
    """An appended file: the first run measured a noise scale at batch 128,
    the last (fitted) one none, so its epochs are taken as batch-free."""
    metrics = _curve(tmp_path / "run.jsonl", [(128, 1000.0), (64, None)])
    out = tmp_path / "plan.json"
    r = hpcjobs("plan", "--params", "1M", "--throughput", "640", "--devices", "1,2", "--devices-per-node", "2",
                "--intra-bw", "10", "--metrics", str(metrics), "--target-loss", "0.3", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "noise scale unknown" in r.stdout, r.stdout
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["epochs"] == pytest.approx(18, rel=2e-3) and rows[1]["epochs"] == rows[0]["epochs"]


@pytest.mark.parametrize("change,words", [
    ({"sizes": [], "message_s": [], "oneway_s": [], "reduce_s": []}, "lists of the same length"),
    ({"alpha": -1e-6}, "alpha must be a number >= 0"),
    ({"alpha": "x"}, "alpha must be a number >= 0"),
    ({"message_s": [-1.0, 1.0]}, "every size and cost be a number > 0"),
    ({"sizes": [1024, 8]}, "sizes must increase"),
])
def test_a_cost_model_with_impossible_values_is_refused(tmp_path, change, words):
    from hpcjobs.machine import Machine

    m = Machine(1e-6, 1e-9, 1e-9, 1e-10, "float32", [8, 1024], [1e-6, 2e-6], [1e-6, 2e-6], [1e-9, 1e-7]).to_dict()
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"ranks": 2, "machine": m | change}))
    r = hpcjobs_here("plan", "--params", "1M", "--throughput", "10", "--devices", "1,2", "--devices-per-node", "2",
                "--cost-model", str(path))
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
    path.write_text(json.dumps({"ranks": 2, "machine": m}))  # the same file unchanged: planned
    good = hpcjobs_here("plan", "--params", "1M", "--throughput", "10", "--devices", "1,2", "--devices-per-node", "2",
                   "--cost-model", str(path))
    assert good.returncode == 0, good.stderr


def test_a_one_node_cost_model_refuses_a_reduce_bw_it_would_not_use(tmp_path):
    """Its measured reduction cost prices every reduction, across nodes too: --reduce-bw changed nothing."""
    from hpcjobs.machine import Machine

    m = Machine(1e-6, 1e-9, 1e-9, 1e-10, "float32", [8, 1024], [1e-6, 2e-6], [1e-6, 2e-6], [1e-9, 1e-7]).to_dict()
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"ranks": 2, "machine": m}))
    r = hpcjobs_here("plan", "--params", "1M", "--throughput", "10", "--devices", "2,4", "--devices-per-node", "2",
                "--cost-model", str(path), "--inter-bw", "10", "--reduce-bw", "0.001")
    assert r.returncode == 2 and "--reduce-bw would be ignored" in r.stderr, r.stderr


@pytest.mark.parametrize("per_node,flags,planned", [
    (2, [], 2), (2, ["--devices-per-node", "1"], 1), (None, [], 1),  # a file written before it said
    (1, [], 1), (1, ["--devices-per-node", "4"], None),  # one rank per node: no link inside a node measured
])
def test_a_two_level_cost_model_gives_its_ranks_per_node(tmp_path, per_node, flags, planned):
    """With the default of 1 device per node its link inside a node went unused; with more, and a model measured
    at one rank per node, the network's link stood in for it."""
    from hpcjobs.machine import Machine

    m = Machine(1e-6, 1e-9, 1e-9, 1e-10, "float32", [8, 1024], [1e-6, 2e-6], [1e-6, 2e-6], [1e-9, 1e-7]).to_dict()
    path, out = tmp_path / "model.json", tmp_path / "plan.json"
    path.write_text(json.dumps({"ranks": 4, "machine": m, "node_machine": m,
                                **({"ranks_per_node": per_node} if per_node else {})}))
    r = hpcjobs_here("plan", "--params", "1M", "--throughput", "10", "--devices", "1,2,4", "--cost-model", str(path),
                *flags, "--json", str(out))
    if planned is None:
        assert r.returncode == 2 and "measured with one rank per node" in r.stderr, r.stderr
        assert "ppr:4:node" in r.stderr
    else:
        assert r.returncode == 0, r.stderr
        assert f"{planned} device(s)/node" in r.stdout and json.loads(out.read_text())["inputs"]["devices_per_node"] \
            == planned


def test_a_two_level_cost_model_refuses_the_link_flags_it_replaces(tmp_path):
    from hpcjobs.machine import Machine

    m = Machine(1e-6, 1e-9, 1e-9, 1e-10, "float32", [8, 1024], [1e-6, 2e-6], [1e-6, 2e-6], [1e-9, 1e-7]).to_dict()
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"ranks": 4, "machine": m, "node_machine": m}))
    r = hpcjobs_here("plan", "--params", "1M", "--throughput", "10", "--devices", "2,4", "--devices-per-node", "2",
                "--cost-model", str(path), "--inter-bw", "10", "--inter-latency", "5")
    assert r.returncode == 2 and "--inter-bw, --inter-latency would be ignored" in r.stderr, r.stderr


def test_a_one_node_cost_model_plans_the_node_it_measured(tmp_path):
    """Measured by 4 ranks on one node: its devices per node are 4 (it planned 1 device alone, with the
    default of 1 per node and no network)."""
    from hpcjobs.machine import Machine

    m = Machine(1e-6, 1e-9, 1e-9, 1e-10, "float32", [8, 1024], [1e-6, 2e-6], [1e-6, 2e-6], [1e-9, 1e-7]).to_dict()
    path, out = tmp_path / "model.json", tmp_path / "plan.json"
    path.write_text(json.dumps({"ranks": 4, "machine": m}))
    r = hpcjobs_here("plan", "--params", "1M", "--throughput", "10", "--cost-model", str(path), "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert [row["devices"] for row in json.loads(out.read_text())["rows"]] == [1, 2, 4]


def test_plan_with_a_cost_model_starts_no_mpi(tmp_path):
    """A login-node command: reading the model.json went through hpcjobs.perfmodel, which imports mpi4py's MPI,
    and started MPI (a singleton, where a login node may not allow one) to plan."""
    from hpcjobs.machine import Machine

    m = Machine(1e-6, 1e-9, 1e-9, 1e-10, "float32", [8, 1024], [1e-6, 2e-6], [1e-6, 2e-6], [1e-9, 1e-7]).to_dict()
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"ranks": 4, "machine": m, "node_machine": m, "ranks_per_node": 2}))
    code = ("import sys\nfrom hpcjobs.cli import main\n"
            f"rc = main(['plan', '--params', '1M', '--throughput', '10', '--devices', '2,4', "
            f"'--cost-model', {str(path)!r}])\n"
            "print('rc', rc, 'mpi', 'mpi4py.MPI' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=clean_env())
    assert (proc.stdout.splitlines() or [""])[-1] == "rc 0 mpi False", proc.stdout + proc.stderr
    assert "| devices |" in proc.stdout


@pytest.mark.parametrize("per_node,rows", [(None, [1]), ("4", [1, 2, 4])])
def test_a_plan_with_no_network_says_it_plans_one_node(tmp_path, per_node, rows):
    out = tmp_path / "plan.json"
    r = hpcjobs_here("plan", "--params", "1M", "--throughput", "10", "--json", str(out),
                     *(["--devices-per-node", per_node, "--intra-bw", "100"] if per_node else []))
    assert r.returncode == 0, r.stderr
    assert f"no network given (--inter-bw, or a --cost-model measured across nodes): one node, up to its " \
           f"{rows[-1]} device" in r.stderr, r.stderr
    assert [row["devices"] for row in json.loads(out.read_text())["rows"]] == rows
    r = hpcjobs_here("plan", "--params", "1M", "--throughput", "10", "--inter-bw", "10")
    assert r.returncode == 0 and "no network given" not in r.stderr, r.stderr
