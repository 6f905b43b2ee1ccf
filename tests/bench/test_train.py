"""``hpcjobs bench train``: every implementation in one run, parameters agree."""

import json

import torch

from launch import mpirun as _mpirun
from launch import mpirun_script


def test_bench_train_measures_every_implementation(tmp_path):
    out = _mpirun(2, "bench", "train", "--impl", "single,ours:auto,ours:ring/none,ours:auto+bf16,ddp",
                  "--width", "32", "--num-iters", "2", "--num-batches-per-iter", "2", "--num-warmup-batches", "1",
                  "--json", str(tmp_path / "t.json"), "--no-progress", timeout=180)
    assert out.returncode == 0, out.stderr
    data = json.load(open(tmp_path / "t.json"))
    rows = {r["impl"]: r for r in data["results"]}
    assert list(rows) == ["single", "ours:auto", "ours:ring/none", "ours:auto+bf16", "ddp"]
    assert all(r["wrong"] == 0 and r["samples_per_s_per_rank"] > 0 and len(r["rounds"]) == 2 for r in rows.values())
    assert rows["ddp"]["vs_ddp"] == 1.0
    assert rows["ours:auto"]["total_samples_per_s"] == 2 * rows["ours:auto"]["samples_per_s_per_rank"]
    assert 0 < rows["ours:auto"]["comm_share"] < 1 and rows["ddp"]["comm_share"] is None
    assert "# comm: our optimizer's time in allreduce over the step time" in out.stdout
    assert "No backend of type" not in out.stderr  # torch's warning for a group without a default backend
    assert rows["single"]["update_error"] is None and rows["ours:auto"]["update_error"] < 1e-6
    assert 0 < rows["ours:auto+bf16"]["update_error"] < 0.05 and "+1 where the first step lands over 0.05" in out.stdout


def test_bench_train_refuses_unknown_implementations():
    out = _mpirun(2, "bench", "train", "--impl", "ours:auto,tensorflow")
    assert out.returncode == 2 and "unknown implementation 'tensorflow'" in out.stderr
    out = _mpirun(2, "bench", "train", "--impl", "ours:auto+zip")
    assert out.returncode == 2 and "unknown compression 'zip'" in out.stderr


def test_bench_train_on_resnet18_images(tmp_path):
    """ResNet-18 on random 32x32 images, the doors beside ours."""
    out = _mpirun(2, "bench", "train", "--model", "resnet18", "--image-size", "32", "--batch-size", "2",
                  "--impl", "ours:auto,ddp-hpcjobs,hvd-hpcjobs", "--num-iters", "1", "--num-batches-per-iter", "1",
                  "--num-warmup-batches", "1", "--json", str(tmp_path / "t.json"), "--no-progress", timeout=240)
    assert out.returncode == 0, out.stderr
    assert "# bench train: resnet18 at 32x32 (11181642 parameters" in out.stdout
    rows = {r["impl"]: r for r in json.load(open(tmp_path / "t.json"))["results"]}
    assert list(rows) == ["ours:auto", "ddp-hpcjobs", "hvd-hpcjobs"] and all(r["wrong"] == 0 for r in rows.values())


def test_bench_train_refuses_images_a_resnet_cannot_take():
    out = _mpirun(2, "bench", "train", "--model", "resnet18", "--image-size", "16")
    assert out.returncode == 2 and "needs images of at least 32x32" in out.stderr
    # one sample a rank gives BatchNorm one value per channel: torch's traceback, as train refuses it
    out = _mpirun(2, "bench", "train", "--model", "mlp", "--batch-norm", "--batch-size", "1", "--impl", "single")
    assert out.returncode == 2 and "--batch-size 1: mlp normalizes over the batch" in out.stderr and \
        "Traceback" not in out.stderr, out.stderr


def test_bench_train_on_gpt_mini_tokens_with_bf16_autocast(tmp_path):
    """gpt-mini, shortened, on random tokens under bf16 autocast: ours, DDP on
    our backend and our Horovod API."""
    out = _mpirun(2, "bench", "train", "--model", "gpt-mini", "--layers", "1", "--seq-len", "16",
                  "--batch-size", "2", "--amp", "bf16", "--impl", "single,ours:auto,ddp-hpcjobs,hvd-hpcjobs",
                  "--num-iters", "1", "--num-batches-per-iter", "2", "--num-warmup-batches", "1",
                  "--json", str(tmp_path / "t.json"), "--no-progress", timeout=240)
    assert out.returncode == 0, out.stderr
    assert ("# bench train: gpt-mini (1 layers, 6 heads, 384 wide, vocabulary 256; a sample is a sequence of "
            "16 tokens), autocast to bf16 (1879680 parameters") in out.stdout
    rows = {r["impl"]: r for r in json.load(open(tmp_path / "t.json"))["results"]}
    assert list(rows) == ["single", "ours:auto", "ddp-hpcjobs", "hvd-hpcjobs"]
    assert all(r["wrong"] == 0 and r["samples_per_s_per_rank"] > 0 for r in rows.values())
    assert "# buckets: ours 1 MiB (--fusion-bytes), ddp and ddp-hpcjobs 25 MiB (DDP's default)" in out.stdout


