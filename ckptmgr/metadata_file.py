"""The bytes of DCP's ``.metadata``, with what a save shares with the last one not pickled again.

At the end of every save DCP's writer pickles the global metadata into ``.metadata`` on the
coordinator: an object per stored tensor, per chunk of it its offsets and sizes, and per item
its file, offset and length. For a sharded state that is most of the coordinator's work after
the writes (2 ranks, 5,000 small DTensors: a file of 1.9 MB, 0.15 s to pickle, while the other
ranks wait for the commit). A training job saves the same structure again and again, and with
DCP's plan caching (:mod:`ckptmgr.save_plans`) each such save hands the writer the very same
``state_dict_metadata`` and ``planner_data`` objects; its items land in the same files at the
same offsets, so only ``storage_meta`` (the save's id and directory) is new.

A :class:`MetadataFile` keeps the last save's metadata pickled field by field (each field's
name and value), and pickles again only from the first field that is not the very same object
as last time, with pickle's memo (the objects it has numbered for later references) as it was
there. The file then holds the opcodes DCP's own ``pickle.dump`` writes for the same metadata,
in one frame of protocol 4 where pickle cuts frames of about 64 KiB (an unpickler reads a
frame whole, then its opcodes from memory; without frames, one that reads a stream without
``peek``, as :mod:`ckptmgr.safe_metadata` does, reads each opcode on its own, 40% slower here),
less two memo entries no opcode refers to (the ``Metadata`` object and its state): the same
object graph in the same bytes, read by any unpickler (DCP's, and :mod:`ckptmgr.safe_metadata`).
To pickle again from a field, a copy of the memo at its start is kept: one, at the field the
last save found first changed, or where it found none the same, at ``storage_meta`` (new in
every save, and the first field that is in a run of saves of one structure), so the first save
of a structure pickles everything and the next ones only ``storage_meta`` and ``version``. The
copy refers to the objects of the fields before it (which the kept opcodes stand for, and DCP's
plan cache keeps anyway) and costs memory of the order of theirs (the metadata of 5,000
DTensors on 2 ranks: 12 MB of objects, 8 MB of memo).

A field's bytes are reused when its value is the very object pickled last time; the caller makes
that so for ``storage_data`` (made anew each save) with :meth:`MetadataFile.storage_data`, which
hands back the last save's dict when the write results it is made from are the same. Where a
field's opcodes cannot be taken out of pickle's frames (a payload of 64 KiB or more, which pickle
writes outside them), the whole metadata is pickled as DCP pickles it.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

from torch.distributed.checkpoint import metadata as dcp_metadata

_PROTOCOL = 4  # pickle.dump's default protocol in the Pythons ckptmgr supports, as DCP writes
_FRAME_HEADER = struct.Struct("<BQ")  # FRAME and the frame's length
_SMALLEST_FRAME = 4  # pickle writes a frame of fewer bytes without a header
_NEW_FROM_STATE = pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.EMPTY_DICT + pickle.MARK
"""``Metadata.__new__(Metadata)`` (the class below it on the stack), then the start of its state
dict's items."""
_TAIL = pickle.SETITEMS + pickle.BUILD + pickle.STOP
"""The state dict's items end, the state is set on the object, the stream ends."""
_NEW_EACH_SAVE = "storage_meta"
"""The field of DCP's metadata that is new in every save (it holds the save's id)."""


class _Field(NamedTuple):
    """A field of the metadata, and the opcodes that push its name and value."""

    name: str
    value: Any
    opcodes: bytes


class _Resume(NamedTuple):
    """Where pickling can start again: before field ``index``, with ``holder``'s memo."""

    index: int
    holder: pickle.Pickler


def _unframed(pickled: bytes) -> bytes | None:
    """The opcodes of a protocol-4 pickle without its PROTO, frame headers and STOP; None where
    some of it lies outside frames (pickle writes a payload of 64 KiB or more so)."""
    position, end = 2, len(pickled)
    parts = []
    while position < end:
        if pickled[position] == pickle.FRAME[0]:
            _, length = _FRAME_HEADER.unpack_from(pickled, position)
            start = position + _FRAME_HEADER.size
            parts.append(pickled[start : start + length])
            position = start + length
        elif end - position < _SMALLEST_FRAME:  # (the last frame, written without a header)
            parts.append(pickled[position:])
            position = end
        else:
            return None
    opcodes = b"".join(parts)
    return opcodes[:-1] if opcodes.endswith(pickle.STOP) else None


