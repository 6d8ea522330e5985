"""pycaffe's solvers: ``caffe.SGDSolver(path)`` and its siblings use their own update rule
whatever the file's ``type`` says (as the C++ classes do); ``caffe.get_solver(path)`` uses
the file's. Their ``net`` and ``test_nets`` are pycaffe Nets, run where the mode says
(``set_mode_gpu``, ``set_device``) when the solver was made; reshaping ``net``'s inputs
between steps rebuilds it with the update ops, as Caffe's next step reshapes its net."""

from __future__ import annotations

import os

from purine.caffe import solver as caffe_solver
from purine.formats import caffe_pb2 as pb
from purine.ops.solver import SOLVER_TYPES
from purine.parallel import scheme_for
from purine.pycaffe import mode
from purine.pycaffe.mode import settings
from purine.pycaffe.net import Net

# build_solver's keywords that choose the scheme (purine.parallel.scheme_for)
PARALLEL_KEYWORDS = ("replicas", "comm", "replica_locations", "placement")


class Solver(caffe_solver.Solver):
    """A solver read from a solver prototxt file: ``net``, ``test_nets``, ``iter``,
    ``step(n)``, ``solve(resume=None)``, ``snapshot()``, ``restore(path)``. Keywords as
    ``purine.parallel.build_solver``'s: ``replicas``, ``comm``, ``replica_locations``
    (data parallelism), ``placement`` (model parallelism; with replicas, the hybrid)."""

    solver_type: str | None = None  # the update rule a subclass forces

    def __init__(self, path: str | os.PathLike, *, param: pb.SolverParameter | None = None,
                 **kwargs):
        # ``param``: the file's message when the caller has read it already (get_solver)
        param = caffe_solver.read_solver(path if param is None else param)
        if self.solver_type is not None:
            param.type = self.solver_type
        if param.random_seed < 0 and settings.seed is not None:
            param.random_seed = settings.seed
        source = os.fspath(path)
        kwargs.setdefault("location", mode.location())
        named = {k: kwargs.pop(k) for k in PARALLEL_KEYWORDS if k in kwargs}
        if named.get("placement") is not None or named.keys() - {"placement"}:
            kwargs["scheme"] = scheme_for(**named)  # as purine.parallel.build_solver
        super().__init__(param, path=source if os.path.exists(source) else "", **kwargs)
        Net.adopt(self.net)
        for n in self.test_nets:
            Net.adopt(n)


def _solver_class(kind: str) -> type[Solver]:
    """pycaffe's ``<type>Solver``: a Solver that forces that update rule, as Caffe's class
    of the same name does."""
    return type(f"{kind}Solver", (Solver,), {
        "solver_type": kind, "__module__": __name__,
        "__doc__": f"A solver that trains with the {kind} update rule, whatever the file's "
                   "``type`` says."})


# One class per entry of purine.ops.solver.SOLVER_TYPES, named as Caffe's: SGDSolver,
# NesterovSolver, AdaGradSolver, RMSPropSolver, AdaDeltaSolver, AdamSolver.
_BY_TYPE: dict[str, type[Solver]] = {k: _solver_class(k) for k in SOLVER_TYPES}
globals().update({c.__name__: c for c in _BY_TYPE.values()})


def get_solver(path: str | os.PathLike) -> Solver:
    """The solver class of the file's ``type`` (SGD when unset), as Caffe's registry."""
    param = caffe_solver.read_solver(path)  # read once, handed on
    return _BY_TYPE.get(param.type, Solver)(path, param=param)
