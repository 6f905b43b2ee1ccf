"""The files ``hpcjobs plan`` reads, checked: ``--metrics``, the loss curve
to a target; ``--cost-model``, the links ``hpcjobs model`` measured; and
train ``--metrics`` files besides the loss curve: ``--runs``, measured steps
for the black-box fit to go through, and ``--against``, measured runs to
hold the predictions against.

A run's step is the median over its epochs after the first (which pays for
warm-up) of the epoch's time per step. Against a run, each step is split
as the system model splits it: the time the run waited for its reductions
(``wait_s``, the rank that waited longest: with overlap, what backward did
not hide) against the model's exposed communication, and the rest of the
step against the model's compute (forward, backward and update of one
device). A compressor's codec runs inside the reductions in both.
"""

from __future__ import annotations

import json
import math
import statistics

from ..convergence import is_number, json_lines, last_run

NEEDED = ("ranks", "epoch_s", "step", "epoch")
FITS = {"optimus": "Optimus", "power": "power-law"}  # the loss models' names in words


def lines(path: str) -> list:
    """A JSON-lines file's records (:func:`~hpcjobs.convergence.json_lines`)."""
    return [record for _, record in json_lines(path)]


def measured(path: str, batch: int | None = None) -> dict:
    """One run, the file's last (:func:`~hpcjobs.convergence.last_run`: ``train``
    appends): its device count, its step and the part of it spent waiting
    for reductions (None where the file does not say), in seconds.
    ValueError naming the file and the epoch where a line is not a train
    ``--metrics`` line, the run's device count changes, or its samples per
    device a step (global_batch / ranks, where written) are not ``batch``."""
    recs = last_run(lines(path))
    if not recs or any(not isinstance(r, dict) or any(k not in r for k in NEEDED) for r in recs):
        raise ValueError(f"{path}: not a train --metrics file (each line needs {', '.join(NEEDED)})")
    if recs[-1].get("mode", "sync") != "sync":  # its steps are a worker's pushes, its ranks servers too
        raise ValueError(f"{path}: a run of --mode {recs[-1]['mode']}; plan predicts synchronous training: give "
                         "a --mode sync run")
    for r in recs:
        for k in NEEDED:
            if not is_number(r[k]) or r[k] <= 0 or (k == "ranks" and r[k] != int(r[k])):
                raise ValueError(f"{path}: the line of epoch {r['epoch']!r}: {k} must be a positive "
                                 f"{'whole ' if k == 'ranks' else ''}number, not {r[k]!r}")
        if r.get("wait_s") is not None and (not is_number(r["wait_s"]) or r["wait_s"] < 0):
            raise ValueError(f"{path}: the line of epoch {r['epoch']!r}: wait_s must be a number >= 0, "
                             f"not {r['wait_s']!r}")
    if len({r["ranks"] for r in recs}) > 1:
        raise ValueError(f"{path}: its last run's ranks change ({', '.join(str(r['ranks']) for r in recs)}): "
                         "one run on one device count per file")
    devices = int(recs[0]["ranks"])
    for r in recs:
        if "global_batch" in r and (not is_number(r["global_batch"]) or r["global_batch"] <= 0):
            raise ValueError(f"{path}: the line of epoch {r['epoch']!r}: global_batch must be a positive number, "
                             f"not {r['global_batch']!r}")
    gb = recs[-1].get("global_batch")  # (passes per step included)
    if batch and gb is not None and gb != batch * devices:  # another batch's step: neither a point nor a check
        raise ValueError(f"{path}: a run of {gb / devices:g} samples per device a step (global_batch {gb} on "
                         f"{devices}); this plan's --batch-per-device is {batch}")
    recs = recs[1:] if len(recs) > 1 else recs  # the first epoch pays for warm-up
    steps = [r["step"] / r["epoch"] for r in recs]  # steps per epoch
    waited = None
    if all(r.get("wait_s") is not None for r in recs):
        waited = statistics.median(r["wait_s"] / n for r, n in zip(recs, steps))
    return {"run": path, "devices": devices,
            "step_s": statistics.median(r["epoch_s"] / n for r, n in zip(recs, steps)), "waited_s": waited}


def _paths(spec: str | None) -> list[str]:
    return [s for s in (spec or "").split(",") if s]