def _opcodes_of(pickler: pickle.Pickler, buffer: io.BytesIO, *values: Any) -> bytes | None:
    """The opcodes that push ``values`` (pickled by ``pickler`` into ``buffer``, which is
    emptied), or None (see :func:`_unframed`)."""
    parts = []
    for value in values:
        pickler.dump(value)  # (the memo lives on between dumps)
        opcodes = _unframed(buffer.getvalue())
        buffer.seek(0)
        buffer.truncate()
        if opcodes is None:
            return None
        parts.append(opcodes)
    return b"".join(parts)


class MetadataFile:
    """The ``.metadata`` of one manager's saves, the last one's pickled fields kept (see the
    module's description)."""

    def __init__(self) -> None:
        self._head = b""
        """The opcodes that push the class ``Metadata``."""
        self._fields: list[_Field] = []
        """The fields of the last save's metadata, in order."""
        self._resume: _Resume | None = None
        self._storage: tuple[object, dict[Any, Any]] | None = None
        """(the key of the write results, the ``storage_data`` made from them) of the last save."""
        self.reused = 0
        """How many fields the last call of :meth:`dumps` took from the opcodes kept (for tests
        and benchmarks)."""

    def storage_data(
        self, results_key: object | None, make: Callable[[], dict[Any, Any]]
    ) -> dict[Any, Any]:
        """DCP's ``storage_data`` for a save whose write results ``results_key`` stands for
        (equal keys: equal results; None: not known): the last save's very dict where the key
        equals its key, else ``make()`` (kept for the next save when the key is known)."""
        kept = self._storage
        if results_key is not None and kept is not None and kept[0] == results_key:
            return kept[1]
        made = make()
        self._storage = None if results_key is None else (results_key, made)
        return made

    def dumps(self, metadata: dcp_metadata.Metadata) -> bytes:
        """``metadata`` pickled: its attributes in their order, those before the first that is
        not the very object of the last call from the opcodes kept (as far as the memo kept
        reaches: see the module's description)."""
        fields = list(vars(metadata).items())
        same = 0
        for (name, value), kept in zip(fields, self._fields, strict=False):
            if name != kept.name or value is not kept.value:
                break
            same += 1
        # Where the next call is expected to start pickling: where this one found the first
        # change, or, where nothing was the same, at the save's own storage_meta.
        names = [name for name, _ in fields]
        resume_at = same or (names.index(_NEW_EACH_SAVE) if _NEW_EACH_SAVE in names else same)
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, _PROTOCOL)
        resume = self._resume
        if resume is not None and resume.index <= same:
            pickler.memo = resume.holder.memo  # (a copy)
            start, head, done = resume.index, self._head, self._fields[: resume.index]
        else:
            start, resume, done = 0, None, []
            head = _opcodes_of(pickler, buffer, dcp_metadata.Metadata)
            if head is None:  # pragma: no cover - (a class named in 64 KiB)
                self.forget()
                return pickle.dumps(metadata, _PROTOCOL)
        for index in range(start, len(fields) + 1):
            if index == resume_at and (resume is None or resume.index != index):
                holder = pickle.Pickler(io.BytesIO(), _PROTOCOL)
                holder.memo = pickler.memo  # (a copy)
                resume = _Resume(index, holder)
            if index == len(fields):
                break
            name, value = fields[index]
            opcodes = _opcodes_of(pickler, buffer, name, value)
            if opcodes is None:
                self.forget()
                return pickle.dumps(metadata, _PROTOCOL)
            done.append(_Field(name, value, opcodes))
        self._head, self._fields, self._resume = head, done, resume
        self.reused = start
        body = [head, _NEW_FROM_STATE, *[field.opcodes for field in done], _TAIL]
        length = sum(map(len, body))
        return b"".join(
            [pickle.PROTO, bytes([_PROTOCOL]), _FRAME_HEADER.pack(pickle.FRAME[0], length), *body]
        )

    def forget(self) -> None:
        """Drop everything kept (after a failed save, and on close)."""
        self._head = b""
        self._fields = []
        self._resume = None
        self._storage = None
        self.reused = 0
