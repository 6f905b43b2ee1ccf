"""Checkpoints of the asynchronous parameter server (``train --mode async
--checkpoint``): a cut every server agrees on, taken without a barrier.

With a checkpoint to write, every worker pauses after its push number c
whenever c is a multiple of its steps per epoch or of ``checkpoint_every``:
it tells every server so (TAG_PAUSE, after its last push -- MPI delivers one
sender's messages to one receiver in order, so each server has applied that
push before it reads the marker) and waits. A server all of whose live
workers have paused has applied every push they made and gets no more: its
shard, optimizer state and version are a cut that every server agrees on
(version c x W where no worker was lost). Servers 1.. send theirs to server 0 (TAG_CKPT), which
writes the checkpoint -- the whole model, every server's state, each
worker's count -- and tells every rank to go on, or, where any rank had
noted SIGTERM or SIGUSR1, to stop (TAG_GO). So a signal stops the run at the
next pause (an epoch's end, or ``--checkpoint-every`` pushes), where sync
stops at the next step; and with a checkpoint the workers meet at each pause,
where without one a fast worker goes on into the next epoch's batches.

A resumed run starts every worker after its push c and every server at the
saved version, with its shard, optimizer state, counts and (fixed delay) its
last k versions: in fixed-delay mode it is the run never stopped (the tests
hold it to the single-process reference). The audit's sums start again at
the resume (its counts cover the run). Server 0 writes the checkpoint on a
thread and goes on heartbeating: the ranks waiting for its go-on would take
a write longer than ``--peer-timeout`` for its death.

Asynchronous EASGD (``--mode easgd --easgd-form async``) counts its pauses
in each worker's own steps: a worker pauses after its last push (of H local
steps each) before an epoch's end or a multiple of ``checkpoint_every``, or
on it. Its workers have parameters of their own: before its marker each
sends server 0 its parameters, optimizer state and the schedule's clock
(TAG_CKPT, the same order rule), which the checkpoint keeps beside the
center. A resumed
worker goes on from them after its step c x H; one lost before, or done
before the run's last pause (its end falls between two pauses), resumes
from the center with a fresh optimizer.
"""

from __future__ import annotations

import pickle
import time

import numpy as np
import torch
from mpi4py import MPI

from . import checkpoint
from .data import opened_fingerprint
from .ps_common import TAG_CKPT, TAG_FINAL, TAG_GO, PeerLost
from .preempt import Stopped

__all__ = ["at_pause", "due", "go_on", "position", "read", "server_state", "load_server", "write", "worker_state"]