def fit(spec: str | None, batch: int | None = None):
    """``--runs``: ``(predict, points)``, the black-box fit through the runs'
    (devices, s/step), each at ``batch`` per device, or ``(None, [])``
    without runs."""
    from ..planner import fit_runs

    if not spec:
        return None, []
    points = [(m["devices"], m["step_s"]) for m in (measured(path, batch) for path in _paths(spec))]
    if len({p for p, _ in points}) < 2:  # one count fits the compute term alone: perfect scaling, printed as a fit
        raise ValueError(f"--runs: the black-box fit needs runs on two device counts at least, got "
                         f"{sorted({p for p, _ in points})}")
    _, predict = fit_runs(points)
    return predict, points


def read_against(spec: str | None, devices: list[int], batch: int | None = None) -> list[dict]:
    """``--against``: each run :func:`measured` (at ``batch`` per device),
    its device count checked to be a planned row (before anything is
    measured)."""
    runs = [measured(path, batch) for path in _paths(spec)]
    for m in runs:
        if m["devices"] not in devices:
            raise ValueError(f"--against {m['run']}: a run on {m['devices']} devices, which --devices does not "
                             f"plan; add {m['devices']} to --devices (a count of whole nodes)")
    return runs


def against(runs: list[dict], rows: list[dict]) -> list[dict]:
    """Each run of :func:`read_against` beside the planned row of its device
    count: measured and predicted step, the relative errors (predicted /
    measured - 1), and the split into waiting and the rest."""
    by = {r["devices"]: r for r in rows}
    out = []
    for m in runs:
        row = by[m["devices"]]
        c = {"run": m["run"], "devices": m["devices"], "measured_s": m["step_s"],
             "predicted_s": row["iteration_s"], "error": row["iteration_s"] / m["step_s"] - 1,
             "waited_s": m["waited_s"], "exposed_s": row["exposed_s"],
             "rest_s": None if m["waited_s"] is None else m["step_s"] - m["waited_s"], "compute_s": row["compute_s"]}
        fit = row.get("fit_iteration_s")  # (null without --runs: the same keys in every plan)
        c["fit_s"], c["fit_error"] = fit, None if fit is None else fit / m["step_s"] - 1
        out.append(c)
    return out


def table(checks: list[dict]) -> str:
    """The ``--against`` rows as a Markdown table, in ms."""
    def ms(v):
        return "-" if v is None else f"{v * 1e3:.4g}"

    def err(v):
        return "" if v is None else f" ({v:+.1%})"

    head = ["devices", "run", "measured ms", "predicted ms (error)", "fit ms (error)", "waited ms", "exposed ms",
            "rest ms", "compute ms"]
    cells = [head] + [[str(c["devices"]), c["run"], ms(c["measured_s"]), ms(c["predicted_s"]) + err(c["error"]),
                       ms(c.get("fit_s")) + err(c.get("fit_error")), ms(c["waited_s"]), ms(c["exposed_s"]),
                       ms(c["rest_s"]), ms(c["compute_s"])] for c in checks]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    return "\n".join("| " + " | ".join(v.rjust(w) for v, w in zip(row, widths)) + " |" for row in cells)


