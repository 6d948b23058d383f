"""`import deepspeed` served by ringzero: a meta-path finder whose modules resolve names from served.py.

    from zero_from_scratch.as_deepspeed import finder
    finder.install()          # first on sys.meta_path; the installed DeepSpeed is never imported
    import deepspeed          # a ServedModule; deepspeed.comm, deepspeed.zero, ... the same

A ServedModule's attribute lookup (PEP 562-style __getattr__) goes: served name → import the
ringzero target (importlib of a string from the table: this is where the runner reaches
pipeline_parallel, which zero_from_scratch may not import) and cache it; a served submodule →
import it; a REFUSED name → a placeholder class that fails at its first call or attribute; any
other name → NotServedAttributeError, an AttributeError so hasattr() probing keeps working.
Importing a deepspeed submodule the table does not list raises NotServedImportError.
With RINGZERO_DEEPSPEED_DEFER=1 (tests/ds_bulk only: DeepSpeed's test files import internals at
module level) an unlisted module or name is a placeholder that fails at its first use instead, so
each test is judged by what it uses; the runner itself never sets it.
Cost: one import per name on first use, then a dict lookup.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types

from zero_from_scratch.as_deepspeed import served

HERE = os.path.dirname(os.path.abspath(__file__))
DEFER = os.environ.get("RINGZERO_DEEPSPEED_DEFER") == "1"   # see the module docstring
# the file that serves each module (its __file__: tests and users can see whose code answers)
FILES = {"deepspeed": "top.py", "deepspeed.comm": "comm.py", "deepspeed.accelerator": "accelerator.py",
         "deepspeed.utils": "utils.py", "deepspeed.utils.logging": "utils.py", "deepspeed.runtime.utils": "utils.py",
         "deepspeed.utils.zero_to_fp32": "zero_to_fp32.py", "deepspeed.runtime.zero.utils": "zero_utils.py",
         "deepspeed.utils.pin_memory_tracker": "accelerator.py", "deepspeed.utils.groups": "utils.py",
         "deepspeed.checkpoint.constants": "constants.py"}


def message(name: str, what: str, nearest: str) -> str:
    return (f"{name} is not served by ringzero (DeepSpeed {served.VERSION} API): DeepSpeed would {what}; "
            f"nearest ringzero way: {nearest}")


class NotServedError(NotImplementedError):
    """A DeepSpeed API ringzero does not serve, used (called)."""


class NotServedAttributeError(AttributeError):
    """A DeepSpeed name ringzero does not serve, looked up (an AttributeError: hasattr() says False)."""


class NotServedImportError(ModuleNotFoundError):
    """A DeepSpeed module ringzero does not serve, imported."""


class _Refused(type):
    """Metaclass of the placeholders: calling one, or reading an attribute, raises the one-line error;
    its repr is that line, so a caller that swallows the error (getattr with a default, as pytest's
    monkeypatch) still names the refusal in its own message."""

    def __call__(cls, *args, **kwargs):
        raise NotServedError(cls._message)

    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise NotServedAttributeError(cls._message)

    def __repr__(cls):
        return f"<{cls._message}>"

    def __format__(cls, spec):     # a refused constant in an f-string (a file name, a key) is a use
        raise NotServedError(cls._message)


def refused(name: str) -> type:
    """A class standing for `name`: importable, isinstance() of it is False, any use raises (on an instance
    made through __new__ too, any attribute it was not given). Its
    metaclass is named by the refusal too: a use that reports the placeholder's type (a constant
    used as an attribute name: "must be string, not '...'") names what is not served."""
    what, nearest = served.REFUSED.get(name, (f"serve {name}", "none (not in the table of served names)"))
    meta = type(_Refused)(f"{name} is not served by ringzero", (_Refused,), {})
    return meta(name.rpartition(".")[2], (), {"_message": message(name, what, nearest),
                                              "__module__": name.rpartition(".")[0], "__getattr__": _refused_attr})


def _refused_attr(self, attr):
    """An instance made without calling the placeholder (Cls.__new__(Cls), object.__new__(Cls)): what
    it was given reads back, anything else is the refusal."""
    if attr.startswith("__"):
        raise AttributeError(attr)
    raise NotServedAttributeError(type(self)._message)


def resolve(name: str, target: str, star: bool = False):
    """Import the ringzero object behind `name` ("module:attribute"); NotServedAttributeError if missing.
    star: `target` came from a "module:*" entry, so its attribute must be in the module's __all__."""
    mod_name, _, attr = target.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name is None or not mod_name.startswith(e.name):
            raise
        raise NotServedAttributeError(message(name, "serve it", f"{target} (not in this checkout)")) from None
    if star and attr not in getattr(mod, "__all__", ()):
        raise NotServedAttributeError(message(name, f"serve {name}", f"the names of {mod_name}.__all__"))
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise NotServedAttributeError(message(name, "serve it", f"{target} (not in this checkout)")) from None


