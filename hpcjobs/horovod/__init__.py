"""Horovod-compatible APIs on hpcjobs' collectives; ``hpcjobs.horovod.torch``
is a drop-in for ``horovod.torch``."""
