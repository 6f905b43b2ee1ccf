"""Optimus's loss model (hpcjobs/convergence.py): the fit against its
closed form, the prediction and its interval, the errors, the metrics file,
and ``train --target-loss``."""

import json
import math

import numpy as np
import pytest

from hpcjobs.convergence import MIN_POINTS, fit, fit_metrics, fit_power, min_points, predict_epochs, prediction_fields

B0, B1, B2 = 0.8, 0.5, 0.3
K = np.arange(1, 11, dtype=float)
EXACT = 1 / (B0 * K + B1) + B2


def test_the_fit_recovers_the_parameters_of_an_exact_curve():
    f = fit(K, EXACT)
    assert (f.beta0, f.beta1, f.beta2) == pytest.approx((B0, B1, B2), rel=2e-3)
    assert f.rmse < 1e-4 and f.points == 10
    assert f.loss(20) == pytest.approx(1 / (B0 * 20 + B1) + B2, rel=1e-3)


def test_the_prediction_is_the_closed_form_and_its_interval_holds_it():
    target = 0.4  # reached at (1/(0.4-0.3) - 0.5) / 0.8 = 11.875 epochs: beyond the 6 points given
    p = predict_epochs(list(K[:6]), list(EXACT[:6]), target)
    want = (1 / (target - B2) - B1) / B0
    assert p.epochs == pytest.approx(want, abs=0.05)
    assert p.low <= p.epochs <= p.high and p.high - p.low < 0.5


def test_noise_widens_the_interval_around_the_truth():
    rng = np.random.default_rng(0)  # seeded: the same numbers every run
    noisy = EXACT * (1 + 0.01 * rng.standard_normal(len(K)))
    p = predict_epochs(list(K), list(noisy), 0.4)
    assert p.low < 11.875 < p.high
    assert p.high - p.low > 0.1


def test_a_target_under_the_asymptote_is_never_reached():
    p = predict_epochs(list(K), list(EXACT), 0.25)
    assert math.isinf(p.epochs) and math.isinf(p.high)
    assert prediction_fields([{"epoch": int(k), "loss": float(v)} for k, v in zip(K, EXACT)], 0.25) == {
        "predicted_epoch": None, "predicted_epoch_low": None, "predicted_epoch_high": None}


def test_a_target_already_passed_is_epoch_zero_or_more():
    assert 0 <= predict_epochs(list(K), list(EXACT), 5.0).epochs <= 1


@pytest.mark.parametrize("epochs,losses,words", [
    ([1, 2], [1.0, 0.5], "at least 3 points"),
    ([1, 2, 3], [1.0, 0.5], "one length"),
    ([1, 2, 3, 4], [1.0, -0.5, 0.4, 0.3], "positive finite"),
    ([1, 2, 3, 4], [1.0, float("nan"), 0.4, 0.3], "positive finite"),
])
def test_bad_histories_are_refused_with_the_rule(epochs, losses, words):
    with pytest.raises(ValueError, match=words):
        fit(epochs, losses)


@pytest.mark.parametrize("epochs,losses,target,model,words", [
    ([1, 2, 3], [1.0, 0.5, 0.4], 0.1, "optimus", f"at least {MIN_POINTS} epochs"),
    ([1, 2, 3, 4], [1.0, 0.5, 0.4, 0.3], 0.0, "optimus", "positive number"),
    ([1, 2, 3, 4], [1.0, 0.5, 0.4, 0.3], 0.1, "power", "at least 5 epochs"),
    ([1, 2, 3, 4], [1.0, 0.5, 0.4, 0.3], 0.1, "cubic", "unknown loss model 'cubic'"),
    ([0, 1, 2, 3, 4], [1.0, 0.5, 0.4, 0.3, 0.2], 0.1, "power", "the power law needs 4 epochs after the first"),
    ([0.5, 2, 3, 4, 5], [1.0, 0.5, 0.4, 0.3, 0.2], 0.1, "optimus", "ok"),
    ([-1, 2, 3, 4], [1.0, 0.5, 0.4, 0.3], 0.1, "optimus", "epochs must be positive"),
])
def test_bad_predictions_are_refused_with_the_rule(epochs, losses, target, model, words):
    if words == "ok":  # fractional epochs (an asynchronous run's last line) are epochs like any other
        assert predict_epochs(epochs, losses, target, model).epochs > 5
        return
    with pytest.raises(ValueError, match=words):
        predict_epochs(epochs, losses, target, model)


A, ALPHA, PB = 2.0, 1.5, 1.0  # l = 2 (k + 1)^-1.5: faster than any 1/k, which Optimus's curve cannot follow
PK = np.arange(2, 11, dtype=float)
POWER = A * (PK + PB) ** -ALPHA


def test_the_power_law_recovers_the_parameters_of_an_exact_curve():
    f = fit_power(PK, POWER)
    assert (f.a, f.alpha, f.b) == pytest.approx((A, ALPHA, PB), rel=1e-9)
    assert f.rmse < 1e-12 and f.points == len(PK)
    assert f.epochs_to(A * 21.0 ** -ALPHA) == pytest.approx(20.0, rel=1e-9)
    assert f.epochs_to(A * 2.0) == 0.0  # a target above every loss: reached at once
    flat = fit_power(PK, np.linspace(0.5, 0.6, len(PK)))  # a rising history: the fit is flat, never below it
    assert flat.alpha == 0.0 and math.isinf(flat.epochs_to(0.4))


