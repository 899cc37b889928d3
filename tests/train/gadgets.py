"""A corpus of pickle gadgets, written by hand opcode by opcode, and the ways to plant them in
each file of a checkpoint that a resume reads.

Each gadget's payload is ``os.mkdir(marker)`` (no shell): if the directory exists afterwards,
code from the file ran. ``GADGETS`` maps a name to ``(bytes_for(marker), runs_in_plain_pickle)``:
the second item says that ``pickle.loads`` alone runs the payload (the tests check it does, so
a gadget that is refused is known to be a real one). Planters (:func:`plant`) replace a whole
file (``.metadata``), the pickle inside a ``torch.save`` archive (``trainer.pt``,
``rng_rank0.pt``), or one item inside a ``.distcp`` file (a non-tensor item or a tensor item,
with the ``.metadata`` offsets rewritten), then reseal the manifest as an attacker would (a
CRC is not a signature).
"""

from __future__ import annotations

import copyreg
import io
import pickle as P
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["EXT_CODE", "FILES", "GADGETS", "plant", "reseal", "with_extension"]

META = "torch.distributed.checkpoint.metadata"
EXT_CODE = 0x5A17


def _s(text: str) -> bytes:
    raw = text.encode()
    return P.BINUNICODE + struct.pack("<I", len(raw)) + raw


def _g(module: str, name: str) -> bytes:
    return _s(module) + _s(name) + P.STACK_GLOBAL


def _call(func: bytes, *args: bytes) -> bytes:
    return func + P.MARK + b"".join(args) + P.TUPLE + P.REDUCE


def _wrap(body: bytes) -> bytes:
    return P.PROTO + b"\x04" + body + P.STOP


def _dotted(m: str) -> bytes:  # an attribute walk from an admitted module to os.mkdir
    return _wrap(_call(_g(META, "torch.os.mkdir"), _s(m)))


def _function_type(m: str) -> bytes:  # the issue's: the function type, by a dotted name
    init = "Metadata.__init__"
    code, env = _g(META, f"{init}.__code__"), _g(META, f"{init}.__globals__")
    return _wrap(_call(_g(META, f"{init}.__class__"), code, env))


def _code_type(m: str) -> bytes:
    return _wrap(_g(META, "Metadata.__init__.__code__.__class__"))


def _getattr(m: str) -> bytes:
    imp = _call(_g("builtins", "__import__"), _s("os"))
    return _wrap(_call(_call(_g("builtins", "getattr"), imp, _s("mkdir")), _s(m)))


def _copyreg(m: str) -> bytes:  # Popen.__init__(obj, ("mkdir", m)) via copyreg
    popen = _g("subprocess", "Popen")
    args = P.MARK + _s("mkdir") + _s(m) + P.TUPLE
    return _wrap(_call(_g("copyreg", "_reconstructor"), popen, popen, args))


def _partial(m: str) -> bytes:
    part = _call(_g("functools", "partial"), _g("os", "mkdir"), _s(m))
    return _wrap(part + P.EMPTY_TUPLE + P.REDUCE)


def _operator(m: str) -> bytes:  # methodcaller("mkdir", m)(itemgetter("os")(sys.modules))
    os_mod = _call(_call(_g("operator", "itemgetter"), _s("os")), _g("sys", "modules"))
    return _wrap(_call(_call(_g("operator", "methodcaller"), _s("mkdir"), _s(m)), os_mod))


def _build_setstate(m: str) -> bytes:  # an admitted instance given a __setstate__, then BUILD
    inst = _g(META, "StorageMeta") + P.EMPTY_TUPLE + P.NEWOBJ
    state = P.EMPTY_DICT + _s("__setstate__") + _g("os", "mkdir") + P.SETITEM
    return _wrap(inst + state + P.BUILD + _s(m) + P.BUILD)


def _build_admitted_only(m: str) -> bytes:  # the same with an admitted callable only
    inst = _g(META, "StorageMeta") + P.EMPTY_TUPLE + P.NEWOBJ
    state = P.EMPTY_DICT + _s("__setstate__") + _g("torch", "Size") + P.SETITEM
    return _wrap(inst + state + P.BUILD + P.EMPTY_LIST + P.BUILD)


def _inst(m: str) -> bytes:  # protocol 0: INST calls what it names
    return b"(S'" + m.encode() + b"'\nios\nmkdir\n."


def _obj(m: str) -> bytes:
    return _wrap(P.MARK + _g("os", "mkdir") + _s(m) + P.OBJ)


