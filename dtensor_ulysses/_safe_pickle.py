"""An unpickler that never runs code from the file: an explicit set of admitted classes.

A pickle is a small program: its ``GLOBAL``/``STACK_GLOBAL`` opcodes look up any importable
name, ``REDUCE``, ``NEWOBJ``, ``OBJ`` and ``INST`` call what they looked up, and ``BUILD`` calls
an object's ``__setstate__``. Checkpoints are shared between people and machines, so the files
a resume reads that are plain pickles (DCP's ``.metadata``) go through :class:`SafeUnpickler`:

* a global is resolved only when ``(module, name)`` is in the caller's admitted set, ``name``
  has no dot (no attribute walk such as ``Metadata.__init__.__class__``), the module is looked
  up in ``sys.modules`` or imported by its exact name, the object is read from the module's
  own namespace (no ``getattr`` chain) and carries that very ``__module__`` and
  ``__qualname__`` (so an alias to something else is refused);
* constants (torch's dtypes, which have no ``__qualname__``) are admitted only as the exact
  objects the caller names;
* every opcode that calls something (``REDUCE``, ``NEWOBJ``, ``NEWOBJ_EX``, ``OBJ``, ``INST``)
  calls only an admitted object; ``BUILD`` fills only an instance of an admitted class, through
  its ``__setstate__`` only where the caller vouches for that method;
* ``APPEND(S)``, ``SETITEM(S)`` and ``ADDITEMS`` write only into a plain list, dict or set;
* the extension registry (``EXT1/2/4``) and persistent ids (``PERSID``, ``BINPERSID``) are
  refused.

Anything else raises :class:`UnsafePickle`, a ``pickle.UnpicklingError``, before it happens.
The pure-Python unpickler (``pickle._Unpickler``, in the standard library since Python 3.0) is
used because its opcodes can be overridden one by one; the files read this way are small.
"""

from __future__ import annotations

import collections
import importlib
import io
import pickle
import sys
from collections.abc import Mapping
from typing import Any, BinaryIO

__all__ = ["SafeUnpickler", "UnsafePickle", "safe_loads"]


class UnsafePickle(pickle.UnpicklingError):
    """The pickle asks for something outside the admitted set (code could run)."""


# the pure-Python unpickler (its opcodes are methods in a dispatch table); typed as Any because
# typeshed does not describe it
_PyUnpickler: Any = pickle._Unpickler
_CONTAINERS_LIST = (list,)
_CONTAINERS_DICT = (dict, collections.OrderedDict)