def target(path: str, loss: float, model: str, noise_scale: float | None):
    """``--metrics`` and ``--target-loss``: the :class:`hpcjobs.planner.Target`
    of the file's last run, its noise scale the median of that run's (or
    ``noise_scale``). ValueError where the file is not a train ``--metrics``
    file, or the target is one the fit never reaches, or the run had passed
    by its first epoch, or the fit puts before it: those would plan on a
    time of inf or about 0."""
    from ..convergence import fit_metrics, predict_epochs
    from ..planner import Target

    epochs, losses = fit_metrics(path)  # checks the file: JSON lines with epoch and loss
    run = last_run(lines(path))  # what the run was, before what its fit says: advice on a fit is moot otherwise
    last = run[-1]
    if last.get("mode", "sync") != "sync":  # (its lines count workers and samples, not a global batch)
        raise ValueError(f"{path}: a run of --mode {last['mode']}; plan predicts synchronous training: give the "
                         "metrics of a --mode sync run")
    if not all(is_number(last.get(k)) and last[k] > 0 for k in ("global_batch", "step", "epoch")):
        raise ValueError(f"{path}: the last line needs numeric global_batch, step and epoch (a train --metrics file)")
    if loss >= losses[0]:
        raise ValueError(f"--target-loss {loss}: {path} was at {losses[0]:.4g} after epoch {epochs[0]}, so "
                         "its run reached the target within its first epoch; give a lower target")
    p = predict_epochs(epochs, losses, loss, model)
    if math.isinf(p.epochs):
        # where the fit levels off: beta2, or a flat fit's own level (beta2 alone is any value there)
        floor = p.fit.loss(1e12) if hasattr(p.fit, "beta2") else None
        why = f"its loss levels off at {floor:.4g}" if floor is not None else "it is flat"
        raise ValueError(f"--target-loss {loss}: the {FITS[model]} fit of {path} never reaches it ({why}); give a "
                         "higher target" + (", or try --loss-model power" if model == "optimus" else ""))
    if p.epochs < epochs[0]:  # the power law leaves the first epoch out, and its curve can pass it early
        other = "power" if model == "optimus" else "optimus"
        raise ValueError(f"--target-loss {loss}: the {FITS[model]} fit of {path} puts it at {p.epochs:.3g} epochs, "
                         f"before the run's first line (epoch {epochs[0]}, loss {losses[0]:.4g}): the fit does not "
                         f"follow the run's start; try --loss-model {other}")
    if noise_scale is None:
        seen = [r["noise_scale"] for r in run if is_number(r.get("noise_scale")) and r["noise_scale"] > 0]
        noise_scale = statistics.median(seen) if seen else None
    return Target(loss, p.epochs, p.low, p.high, int(last["global_batch"]),
                  int(last["step"] // last["epoch"] * last["global_batch"]), noise_scale)


MACHINE_NUMBERS = ("alpha", "beta", "beta_pingpong", "gamma")
MACHINE_LISTS = ("sizes", "message_s", "oneway_s", "reduce_s")


def cost_model(path: str):
    """``--cost-model``: ``(between, inside)``, the Machines of a model.json
    of ``hpcjobs model`` (``inside`` None where it was measured inside one
    node), each checked: finite non-negative constants, and costs at the
    same increasing sizes, all positive."""
    from ..machine import Machine

    def machine(data) -> Machine:
        m = Machine(**data)
        for name in MACHINE_NUMBERS:
            if not is_number(getattr(m, name)) or getattr(m, name) < 0:
                raise ValueError(f"{name} must be a number >= 0, got {getattr(m, name)!r}")
        columns = [getattr(m, name) for name in MACHINE_LISTS]
        if not all(isinstance(c, list) and c and len(c) == len(m.sizes) for c in columns):
            raise ValueError(f"{', '.join(MACHINE_LISTS)} must be lists of the same length, not empty")
        if not all(is_number(v) and v > 0 for c in columns for v in c) or sorted(set(m.sizes)) != m.sizes:
            raise ValueError("sizes must increase and every size and cost be a number > 0")
        return m

    try:
        data = _model_json(path)
        net = machine(data["machine"])
        node = machine(data["node_machine"]) if "node_machine" in data else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--cost-model {path}: not a model.json of `hpcjobs model` ({e})") from None
    return net, node


def cost_model_ranks_per_node(path: str, two_level: bool = True) -> int | None:
    """The ranks per node a model.json was measured with: a two-level one's
    ``ranks_per_node`` (1: its link inside a node is the network's, standing
    in; None where it does not say, written before 2026-11-29), a one-node
    one's ``ranks``."""
    value = _model_json(path).get("ranks_per_node" if two_level else "ranks")
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"--cost-model {path}: {'ranks_per_node' if two_level else 'ranks'} must be a whole number "
                         f">= 1, got {value!r}")
    return value


def cost_model_source(path: str) -> str | None:
    """How ``hpcjobs model`` found a model.json's nodes (topology's source: "override" where --ranks-per-node
    simulated them on one machine; None where it does not say, written before 2026-11-30)."""
    return _model_json(path).get("topology_source")


def _model_json(path: str) -> dict:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise TypeError(f"a JSON {type(data).__name__}, not an object")
    return data