def _ext(m: str) -> bytes:  # the extension registry (copyreg.add_extension) names os.mkdir
    return _wrap(P.EXT2 + struct.pack("<H", EXT_CODE) + P.MARK + _s(m) + P.TUPLE + P.REDUCE)


def _persid(m: str) -> bytes:
    return _wrap(_s(m) + P.BINPERSID)


def _nested(m: str) -> bytes:  # a pickle inside the pickle
    inner = _dotted(m)
    return _wrap(_call(_g("pickle", "loads"), P.BINBYTES + struct.pack("<I", len(inner)) + inner))


def _append_into(m: str) -> bytes:  # APPENDS into an admitted object (calls its extend)
    inst = _g("collections", "OrderedDict") + P.EMPTY_TUPLE + P.REDUCE
    return _wrap(inst + P.MARK + _s(m) + P.APPENDS)


GADGETS: dict[str, tuple[Callable[[str], bytes], bool]] = {
    "dotted-name": (_dotted, True),
    "function-type": (_function_type, False),
    "code-type": (_code_type, False),
    "builtins-getattr": (_getattr, True),
    "copyreg": (_copyreg, True),
    "functools-partial": (_partial, True),
    "operator-getters": (_operator, True),
    "build-setstate": (_build_setstate, True),
    "build-setstate-admitted": (_build_admitted_only, False),
    "inst": (_inst, True),
    "obj": (_obj, True),
    "ext": (_ext, True),
    "persid": (_persid, False),
    "nested-pickle": (_nested, True),
    "appends-into-admitted": (_append_into, False),
}


class with_extension:  # noqa: N801 - a context manager, named like one
    """Register ``os.mkdir`` as extension :data:`EXT_CODE` (what the EXT gadget needs)."""

    def __enter__(self):
        copyreg.add_extension("os", "mkdir", EXT_CODE)

    def __exit__(self, *exc):
        copyreg.remove_extension("os", "mkdir", EXT_CODE)


def _archive_with(pickled: bytes) -> bytes:
    """A ``torch.save`` archive of a small dict whose ``data.pkl`` is ``pickled``."""
    buf = io.BytesIO()
    torch.save({"x": 1}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = pickled if info.filename.endswith("/data.pkl") else src.read(info)
            dst.writestr(info.filename, data)
    return out.getvalue()


def reseal(step_dir: Path) -> None:
    """Rewrite the manifest to match the files as they are now (what an attacker can do)."""
    from dtensor_ulysses.train import manifest

    manifest.write(step_dir, manifest.checksum(step_dir, manifest.files_of(step_dir)))


def _replace_item(step_dir: Path, tensor: bool, data: bytes) -> None:
    """Replace the first non-tensor (or tensor) item of the ``.distcp`` files with
    ``data``, moving the items after it and rewriting ``.metadata``'s offsets."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from dtensor_ulysses.train import checkpoint as ckpt

    md = ckpt.read_dcp_metadata(step_dir)
    is_bytes = {f for f, m in md.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata)}
    target = min(
        (k for k, i in md.storage_data.items() if (k.fqn in is_bytes) != tensor),
        key=lambda k: (md.storage_data[k].relative_path, md.storage_data[k].offset),
    )
    rel = md.storage_data[target].relative_path
    items = sorted(
        ((k, i) for k, i in md.storage_data.items() if i.relative_path == rel),
        key=lambda kv: kv[1].offset,
    )
    blob = (step_dir / rel).read_bytes()
    out, pos = bytearray(), 0
    for key, info in items:
        piece = data if key == target else blob[info.offset : info.offset + info.length]
        info.offset, info.length = pos, len(piece)
        out += piece
        pos += len(piece)
    (step_dir / rel).write_bytes(bytes(out))
    (step_dir / ".metadata").write_bytes(P.dumps(md))


FILES = (".metadata", "trainer.pt", "rng_rank0.pt", "distcp-bytes-item", "distcp-tensor-item")


def plant(step_dir: Path, where: str, gadget: bytes) -> None:
    """Plant ``gadget`` (pickle bytes) in ``where`` (one of :data:`FILES`), then reseal."""
    if where == ".metadata":
        (step_dir / ".metadata").write_bytes(gadget)
    elif where in ("trainer.pt", "rng_rank0.pt"):
        (step_dir / where).write_bytes(_archive_with(gadget))
    else:
        _replace_item(step_dir, where == "distcp-tensor-item", _archive_with(gadget))
    reseal(step_dir)