class SafeUnpickler(_PyUnpickler):
    """Unpickle admitting only the given classes/functions and constants.

    Args:
        file: a binary file opened for reading.
        admitted: ``(module, qualname)`` pairs of the classes and functions the file may name
            and call; a qualname with a dot is refused even if listed.
        constants: ``(module, name) -> object`` for values that are looked up but never
            called (e.g. ``("torch", "float32") -> torch.float32``).
        setstate_ok: the admitted classes whose ``__setstate__`` may run (reviewed to only
            assign attributes).
    """

    dispatch = dict(_PyUnpickler.dispatch)

    def __init__(
        self,
        file: BinaryIO,
        admitted: frozenset[tuple[str, str]],
        *,
        constants: Mapping[tuple[str, str], Any] | None = None,
        setstate_ok: frozenset[tuple[str, str]] = frozenset(),
    ) -> None:
        super().__init__(file)
        self._admitted = admitted
        self._constants = dict(constants or {})
        self._setstate_ok = setstate_ok
        self._callables: dict[int, Any] = {}  # id -> object resolved from the admitted set

    # -- lookups ------------------------------------------------------------------------------
    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in self._constants:
            return self._constants[key]
        if "." in name or key not in self._admitted:
            raise UnsafePickle(f"it names {module}.{name}, which is not admitted")
        mod = sys.modules.get(module)
        if mod is None:
            mod = importlib.import_module(module)
        obj = vars(mod).get(name)
        if (
            obj is None
            or getattr(obj, "__module__", None) != module
            or getattr(obj, "__qualname__", None) != name
        ):
            raise UnsafePickle(f"{module}.{name} does not resolve to the admitted object")
        self._callables[id(obj)] = obj
        return obj

    def _check_callable(self, func: Any, opcode: str) -> None:
        if self._callables.get(id(func)) is not func:
            raise UnsafePickle(f"its {opcode} opcode calls {func!r}, which is not admitted")

    # -- opcodes that call ------------------------------------------------------------------
    def load_reduce(self) -> None:
        self._check_callable(self.stack[-2], "REDUCE")
        super().load_reduce()

    dispatch[pickle.REDUCE[0]] = load_reduce

    def load_newobj(self) -> None:
        self._check_callable(self.stack[-2], "NEWOBJ")
        super().load_newobj()

    dispatch[pickle.NEWOBJ[0]] = load_newobj

    def load_newobj_ex(self) -> None:
        self._check_callable(self.stack[-3], "NEWOBJ_EX")
        super().load_newobj_ex()

    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex

    def _instantiate(self, klass: Any, args: Any) -> None:  # OBJ and INST
        self._check_callable(klass, "OBJ/INST")
        super()._instantiate(klass, args)

    def load_build(self) -> None:
        inst = self.stack[-2]
        cls = type(inst)
        if self._callables.get(id(cls)) is not cls:
            raise UnsafePickle(f"its BUILD opcode fills a {cls.__name__}, which is not admitted")
        key = (cls.__module__, cls.__qualname__)
        if "__setstate__" in (getattr(inst, "__dict__", None) or {}):  # planted by a BUILD
            raise UnsafePickle(f"its BUILD opcode would run a {cls.__qualname__}'s own callable")
        if getattr(inst, "__setstate__", None) is not None and key not in self._setstate_ok:
            raise UnsafePickle(f"its BUILD opcode would run {cls.__qualname__}.__setstate__")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build

    # -- opcodes that write into containers ---------------------------------------------------
    def _container(self, kinds: tuple[type, ...], opcode: str) -> None:
        """APPENDS/SETITEMS/ADDITEMS: the target sits just below the mark."""
        target = self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None
        if type(target) not in kinds:
            raise UnsafePickle(f"its {opcode} opcode writes into a {type(target).__name__}")

    def load_append(self) -> None:
        if type(self.stack[-2]) not in _CONTAINERS_LIST:
            raise UnsafePickle(f"its APPEND opcode writes into a {type(self.stack[-2]).__name__}")
        super().load_append()

    dispatch[pickle.APPEND[0]] = load_append

    def load_appends(self) -> None:
        self._container(_CONTAINERS_LIST, "APPENDS")
        super().load_appends()

    dispatch[pickle.APPENDS[0]] = load_appends

    def load_setitem(self) -> None:
        if type(self.stack[-3]) not in _CONTAINERS_DICT:
            raise UnsafePickle(f"its SETITEM opcode writes into a {type(self.stack[-3]).__name__}")
        super().load_setitem()

    dispatch[pickle.SETITEM[0]] = load_setitem

    def load_setitems(self) -> None:
        self._container(_CONTAINERS_DICT, "SETITEMS")
        super().load_setitems()

    dispatch[pickle.SETITEMS[0]] = load_setitems

    def load_additems(self) -> None:
        self._container((set,), "ADDITEMS")
        super().load_additems()

    dispatch[pickle.ADDITEMS[0]] = load_additems

    # -- refused outright ---------------------------------------------------------------------
    def _refuse(self) -> None:
        raise UnsafePickle("it uses the extension registry or persistent ids (EXT/PERSID)")

    for _op in (pickle.EXT1, pickle.EXT2, pickle.EXT4, pickle.PERSID, pickle.BINPERSID):
        dispatch[_op[0]] = _refuse
    del _op

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle("it uses persistent ids, which are not admitted")


def safe_loads(
    data: bytes,
    admitted: frozenset[tuple[str, str]],
    *,
    constants: Mapping[tuple[str, str], Any] | None = None,
    setstate_ok: frozenset[tuple[str, str]] = frozenset(),
) -> Any:
    """:class:`SafeUnpickler` over ``data``; raises :class:`UnsafePickle` on anything else.

    Malformed input raises what the unpickler raises (``UnpicklingError``, ``EOFError``, ...).
    """
    return SafeUnpickler(
        io.BytesIO(data), admitted, constants=constants, setstate_ok=setstate_ok
    ).load()