def test_fp16_autocast_is_refused_on_cpus_and_cuda_without_a_gpu():
    from launch import main_in_one_launch

    commands = (["bench", "train"], ["train"], ["experiment", "large-batch", "--out", "/tmp/never"])
    cases = [([*c, "--amp", "fp16", "--device", "cpu"], "--amp fp16 is for GPUs") for c in commands]
    if not torch.cuda.is_available():  # on a GPU machine it would start training
        cases += [([*c, "--device", "cuda"], "--device cuda: no CUDA GPU is visible") for c in commands]
    for (argv, words), ranks in zip(cases, main_in_one_launch(2, [argv for argv, _ in cases])):
        assert [rc for rc, _, _ in ranks] == [2, 2] and words in ranks[0][2], (argv, ranks)
    out = _mpirun(2, "bench", "train", "--amp", "fp16", "--device", "cpu")  # and as a launch of its own
    assert out.returncode == 2 and "--amp fp16 is for GPUs" in out.stderr, out.stderr


def test_bench_train_with_the_same_buckets_for_every_library(tmp_path):
    out = _mpirun(2, "bench", "train", "--model", "mlp", "--width", "64", "--same-buckets", "--fusion-bytes", "4K",
                  "--impl", "ours:auto,ddp,hvd-hpcjobs", "--num-iters", "1", "--num-batches-per-iter", "1",
                  "--num-warmup-batches", "1", "--json", str(tmp_path / "t.json"), "--no-progress", timeout=180)
    assert out.returncode == 0, out.stderr
    assert "# buckets: 0.00390625 MiB for every implementation (--same-buckets)" in out.stdout
    assert json.load(open(tmp_path / "t.json"))["config"]["same_buckets"] is True


def test_bench_train_refuses_gpt_shapes_it_cannot_build():
    from launch import main_in_one_launch

    cases = [(["--model", "gpt-mini", "--embed", "100"], "embed 100 is not a multiple of heads 6"),
             (["--model", "mlp", "--seq-len", "64"], "--seq-len shapes the GPTs (gpt-mini, gpt2-small), not mlp"),
             # flags of another kind of model: ignored before, silently
             (["--model", "gpt-mini", "--width", "64"], "--width shapes mlp and cnn1d, not gpt-mini"),
             (["--model", "mlp", "--image-size", "64"],
              "--image-size shapes the ResNets (resnet18, resnet50), not mlp"),
             (["--model", "gpt-mini", "--num-classes", "3"], "--num-classes shapes the classifiers, not gpt-mini")]
    for (args, words), ranks in zip(cases, main_in_one_launch(2, [["bench", "train", *a] for a, _ in cases])):
        assert [rc for rc, _, _ in ranks] == [2, 2] and words in ranks[0][2], (args, ranks)


def test_fp16_grad_scaler_recipes_from_the_library():
    """Refused on the command line on CPUs, fp16 still runs through the
    library (for GPUs): each implementation's GradScaler recipe keeps the
    ranks' parameters equal."""
    out = mpirun_script(2, """
import torch
from mpi4py import MPI
from hpcjobs.bench.train import Workload, bench_train
torch.set_num_threads(1)
w = Workload(model="gpt-mini", width=0, batch_norm=False, input_size=0, image_size=0, num_classes=0, batch_size=2,
             fusion_bytes=1 << 20, lr=0.01, seed=0, seq_len=8, layers=1, amp="fp16")
results = bench_train(MPI.COMM_WORLD, ["single", "ours:auto", "ddp-hpcjobs", "hvd-hpcjobs"], w, 1, 2, 1)
assert sorted(results) == ["ddp-hpcjobs", "hvd-hpcjobs", "ours:auto", "single"], results
assert all(r.wrong == 0 and r.median > 0 for r in results.values()), results
print("ok", MPI.COMM_WORLD.Get_rank())
""", timeout=240)
    assert out.returncode == 0 and out.stdout.count("ok") == 2, out.stderr