def test_the_power_law_leaves_out_the_first_epoch_and_predicts_the_closed_form():
    k = list(range(1, 8))
    losses = [50.0] + [A * (v + PB) ** -ALPHA for v in k[1:]]  # epoch 1: the mean over the steepest fall
    target = 0.03  # reached at (2 / 0.03)^(1/1.5) - 1 = 15.44 epochs, beyond the 7 given
    p = predict_epochs(k, losses, target, "power")
    assert p.fit.points == 6
    assert p.epochs == pytest.approx((A / target) ** (1 / ALPHA) - PB, rel=1e-6)
    assert p.low <= p.epochs <= p.high and p.high - p.low < 1e-3
    assert min_points("power") == MIN_POINTS + 1 == 5
    fields = prediction_fields([{"epoch": v, "loss": w} for v, w in zip(k, losses)], target, model="power")
    assert fields["predicted_epoch"] == pytest.approx(p.epochs, abs=0.01)
    # Optimus's curve, given the same history, is pulled by the first epoch's loss and cannot fall as fast
    assert predict_epochs(k, losses, target).epochs > 1.5 * p.epochs


def test_metrics_file_gives_the_last_runs_losses(tmp_path):
    path = tmp_path / "m.jsonl"
    lines = [{"epoch": 1, "loss": 9.0}, {"epoch": 2, "loss": 8.0},  # an earlier run, appended to
             {"epoch": 1, "loss": 2.0}, {"epoch": 2, "loss": 1.5}, {"epoch": 3, "loss": 1.2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert fit_metrics(str(path)) == ([1, 2, 3], [2.0, 1.5, 1.2])
    path.write_text('{"epoch": 1}\n')
    with pytest.raises(ValueError, match="every line of its last run needs a numeric 'epoch' and 'loss'"):
        fit_metrics(str(path))
    path.write_text("".join(json.dumps(r) + "\n" for r in lines[:3]) + '\n{"epoch": 2, "loss": NaN}\n')
    with pytest.raises(ValueError, match="line 5 is not"):  # its line in the file, the blank one counted
        fit_metrics(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        fit_metrics(str(tmp_path / "missing.jsonl"))
    path.write_text('{"epoch": 1, "loss": 2.0}\n\n{"epoch": 2, "loss": 1.0}\n{"epoch": 3,')  # its line, blank counted
    with pytest.raises(ValueError, match=r"m.jsonl: not JSON lines \(Expecting .*, line 4\)"):
        fit_metrics(str(path))
    path.write_bytes(b'{"epoch": 1, "loss": 2.0}\n\xff\x00\n')  # not text: a traceback's message, unnamed, before
    with pytest.raises(ValueError, match=r"m.jsonl: not JSON lines \(not UTF-8 text\)"):
        fit_metrics(str(path))


@pytest.mark.parametrize("model", ["optimus", "power"])
def test_train_predicts_the_target_epoch_once_the_model_has_its_points(tmp_path, model):
    from launch import mpirun

    metrics = tmp_path / "m.jsonl"
    out = mpirun(2, "train", "--dataset", "synthetic", "--num-samples", "800", "--width", "16", "-b", "16",
                 "--epochs", "6", "--target-loss", "0.05", "--loss-model", model, "--metrics", str(metrics),
                 "--no-progress")
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2, 3, 4, 5, 6]
    first = min_points(model)  # 4th epoch, or 5th for the power law (its first epoch is left out)
    assert all("predicted_epoch" not in r for r in records[:first - 1])
    for n, r in enumerate(records[first - 1:], start=first):
        # the same fit on the same losses (as the line rounds them to 6 digits), here
        want = prediction_fields(records[:n], 0.05, model=model)
        for key, value in want.items():
            assert (r[key] is None) == (value is None), (key, r, want)
            assert value is None or r[key] == pytest.approx(value, abs=0.02, rel=1e-3), (key, r, want)


def test_a_flat_or_diverged_history_predicts_never_without_raising():
    flat = [{"epoch": k, "loss": 0.7} for k in range(1, 7)]
    assert prediction_fields(flat, 0.5)["predicted_epoch"] is None
    # above the level it stays at: reached, as the power law says (it said never)
    assert predict_epochs(range(1, 7), [0.7] * 6, 0.9).epochs == 0.0
    assert predict_epochs(range(1, 7), [0.7] * 6, 0.9, "power").epochs == 0.0
    diverged = flat[:4] + [{"epoch": 5, "loss": float("nan")}]
    assert prediction_fields(diverged, 0.5) == {"predicted_epoch": None, "predicted_epoch_low": None,
                                                "predicted_epoch_high": None}
    huge = flat[:4] + [{"epoch": 5, "loss": 3e77}]  # finite, but its weight overflowed: LinAlgError
    assert prediction_fields(huge, 0.5)["predicted_epoch"] is None
    with pytest.raises(ValueError, match="a loss of 3e.77 is a diverged run's"):
        predict_epochs(range(1, 6), [h["loss"] for h in huge], 0.5)


def test_train_reports_the_noise_scale_each_epoch_and_refuses_it_alone(tmp_path):
    from launch import mpirun

    metrics = tmp_path / "m.jsonl"
    out = mpirun(2, "train", "--dataset", "synthetic", "--num-samples", "800", "--width", "16", "-b", "16",
                 "--epochs", "2", "--noise-scale", "--metrics", str(metrics), "--no-progress")
    assert out.returncode == 0, out.stderr
    for r in (json.loads(line) for line in metrics.read_text().splitlines()):
        assert r["grad_sq"] > 0 and r["grad_var"] > 0, r
        assert r["noise_scale"] == pytest.approx(r["grad_var"] / r["grad_sq"], rel=1e-5)
    alone = mpirun(1, "train", "--dataset", "synthetic", "--num-samples", "800", "--noise-scale", "--epochs", "1")
    assert alone.returncode == 2 and "run 2 or more" in alone.stderr, alone.stderr
