"""CommRecorder's bookkeeping of the latest backward and of everything since the last pop: no process group."""

import pytest

from ddp_ft.ddp.stats import MAX_PENDING_WAITS, CommRecorder, CommStats


def test_latest_and_pending_count_the_same_events():
    recorder = CommRecorder()
    assert recorder.last() == CommStats() and recorder.pop() == CommStats()
    recorder.start_backward(synced=False)  # an accumulation micro-step: nothing on the wire
    recorder.start_backward(synced=True)
    recorder.add_allreduce(100)
    recorder.add_allreduce(28)
    recorder.add_wait(1.5)
    recorder.add_window(4.0)
    synced = CommStats(
        allreduce_calls=2, allreduce_bytes=128, exposed_comm_ms=1.5, comm_window_ms=4.0, synced_backwards=1, backwards=1
    )
    assert recorder.last() == synced
    assert recorder.pop() == CommStats(**{**vars(synced), "backwards": 2})
    assert recorder.pop() == CommStats()
    assert recorder.last() == synced, "pop() resets the pending record only"
    recorder.start_backward(synced=False)
    assert recorder.last() == CommStats(backwards=1)


def test_unpopped_waits_stay_bounded_and_add_up():
    recorder = CommRecorder()
    waits = [0.25 * (i + 1) for i in range(3 * MAX_PENDING_WAITS)]
    for wait in waits:
        recorder.start_backward(synced=True)
        recorder.add_wait(wait)
        assert recorder.held_waits <= MAX_PENDING_WAITS
        assert recorder.last().exposed_comm_ms == wait
    stats = recorder.pop()
    assert stats.synced_backwards == len(waits)
    assert stats.exposed_comm_ms == pytest.approx(sum(waits), rel=1e-12)
    assert recorder.held_waits == 0