_GREEDY = """
import torch
from mpi4py import MPI
import hpcjobs.bench.train as bench
real, built = bench.model, []
def greedy(w):  # the model of the ranks in GREEDY runs out of GPU memory in its forward pass
    net = real(w)
    built.append(net)  # (with 2 ranks the first is the reference step's: it goes through)
    if MPI.COMM_WORLD.Get_rank() in GREEDY and len(built) > (MPI.COMM_WORLD.Get_size() > 1):
        def forward(*args):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        net.forward = forward
    return net
bench.model = greedy
torch.set_num_threads(1)
w = bench.Workload(model="mlp", width=16, batch_norm=False, input_size=8, image_size=0, num_classes=3, batch_size=4,
                   fusion_bytes=1 << 20, lr=0.01, seed=0)
try:
    bench.bench_train(MPI.COMM_WORLD, ["ours:auto"], w, 1, 1, 1)
except MemoryError as e:
    print("raised:", e)
"""


def test_a_cuda_out_of_memory_names_the_run_and_ends_the_job_on_every_rank():
    """One rank out of GPU memory while the other waits in the step's
    allreduce: the job ends (no hang) with the model, batch, device and
    implementation on stderr; alone, the rank raises that MemoryError."""
    words = ("out of GPU memory on rank {} (cpu) training mlp with 4 samples per rank (ours:auto): lower "
             "--batch-size or use --amp bf16 (CUDA out of memory. Tried to allocate 2.00 GiB)")
    out = mpirun_script(2, _GREEDY.replace("GREEDY", "(1,)"))
    assert out.returncode != 0 and "hpcjobs: " + words.format(1) + "; ending the job" in out.stderr, out.stderr
    assert "raised:" not in out.stdout
    alone = mpirun_script(1, _GREEDY.replace("GREEDY", "(0,)"))
    assert alone.returncode == 0 and "raised: " + words.format(0) in alone.stdout, alone.stderr
    # the reference step's own: named as such
    out = mpirun_script(2, _GREEDY.replace("GREEDY", "(1,)").replace("len(built) > (", "len(built) >= ("))
    assert out.returncode != 0 and "training mlp with 4 samples per rank (the reference step, MPI_Allreduce's " \
        "average): lower" in out.stderr, out.stderr


def test_an_implementation_that_sums_the_gradients_is_wrong():
    """Every implementation's first step is held against MPI_Allreduce's
    average: one whose gradients come in P times too large (a sum, not an
    average; here a hook scales them) lands P - 1 updates away and counts
    as wrong, where the ranks still agree. The others land on it (bf16
    within its rounding); a lossy compressor's distance is given, not held."""
    out = mpirun_script(3, """
import torch
from mpi4py import MPI
import hpcjobs.bench.train as bench
real = bench._build
def build(name, w, comm, *rest):
    runner = real(name, w, comm, *rest)
    if name == "ours:ring":
        for p in runner.model.parameters():
            p.register_hook(lambda g: g * comm.Get_size())
    return runner
bench._build = build
torch.set_num_threads(1)
w = bench.Workload(model="mlp", width=16, batch_norm=False, input_size=8, image_size=0, num_classes=3, batch_size=4,
                   fusion_bytes=1 << 20, lr=0.01, seed=0)
names = ["single", "ours:ring", "ours:ring/none", "ours:auto+bf16", "ours:ring+qsgd:3", "ddp-hpcjobs", "hvd-hpcjobs"]
r = bench.bench_train(MPI.COMM_WORLD, names, w, 1, 1, 1)
assert abs(r["ours:ring"].update_error - 2) < 1e-4 and r["ours:ring"].wrong == 1, r["ours:ring"]
assert r["single"].update_error is None and 0 < r["ours:auto+bf16"].update_error < 0.05
assert r["ours:ring+qsgd:3"].update_error > 0.05 and r["ours:ring+qsgd:3"].wrong == 0, r["ours:ring+qsgd:3"]
assert all(r[n].update_error < 1e-5 for n in ("ours:ring/none", "ddp-hpcjobs", "hvd-hpcjobs")), r
assert sum(x.wrong for x in r.values()) == 1, r
print("ok", MPI.COMM_WORLD.Get_rank())
""", timeout=240)
    assert out.returncode == 0 and out.stdout.count("ok") == 3, out.stdout[-2000:] + out.stderr[-3000:]


