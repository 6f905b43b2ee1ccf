"""What the ``hvd`` API test modules share (each imports it): an
initialized ``hpcjobs.horovod.torch`` before every test, and a check that
a flag holds on every rank."""

import pytest
import torch
from mpi4py import MPI

import hpcjobs.horovod.torch as hvd

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def initialized():
    hvd.init()


def every_rank(flag: bool) -> bool:
    return MPI.COMM_WORLD.allreduce(int(flag), op=MPI.MIN) == 1
