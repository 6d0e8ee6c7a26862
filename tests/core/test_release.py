"""Issue 28: when a placement may be released (vgpu.core.release), pure."""

from __future__ import annotations

from vgpu.core.release import REREGISTER_WAIT_SETTLES, ReleaseGate


def test_a_release_needs_two_sightings_the_grace_apart() -> None:
    gate = ReleaseGate(settle_s=10.0, grace_s=2.0)
    assert not gate.confirm_missing("p1", 100.0)
    assert gate.awaiting()
    assert not gate.confirm_missing("p1", 101.9)
    assert gate.confirm_missing("p1", 102.0)


def test_a_sighting_in_between_starts_over() -> None:
    gate = ReleaseGate(settle_s=10.0, grace_s=2.0)
    gate.confirm_missing("p1", 100.0)
    gate.present("p1")  # listed again (or the API server shows its pod)
    assert not gate.confirm_missing("p1", 103.0)
    assert gate.confirm_missing("p1", 105.0)


def test_no_hold_without_a_restart() -> None:
    gate = ReleaseGate(settle_s=10.0)
    gate.listed(0.0, {"a"}, registered=True)
    assert gate.holding(0.0, registered=True) is None


def test_a_hold_lasts_until_registered_again_and_stable_for_a_settle_period() -> None:
    gate = ReleaseGate(settle_s=10.0)
    gate.note_registered(0.0)
    assert gate.restart(100.0, "the kubelet's pod-resources socket was re-created")
    assert gate.holding(100.0, registered=True) is not None
    gate.listed(101.0, set(), registered=True)  # registered before the restart: not enough
    assert gate.holding(115.0, registered=True) is not None
    gate.note_registered(100.2)
    gate.listed(116.0, {"a"}, registered=True)
    assert gate.holding(125.0, registered=True) is not None  # 9 s stable
    gate.listed(126.0, {"a", "b"}, registered=True)  # grew: still stable
    assert gate.holding(126.0, registered=True) is None
    assert gate.hold_since is None


def test_an_answer_that_drops_a_container_restarts_the_settle_period() -> None:
    gate = ReleaseGate(settle_s=10.0)
    gate.restart(0.0, "restart", reregister=False)
    gate.listed(1.0, {"a", "b"}, registered=True)
    gate.listed(8.0, {"a"}, registered=True)  # partial: not settled
    assert gate.holding(12.0, registered=True) is not None
    assert gate.holding(18.0, registered=True) is None


def test_a_failed_answer_or_a_new_restart_resets_stability_and_sightings() -> None:
    gate = ReleaseGate(settle_s=10.0)
    gate.restart(0.0, "first", reregister=False)
    gate.listed(1.0, {"a"}, registered=True)
    gate.list_failed(5.0)
    assert gate.holding(12.0, registered=True) is not None
    gate.confirm_missing("p1", 12.0)
    assert not gate.restart(13.0, "second")  # already held: starts over
    assert not gate.awaiting()
    assert gate.holds == 1


def test_a_registration_that_never_comes_is_waited_for_a_few_settle_periods() -> None:
    """A kubelet that re-created its pod-resources socket but kept kubelet.sock."""
    gate = ReleaseGate(settle_s=10.0)
    gate.note_registered(0.0)
    gate.restart(100.0, "socket re-created")
    gate.listed(101.0, {"a"}, registered=True)
    limit = 100.0 + REREGISTER_WAIT_SETTLES * 10.0
    gate.listed(limit - 1.0, {"a"}, registered=True)
    assert gate.holding(limit - 1.0, registered=True) is not None
    gate.listed(limit, {"a"}, registered=True)
    assert gate.holding(limit + 10.0, registered=True) is None


def test_pods_leaving_during_a_hold_do_not_unsettle_it() -> None:
    """Containers of pods the API server shows deleting or gone leave the List
    as expected: the hold still ends one settle period after it was stable."""
    gate = ReleaseGate(settle_s=10.0)
    gate.restart(0.0, "restart", reregister=False)
    gate.listed(1.0, {"a", "b", "c"}, registered=True)
    gate.listed(6.0, {"a"}, registered=True, leaving=lambda c: c in {"b", "c"})
    assert gate.holding(11.0, registered=True) is None


def test_the_next_second_sighting_is_due_from_the_earliest_first() -> None:
    gate = ReleaseGate(settle_s=10.0, grace_s=2.0)
    assert gate.due_in(0.0) is None
    gate.confirm_missing("p1", 100.0)
    gate.confirm_missing("p2", 100.5)
    assert gate.due_in(100.5) == 1.5
    assert gate.confirm_missing("p1", 102.0)
    gate.present("p1")
    assert gate.due_in(102.0) == 0.5


def test_a_stable_hold_is_due_to_end_one_settle_period_after_it_became_stable() -> None:
    gate = ReleaseGate(settle_s=10.0)
    gate.restart(0.0, "restart", reregister=False)
    assert gate.due_in(0.5) is None  # nothing stable yet
    gate.listed(1.0, {"a"}, registered=True)
    assert gate.due_in(4.0) == 7.0


def test_a_registration_before_the_restart_was_noticed_on_another_path_counts() -> None:
    """kubelet.sock re-created and registered at 0.7 s; the List noticed the new
    pod-resources socket (created at 0.5 s) only at 3.5 s: no new registration
    is needed, the one at 0.7 s was with the new kubelet."""
    gate = ReleaseGate(settle_s=10.0)
    gate.restart(0.6, "kubelet.sock re-created")
    gate.note_registered(0.7)
    gate.restart(3.5, "pod-resources socket re-created", started_s=0.5)
    gate.listed(4.0, {"a"}, registered=True)
    assert gate.holding(14.0, registered=True) is None
