"""Packages that re-export their public names on first use.

``hpcjobs.collectives``, ``.compression``, ``.training`` and ``hpcjobs`` itself
import a submodule only when one of its names is asked for. Importing the
package then starts no MPI, so the command line can read the names it
offers (``hpcjobs.collectives.names``, ``hpcjobs.training.config``) and check
a job's flags on a login node; ``from hpcjobs.collectives import allreduce``
works as it would with eager imports.
"""

from __future__ import annotations

import sys
from importlib import import_module


def exports(package: str, where: dict[str, str | None]):
    """``(__all__, __getattr__, __dir__)`` for ``package``, whose public
    names live in the submodules ``where`` gives (name -> submodule; None
    for a name that is a submodule itself)."""

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if where[name] is None:
            return import_module(f"{package}.{name}")
        value = getattr(import_module(f"{package}.{where[name]}"), name)
        # Kept in the package, so the next ``package.name`` is a plain
        # attribute: ``hc.allreduce(x)`` in a loop would otherwise pay this
        # function (about 2 us) on every call.
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(where))

    return sorted(where), __getattr__, __dir__