def test_auto_rows_are_timed_after_auto_has_settled():
    """auto measures its candidates in place for its first calls at a size;
    the ours:auto rows are timed after that (as the allreduce sweep is), or
    their first rounds time auto's trials. The warmup steps until every
    bucket's size is settled."""
    out = mpirun_script(2, """
import torch
from mpi4py import MPI
import hpcjobs.bench.train as bench
from hpcjobs.collectives import auto
seen = []
real = bench._auto_settled
def spy(opt, algorithm, compression):
    check = real(opt, algorithm, compression)
    seen.append(opt)
    return check
bench._auto_settled = spy
torch.set_num_threads(1)
w = bench.Workload(model="mlp", width=64, batch_norm=False, input_size=40, image_size=0, num_classes=10, batch_size=8,
                   fusion_bytes=1 << 12, lr=0.01, seed=0)
results = bench.bench_train(MPI.COMM_WORLD, ["ours:auto"], w, 1, 1, 1)  # one warmup step: far from settled
opt = seen[0]
assert opt.num_buckets > 1 and results["ours:auto"].wrong == 0
assert all(auto.settled(b.buffer, "avg", opt._user_comm) for b in opt._buckets)
print("ok", MPI.COMM_WORLD.Get_rank())
""", timeout=240)
    assert out.returncode == 0 and out.stdout.count("ok") == 2, out.stdout[-2000:] + out.stderr[-3000:]


def test_the_json_rows_hold_null_where_a_ratio_has_no_row_to_be_against():
    """efficiency is NaN for single itself, and vs_ddp/vs_horovod where that
    row was not run: json.dump wrote a bare NaN, which is not JSON."""
    import json

    import pytest

    from hpcjobs.bench.train import Result, table

    results = {"single": Result("single", [100.0, 110.0]), "ours": Result("ours", [90.0, 92.0]),
               "ours:ring": Result("ours:ring", [90.0], update_error=float("inf")),  # not finite on some rank
               "ddp": Result("ddp", [80.0], update_error=0.0)}
    lines, rows = table(results, 2, list(results))
    text = json.dumps(rows, allow_nan=False)  # raised ValueError on the NaN
    single, ours, ring, ddp = json.loads(text)
    assert single["efficiency"] is None and ours["vs_ddp"] == pytest.approx(91.0 / 80.0) and ours["vs_horovod"] is None
    assert ours["efficiency"] == pytest.approx(91.0 / 105.0)
    assert single["update_error"] is None and ring["update_error"] is None and ddp["update_error"] == 0.0
    assert "the largest held here: inf)" in lines[-1]


def test_horovods_block_runs_without_the_others_threads():
    """Horovod is measured first, as one block. The others used to be built
    before it, so hvd-hpcjobs' controller (polling every millisecond on rank
    0, about 5% of a core here), our optimizer's and the backend's threads
    ran beside Horovod's rounds and taxed it alone. Each round's threads are
    recorded: none of ours while Horovod runs, and theirs after it."""
    from mpi4py import MPI

    from hpcjobs.bench.baselines import available
    from launch import require

    reason = available("horovod", MPI.COMM_WORLD)
    require(None if reason is None else f"Horovod is unavailable: {reason}")
    out = mpirun_script(2, """
import threading
import torch
from mpi4py import MPI
import hpcjobs.bench.train as bench
seen = {}
real = bench._time_round
def spy(runner, comm, batches, batch_size):
    ours = {t.name for t in threading.enumerate() if t.name.startswith("hpcjobs-")}
    seen.setdefault(runner.name, set()).update(ours)
    return real(runner, comm, batches, batch_size)
bench._time_round = spy
torch.set_num_threads(1)
w = bench.Workload(model="mlp", width=64, batch_norm=False, input_size=40, image_size=0, num_classes=10, batch_size=8,
                   fusion_bytes=1 << 12, lr=0.01, seed=0)
names = ["hvd-hpcjobs", "ours:ring/thread", "ddp-hpcjobs", "horovod"]
results = bench.bench_train(MPI.COMM_WORLD, names, w, 1, 1, 2)
assert all(results[n].wrong == 0 for n in names)
assert seen["horovod"] == set(), seen
assert {"hpcjobs-hvd-controller", "hpcjobs-allreduce", "hpcjobs-torch-backend"} <= seen["hvd-hpcjobs"], seen
print("threads checked on rank", MPI.COMM_WORLD.Get_rank())
""", timeout=240)
    assert out.returncode == 0 and out.stdout.count("threads checked on rank") == 2, \
        out.stdout[-2000:] + out.stderr[-3000:]