class ServedModule(types.ModuleType):
    """A `deepspeed` module whose attributes come from the table (see the module docstring)."""

    def __getattr__(self, attr: str):
        name = f"{self.__name__}.{attr}"
        if attr.startswith("__"):
            raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")
        if name in served.MODULES:
            return importlib.import_module(name)
        target = served.target_of(name)
        if target is not None:
            value = resolve(name, target, star=name not in served.SERVED)
        elif name in served.REFUSED or DEFER:
            value = refused(name)
        else:
            raise NotServedAttributeError(message(
                name, f"serve {name}", "the served names: python -m zero_from_scratch.as_deepspeed --list"))
        setattr(self, attr, value)
        return value

    def __setattr__(self, attr: str, value) -> None:
        """A refused name, or a PATCH_REFUSED one, replaced (unittest.mock.patch, monkeypatch.setattr) would
        change nothing ringzero runs: that fails with the name's one line; its own placeholder or served object
        (the cache above, a patch's undo) binds."""
        name = f"{self.__name__}.{attr}"
        if name in served.REFUSED and not isinstance(value, _Refused):
            raise NotServedError(refused(name)._message)
        if name in served.PATCH_REFUSED and value is not resolve(name, served.SERVED[name]):
            raise NotServedError(message(f"replacing {name}", *served.PATCH_REFUSED[name]))
        super().__setattr__(attr, value)

    def __dir__(self):
        mine = [n for n in (*served.SERVED, *served.REFUSED, *served.MODULES) if n.rpartition(".")[0] == self.__name__]
        return sorted(set(super().__dir__()) | {n.rpartition(".")[2] for n in mine if not n.endswith("*")})


class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `deepspeed` and its served submodules before the installed package can be found."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        if fullname not in served.MODULES and not DEFER:
            raise NotServedImportError(message(fullname, f"import {fullname}",
                                               "the served modules: python -m zero_from_scratch.as_deepspeed --list"),
                                       name=fullname)
        origin = os.path.join(HERE, FILES.get(fullname, "__init__.py"))
        spec = importlib.machinery.ModuleSpec(fullname, self, origin=origin, is_package=True)
        spec.has_location = True
        return spec

    def create_module(self, spec):
        return ServedModule(spec.name)

    def exec_module(self, module):
        module.__file__ = module.__spec__.origin
        module.__path__ = []
        if module.__name__ == "deepspeed":
            module.__version__ = served.VERSION
            module.version = served.VERSION
            # deepspeed/__init__.py's version names; a build outside git records "unknown" (the installed one does)
            module.__version_major__, module.__version_minor__, module.__version_patch__ = \
                (int(x) for x in served.VERSION.split("."))
            module.__git_hash__ = module.__git_branch__ = "unknown"
        if module.__name__ == "deepspeed.ops":       # a dunder: __getattr__ does not serve it
            module.__compatible_ops__ = dict(importlib.import_module(f"{served._R}.constants").COMPATIBLE_OPS)


FINDER = Finder()


def install() -> None:
    """Put the finder first on sys.meta_path; refuse if the installed DeepSpeed was imported already."""
    real = sorted(m for m, v in sys.modules.items()
                  if (m == "deepspeed" or m.startswith("deepspeed.")) and not isinstance(v, ServedModule))
    if real:
        raise RuntimeError(f"the installed DeepSpeed is already imported ({', '.join(real[:3])}): "
                           "install the ringzero finder before anything imports deepspeed")
    if FINDER not in sys.meta_path:
        sys.meta_path.insert(0, FINDER)


def uninstall() -> None:
    """Remove the finder and every served deepspeed module (tests use this to restore the process)."""
    if FINDER in sys.meta_path:
        sys.meta_path.remove(FINDER)
    for m in [m for m, v in sys.modules.items() if isinstance(v, ServedModule)]:
        del sys.modules[m]
