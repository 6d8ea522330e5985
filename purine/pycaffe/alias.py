"""``import caffe`` giving purine.pycaffe: a finder placed first on ``sys.meta_path`` answers
for the name ``caffe`` and every ``caffe.<name>`` with purine.pycaffe and its submodules (the
same module objects), ahead of any ``caffe`` folder on ``sys.path``. A real Caffe (a
``caffe`` package with its compiled ``_caffe`` extension) is shadowed only when asked."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

PREFIX = "purine.pycaffe"


def _target(fullname: str) -> str | None:
    """The purine module that stands for ``fullname``, or None for names not of caffe."""
    if fullname == "caffe":
        return PREFIX
    if fullname.startswith("caffe."):
        return PREFIX + fullname[len("caffe"):]
    return None


class CaffeAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The finder and loader of the ``caffe`` names. The module a name gets is the purine
    module itself (imported under its own name, so it exists once); its ``__spec__`` stays
    its own."""

    def find_spec(self, fullname: str, path=None, target=None):  # noqa: ARG002
        real = _target(fullname)
        if real is None:
            return None
        try:
            found = importlib.util.find_spec(real)
        except ModuleNotFoundError:
            found = None
        if found is None:
            return None  # `import caffe.x` without a purine.pycaffe.x: ModuleNotFoundError
        return importlib.machinery.ModuleSpec(fullname, self, origin=found.origin)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(_target(spec.name))  # type: ignore[arg-type]
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system has just set __spec__ to the alias's: the module keeps its own.
        module.__spec__ = module.__spec__.loader_state


def installed() -> bool:
    return any(isinstance(f, CaffeAlias) for f in sys.meta_path)


def install() -> None:
    """Put the finder first on ``sys.meta_path``, drop a ``caffe`` imported before (purine's
    minimal stand-in for Python layers) and give the purine.pycaffe modules already loaded
    their ``caffe`` names, so ``sys.modules["caffe"]`` is purine.pycaffe from now on."""
    if not installed():
        sys.meta_path.insert(0, CaffeAlias())
    for name in [n for n in sys.modules if _target(n) is not None]:
        if not getattr(sys.modules[name], "__name__", "").startswith(PREFIX):
            del sys.modules[name]
    for name, module in list(sys.modules.items()):
        if name == PREFIX or name.startswith(PREFIX + "."):
            sys.modules.setdefault("caffe" + name[len(PREFIX):], module)
    importlib.import_module("caffe")


def load_ipython_extension(ipython) -> None:  # noqa: ARG001 - IPython's hook signature
    """``%load_ext purine.pycaffe.alias`` in a running notebook: ``import caffe`` from then
    on is purine.pycaffe."""
    install()
