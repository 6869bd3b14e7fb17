"""Write results sent to the coordinator only when they changed (ckptmgr.kept_results): what a
rank sends, and what the coordinator makes of it, save after save. The 2-rank `plans` scenario
(tests/test_distributed.py) runs them over a real process group."""

from __future__ import annotations

import pickle

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from ckptmgr.errors import CheckpointError
from ckptmgr.kept_results import KeptResults, NewResults, UnchangedResults
from ckptmgr.step_collectives import FailedStep
from ckptmgr.write_results import WriteResults


def _results(count: int, crc: int, shift: int = 0) -> WriteResults:
    """``count`` items of a rank's file, each 1 KiB after the one before (``shift`` bytes
    later from the third on), and the rank's checksum report (its file's ``crc``) last."""
    results = [
        WriteResult(
            index=MetadataIndex(f"layer{i}.weight", (64 * i, 0), i),
            size_in_bytes=1024,
            storage_data=_StorageInfo("__1_0.distcp", 1024 * i + (shift if i >= 2 else 0), 1024),
        )
        for i in range(count)
    ]
    report = WriteResult(
        index=MetadataIndex("__ckptmgr_checksums__1_"),
        size_in_bytes=0,
        storage_data={"__1_0.distcp": (1024 * count + shift, crc)},
    )
    return WriteResults([*results, report])


def test_results_unchanged_but_for_the_checksum_report_are_sent_as_such() -> None:
    rank, coordinator = KeptResults(), KeptResults()
    first = rank.outgoing(_results(5000, crc=1))
    assert isinstance(first, NewResults)
    assert coordinator.incoming([first]) == [first.results]
    assert coordinator.reused == 0

    second_results = _results(5000, crc=2)  # (made anew, as each save makes them)
    second = rank.outgoing(second_results)
    assert isinstance(second, UnchangedResults) and second.number == first.number
    assert [result.storage_data for result in second.others] == [{"__1_0.distcp": (5_120_000, 2)}]
    assert len(pickle.dumps(second)) * 50 < len(pickle.dumps(first))
    (rebuilt,) = coordinator.incoming([pickle.loads(pickle.dumps(second))])
    assert coordinator.reused == 1 and rank.unchanged_sent == 1
    assert rebuilt == second_results  # the kept items, the new checksum report in its place
    assert rebuilt.flattened() == WriteResults(second_results).flattened()
    assert pickle.loads(pickle.dumps(rebuilt)) == second_results

    moved = rank.outgoing(_results(5000, crc=3, shift=8))  # an item elsewhere: all sent again
    assert isinstance(moved, NewResults) and moved.number == first.number + 1
    assert coordinator.incoming([moved]) == [moved.results]
    third = rank.outgoing(_results(5000, crc=4, shift=8))
    assert isinstance(third, UnchangedResults) and third.number == moved.number
    assert coordinator.incoming([third]) == [_results(5000, crc=4, shift=8)]
    fewer = rank.outgoing(_results(4999, crc=5))
    assert isinstance(fewer, NewResults)


def test_a_failure_or_a_forgotten_save_makes_the_next_results_go_whole() -> None:
    rank, coordinator = KeptResults(), KeptResults()
    coordinator.incoming([rank.outgoing(_results(10, crc=1))])
    failed = FailedStep(OSError("injected: the disk refused the write"))
    assert rank.outgoing(failed) is failed
    assert coordinator.incoming([failed]) == [failed]
    after_failure = rank.outgoing(_results(10, crc=2))
    assert isinstance(after_failure, NewResults)
    coordinator.incoming([after_failure])

    rank.forget()
    assert isinstance(rank.outgoing(_results(10, crc=3)), NewResults)


def test_unchanged_results_the_coordinator_does_not_hold_fail_that_ranks_save() -> None:
    # (the coordinator forgot, or missed the whole results: the save fails as a write does,
    # every rank forgets, the next results go whole)
    rank, coordinator = KeptResults(), KeptResults()
    other_rank = KeptResults()
    first = [other_rank.outgoing(_results(3, crc=1)), rank.outgoing(_results(10, crc=1))]
    coordinator.incoming(first)
    coordinator.forget()
    second = [other_rank.outgoing(_results(3, crc=2)), rank.outgoing(_results(10, crc=2))]
    assert all(isinstance(sent, UnchangedResults) for sent in second)
    outcomes = coordinator.incoming(second)
    assert all(isinstance(outcome, FailedStep) for outcome in outcomes)
    error = outcomes[1].wrapped[0]
    assert isinstance(error, CheckpointError) and "rank 1" in str(error)
    for sender in (other_rank, rank):  # (the save failed: every rank forgets, see save_plans)
        sender.forget()
    third = [other_rank.outgoing(_results(3, crc=3)), rank.outgoing(_results(10, crc=3))]
    assert all(isinstance(sent, NewResults) for sent in third)
    assert coordinator.incoming(third) == [sent.results for sent in third]
