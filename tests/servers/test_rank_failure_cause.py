"""When a rank is killed, its peers' collectives fail with "connection reset" a moment before the killed process is
reaped: the group's report names the killed rank (the cause), not the peer's echo. Real processes, no model."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

from servers.trainers.fsdp_ranks import RankGroup


def _leave_at_once() -> None:
    """A rank that reported its error and returned: exit code 0."""


def _wait_to_be_killed() -> None:
    time.sleep(60)


def group_of(*targets) -> RankGroup:
    """A RankGroup over plain processes (its failure diagnosis reads nothing but the processes)."""
    group = RankGroup.__new__(RankGroup)
    context = mp.get_context("spawn")
    group._processes = [context.Process(target=t, daemon=True) for t in targets]
    for process in group._processes:
        process.start()
    return group


def test_an_error_while_a_peer_is_being_killed_names_the_killed_peer():
    group = group_of(_leave_at_once, _wait_to_be_killed)
    try:
        os.kill(group._processes[1].pid, signal.SIGKILL)  # reaped later than rank 0's error arrives
        reason = group._error_reason(0, "train", "Traceback ...\nRuntimeError: Connection reset by peer\n")
        assert reason.startswith("rank 1 died train (exit code -9); rank 0 then failed: RuntimeError: Connection")
    finally:
        for process in group._processes:
            process.kill()


def test_an_error_of_its_own_names_the_rank_and_keeps_its_traceback():
    group = group_of(_leave_at_once, _leave_at_once)  # both leave cleanly, as ranks do after reporting an error
    reason = group._error_reason(1, "train", "Traceback ...\nValueError: bad batch\n")
    assert reason == "rank 1 failed train:\nTraceback ...\nValueError: bad batch\n"
