"""Write results sent to the coordinator only when they changed since a rank's last save.

After writing, every rank sends the coordinator its write results (an item per tensor, a chunk
per DTensor shard: where each went), which the coordinator puts in ``.metadata``. A training
job saves the same structure again and again, and with the same structure every rank writes
every item to the same place (same files, offsets, lengths), save after save: only the sizes and
CRC-32s of its files (ckptmgr's checksum report, a result of its own) change. Yet each save
every rank pickled all of its results and the coordinator unpickled and rebuilt them all (a
rank of 5,000 DTensors: about 5 ms to pickle, 14 ms to rebuild on the coordinator, for every
rank: it grows with ranks times tensors).

:class:`KeptResults` keeps, on each rank, what it last sent, and on the coordinator what each
rank last sent. A rank whose results are the same as the last ones it sent, item for item
(compared as the flat rows they pickle as, see :mod:`ckptmgr.write_results`), sends only its
other results (the checksum report) and the number of the results it means; the coordinator
puts them back in place of the kept ones. A number the coordinator does not hold (it missed
that rank's last results) fails the save, for that rank, like a failed write: every rank then
drops what it kept (:meth:`KeptResults.forget`, with the save plans) and the next save sends
everything.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch.distributed.checkpoint.storage import WriteResult

from ckptmgr.errors import CheckpointError
from ckptmgr.step_collectives import FailedStep
from ckptmgr.write_results import WriteResults


class NewResults(NamedTuple):
    """A rank's write results, all of them, numbered (:attr:`number`) for later saves."""

    number: int
    results: WriteResults


class UnchangedResults(NamedTuple):
    """A rank's write results as those it sent numbered :attr:`number`, but for its other
    results (:attr:`others`: the checksum report), in their places."""

    number: int
    others: list[WriteResult]


class KeptResults:
    """What a rank last sent (:meth:`outgoing`) and, on the coordinator, what each rank last
    sent (:meth:`incoming`); see the module's description. Counts for tests and benchmarks:
    :attr:`unchanged_sent` (saves this rank sent unchanged results) and :attr:`reused` (ranks
    whose kept results the coordinator used in the last save)."""

    def __init__(self) -> None:
        self._number = 0
        self._sent: tuple[int, list[str], list[Any], list[int]] | None = None
        """(number, file names, rows, positions of the other results) of the last results sent
        whole."""
        self._received: dict[int, tuple[int, WriteResults]] = {}
        self.unchanged_sent = 0
        self.reused = 0

    def outgoing(self, written: Any) -> Any:
        """What this rank sends for ``written`` (its write results, or its failure)."""
        if not isinstance(written, WriteResults):
            self._sent = None
            return written
        files, rows, others = written.flattened()
        positions = [position for position, _ in others]
        sent = self._sent
        if sent is not None and sent[1] == files and sent[3] == positions and sent[2] == rows:
            self.unchanged_sent += 1
            return UnchangedResults(sent[0], [result for _, result in others])
        self._number += 1
        self._sent = (self._number, files, rows, positions)
        return NewResults(self._number, written)

    def incoming(self, gathered: list[Any]) -> list[Any]:
        """Every rank's write results (or failure) from what the ranks sent (``gathered``, in
        rank order), on the coordinator."""
        self.reused = 0
        results: list[Any] = []
        for rank, sent in enumerate(gathered):
            if isinstance(sent, NewResults):
                self._received[rank] = (sent.number, sent.results)
                results.append(sent.results)
            elif isinstance(sent, UnchangedResults):
                results.append(self._unchanged(rank, sent))
            else:
                self._received.pop(rank, None)
                results.append(sent)
        return results

    def forget(self) -> None:
        """Drop everything kept: the next results are sent whole."""
        self._sent = None
        self._received.clear()

    def _unchanged(self, rank: int, sent: UnchangedResults) -> Any:
        kept = self._received.get(rank)
        if kept is None or kept[0] != sent.number:
            self._received.pop(rank, None)
            return FailedStep(
                CheckpointError(
                    f"rank {rank} sent its write results as unchanged since results the "
                    "coordinator does not hold"
                )
            )
        files, rows, others = kept[1].flattened()
        if len(others) != len(sent.others):  # (cannot be: the positions were compared)
            return FailedStep(CheckpointError(f"rank {rank} sent unmatched write results"))
        results = WriteResults(kept[1])
        placed = []
        for (position, _), result in zip(others, sent.others, strict=True):
            results[position] = result
            placed.append((position, result))
        results._flat = (files, rows, placed)
        self.reused += 1
        return results