def due(ctx, pushes: int) -> bool:
    """Whether a worker pauses after its push number ``pushes``: an epoch's
    end or a multiple of ``checkpoint_every`` (in its own steps) comes
    before its next push does. In Downpour that is the push at it; in
    EASGD, H steps per push, the last push before it or on it, so every
    worker reaches the pause at the run's end too (after c pushes of each,
    c x W <= the run's)."""
    cfg, h = ctx.cfg, ctx.steps_per_push
    if not cfg.checkpoint or pushes <= 0:
        return False
    # a multiple of m among its steps c*h .. (c+1)*h - 1
    return any(m and ((pushes + 1) * h - 1) // m > (pushes * h - 1) // m for m in (ctx.spe, cfg.checkpoint_every))


def position(ctx, version: int) -> tuple[int, int]:
    """(epochs, step) of the run after ``version`` pushes of all workers, as
    its epoch lines count them: steps of every worker (the run's whole
    epochs once it has made its pushes). A worker lost makes the others'
    counts run ahead of it."""
    if version >= ctx.total:
        return ctx.cfg.epochs, 0
    return divmod(version * ctx.steps_per_push // ctx.workers, ctx.spe)


def stopped(ctx, go: dict) -> Stopped:
    """The Stopped every rank raises on a TAG_GO that says stop; ``lost``: a
    worker was lost, and the ranks cannot meet once more (``hpcjobs train``)."""
    e = Stopped(go["stop"], *position(ctx, go["version"]), ctx.cfg.checkpoint, go["written"])
    e.lost = go["lost"]
    return e


def send_bytes(comm: MPI.Intracomm, obj, dest: int, tag: int) -> None:
    """``obj`` pickled, as bytes: a server receives every message raw (ps_server._handle)."""
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    comm.Send([data, data.size, MPI.BYTE], dest=dest, tag=tag)


def isend_bytes(comm: MPI.Intracomm, obj, dest: int, tag: int) -> tuple:
    """:func:`send_bytes`, started: (request, buffer), the buffer held until the request completes."""
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    return comm.Isend([data, data.size, MPI.BYTE], dest=dest, tag=tag), data


def server_state(server) -> dict:
    """What server ``server`` resumes from (tensors, lists, numbers: read with weights_only)."""
    state = {"shard": torch.from_numpy(server.shard.copy()), "update": torch.from_numpy(server.update.state.copy()),
             "version": server.version, "clocks": [int(c) for c in server.clocks],
             "applied_by": [int(n) for n in server.applied_by], "stale_all": list(server.stale_all),
             "kept": None if server.kept is None else {v: torch.from_numpy(a.copy()) for v, a in server.kept.items()},
             "signum": server.noted.signum, "bytes": [server.ep.bytes_in, server.ep.bytes_out]}
    if server.k == 0:  # the epoch so far: its line after the resume counts it all
        ep, now = server.ep, time.monotonic()
        state["epoch_sums"] = [float(v) for v in ep.sums] + [ep.stale_sum, ep.stale_max, ep.pushes]
        state["wall"], state["epoch_s"] = now - server.t0, now - server.t_epoch
    return state


def worker_state(worker) -> dict:
    """What an EASGD worker resumes from: its own parameters, optimizer state and the schedule's clock."""
    return {"params": worker.ctx.flat.clone(), "optimizer": worker.opt.state_dict(), "clock": worker.clock}


def load_server(server, state: dict) -> None:
    server.shard[:] = state["shard"].numpy()
    server.update.state[:] = state["update"].numpy()
    server.version = state["version"]
    server.clocks[:] = max(state["clocks"])  # every worker resumes at the live ones' count (write)
    server.applied_by[:] = state["applied_by"]
    server.stale_all = list(state["stale_all"])
    if server.kept is not None:
        server.kept = {int(v): a.numpy().copy() for v, a in state["kept"].items()}
    # server k's bytes since server 0's last snapshot (a checkpoint before 2026-11-30 kept server 0's alone)
    server.ep.bytes_in, server.ep.bytes_out = state.get("bytes", [0, 0])
    if server.k == 0:
        s = state["epoch_sums"]
        server.ep.sums[:] = s[:3]
        server.ep.stale_sum, server.ep.stale_max, server.ep.pushes = s[3], s[4], int(s[5])
        if len(s) == 8:
            server.ep.bytes_in, server.ep.bytes_out = s[6], s[7]
        server.wall0, server.epoch0 = state["wall"], state.get("epoch_s", 0.0)


def write(ctx, history: list[dict], states: list[dict], pushes: int, trim: bool = True,
          workers: dict | None = None) -> bool:
    """Server 0: the checkpoint of a pause after each live worker's push
    ``pushes``, from every server's ``states`` (in server order); the model
    is every shard. Every worker resumes after push ``pushes``, one lost
    before too (its count behind the others' would hold them at every
    pause, with a staleness bound for good). ``workers``: EASGD's, each
    paused worker's own state by its number; one lost or done resumes from the center.
    ``trim``: a resumed run cuts the metrics file back to where it ends now.
    Nothing is written where a parameter is not finite (a run that
    diverged): the last checkpoint stays, as in sync. Returns whether it was."""
    import sys

    for k, state in enumerate(states):
        ctx.flat[ctx.shard(k)] = state["shard"]
    cfg = ctx.cfg
    epoch, step = position(ctx, states[0]["version"])
    if not all(bool(torch.isfinite(t).all()) for t in [ctx.flat, *(s["params"] for s in (workers or {}).values())]):
        print(f"hpcjobs: warning: parameters not finite after epoch {epoch} step {step}: {cfg.checkpoint} not "
              "written (the last one, if any, stays)", file=sys.stderr, flush=True)
        return False
    ranks = states + [{"pushes": pushes} for _ in range(ctx.workers)]
    if workers is not None:
        center = {"params": ctx.flat.clone(), "optimizer": None, "clock": ctx.elastic_step(states[0]["version"])}
        for w in range(ctx.workers):
            ranks[ctx.servers + w].update(workers.get(w, center))
    checkpoint.save_checkpoint(cfg.checkpoint, {
        "version": checkpoint.CHECKPOINT_VERSION, "epoch": epoch, "step": step,
        "config": checkpoint.config_dict(cfg), "data": opened_fingerprint(cfg),
        "model": {k: v.clone() for k, v in ctx.model.state_dict().items()},
        "optimizer": {}, "history": history, "ranks": ranks, "scaler": None, "servers": ctx.servers,
        "metrics_bytes": checkpoint.metrics_size(cfg) if trim else None})
    return True


def read(ctx) -> dict | None:
    """With ``resume``: this rank's state from the checkpoint (collective;
    server 0 reads it and tells every rank an error first), or None where
    there is none. Server 0's also holds the history."""
    cfg, comm = ctx.cfg, ctx.comm
    if not cfg.resume:
        return None
    states, error = None, None
    if comm.Get_rank() == 0:
        try:
            state = checkpoint.load_checkpoint(cfg.checkpoint)
            checkpoint.check_same_experiment(cfg, state, comm.Get_size())
            # (the mode and EASGD's form are resume keys: check_same_experiment refused another already)
            if state.get("servers") != ctx.servers or "version" not in state["ranks"][0]:
                raise checkpoint.CheckpointError(f"{cfg.checkpoint} is not a checkpoint of mode "
                                                 f"{'easgd (async form)' if ctx.elastic else 'async'} with "
                                                 f"{ctx.servers} server(s)")
            states = state["ranks"]
            states[0] = dict(states[0], history=state["history"])
            if cfg.metrics and state["config"].get("metrics") == cfg.metrics and state["metrics_bytes"] is not None:
                # the epochs recorded: after a worker was lost, fewer than its count of pushes makes
                checkpoint.trim_metrics(cfg.metrics, state["metrics_bytes"], len(state["history"]))
            if not cfg.quiet:
                where = f", step {state['step']} of epoch {state['epoch'] + 1}" if state["step"] else ""
                print(f"# train: resumed from {cfg.checkpoint} after epoch {state['epoch']}{where} (version "
                      f"{state['ranks'][0]['version']}, each worker after its push {state['ranks'][-1]['pushes']})",
                      flush=True)
        except FileNotFoundError:
            states = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    error = comm.bcast(error, root=0)
    if error:
        raise checkpoint.CheckpointError(error)
    if not comm.bcast(states is not None, root=0):
        checkpoint.refuse_unseen(cfg.checkpoint, comm)
        return None
    return comm.scatter(states, root=0)


def at_pause(server) -> None:
    """Every live worker of ``server`` (ps_server.Server) has paused. Server
    k: its state to server 0, once. Server 0, with every server's: the
    checkpoint, then go on (or stop) to every rank."""
    if server.k:
        if server.state_sent is None:  # nonblocking: server 0 may be asking for this shard to test meanwhile
            server.state_sent = isend_bytes(server.comm, server_state(server), 0, TAG_CKPT)
        return
    missing = [k for k in range(1, server.S) if k not in server.states]
    if missing:  # a server that died meanwhile sends no state (under mpirun --enable-recovery nothing else ends it)
        now = time.monotonic()
        for k in missing:
            if now - server.heard_servers[k] > server.cfg.peer_timeout:
                raise PeerLost(f"server rank {k} sent nothing for {server.cfg.peer_timeout:g} s: presumed lost")
        return
    # EASGD: each paused worker's own state came before its marker (one sender's messages arrive in order)
    workers = {w: server.states[server.S + w] for w in server.paused if server.S + w in server.states} \
        if server.ctx.elastic else None
    # the run's last epoch (_apply records the others), its line in the checkpoint; at the run's end the last
    # epoch's, as _finish counts it (EASGD: the run's pushes are its steps rounded down to a whole move)
    epochs = server.cfg.epochs if server.version >= server.ctx.total else server.ctx.epochs_done(server.version)
    if epochs > len(server.history):
        server._record(epochs)
    states = [server_state(server)] + [server.states[k] for k in range(1, server.S)]  # servers 1..: by rank
    pushes = max(count for count, _ in server.paused.values())
    signals = [server.noted.signum, *(s for _, s in server.paused.values()), *(st["signum"] for st in states)]
    # at the run's end the audit is yet to go into the last line: a resumed run must not cut it
    # heartbeats meanwhile: a write longer than --peer-timeout must not make the waiting ranks presume it dead
    written = server._heartbeat.during(lambda: write(server.ctx, server.history, states, pushes,
                                                     trim=server.version < server.ctx.total, workers=workers))
    now = time.monotonic()
    for w in server.paused:  # their silence meanwhile was this rank's: it heard nothing while it wrote
        server.heard[w] = max(server.heard[w], now)
    go = {"stop": next((s for s in signals if s), 0), "pushes": pushes, "version": server.version,
          "lost": bool(server.lost), "written": written}
    for k in range(1, server.S):
        send_bytes(server.comm, go, k, TAG_GO)
    for w in server.paused:
        if w not in server.lost:
            server.comm.send(go, dest=server.S + w, tag=TAG_GO)
    if go["stop"]:  # a worker done already (the others were lost) waits for the history: it stops too
        for w in server.done:
            server.comm.send(go, dest=server.S + w, tag=TAG_FINAL)
    go_on(server, go)


def go_on(server, go: dict) -> None:
    """The pause is over (the checkpoint written); a stop where ``go`` says so.
    A worker's marker for the next pause may have come before server 0's go
    for this one: it stays."""
    server.paused = {w: p for w, p in server.paused.items() if p[0] > go["pushes"]}
    if server.state_sent is not None:  # server 0 had it before it said go: done at once
        server.state_sent[0].Wait()
    server.states, server.state_sent = {}, None
    if go["stop"]:
        server.go, server.stopped = go, True
