"""Unit tests of PhaseTimer (pure logic, fake clock)."""

from __future__ import annotations

from typing import Any

import pytest

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.telemetry.phases import Phase, PhaseTimer


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def tick(self, s: float) -> None:
        self.t += s


def run_step(timer: PhaseTimer, clock: FakeClock, durations: dict[Phase, float], gap: float = 0.0) -> None:
    for phase, secs in durations.items():
        timer.start(phase)
        clock.tick(secs)
        timer.stop(phase)
    clock.tick(gap)
    timer.step_end()


def test_rolling_summary_means_fractions_and_percentiles() -> None:
    clock = FakeClock()
    t = PhaseTimer(window=4, use_cuda_events=False, clock=clock)
    for i in range(6):
        run_step(t, clock, {Phase.DATA: 0.1, Phase.FORWARD: 0.2, Phase.BACKWARD: 0.3 + i * 0.1, Phase.OPTIMIZER: 0.1})
    s = t.summary()
    assert s["steps"] == 4
    # window holds steps 2..5: backward 0.5, 0.6, 0.7, 0.8
    assert s["phase_s"]["backward"] == pytest.approx(0.65)
    assert s["phase_s"]["data"] == pytest.approx(0.1)
    assert sum(s["phase_fraction"].values()) == pytest.approx(1.0)
    assert s["step_time_s"]["p50"] == pytest.approx(1.05 + 0.0)
    assert s["step_time_s"]["p99"] == pytest.approx(1.2, rel=0.01)
    assert s["steps_per_s"] == pytest.approx(1 / 1.05)
    life = s["lifetime"]
    assert life["steps"] == 6
    assert life["phase_s"]["forward"] == pytest.approx(1.2)


def test_unclaimed_time_is_other_and_open_phases_close_at_step_end() -> None:
    clock = FakeClock()
    t = PhaseTimer(use_cuda_events=False, clock=clock)
    t.start(Phase.FORWARD)
    clock.tick(0.5)
    t.step_end()  # forward still open: closed here
    run_step(t, clock, {Phase.FORWARD: 0.25}, gap=0.75)
    s = t.summary()
    assert s["lifetime"]["phase_s"]["forward"] == pytest.approx(0.75)
    assert s["lifetime"]["phase_s"]["other"] == pytest.approx(0.75)
    assert s["lifetime"]["wall_s"] == pytest.approx(1.5)


def test_context_manager_and_add() -> None:
    clock = FakeClock()
    t = PhaseTimer(use_cuda_events=False, clock=clock)
    with t.phase(Phase.DATA):
        clock.tick(0.2)
    t.add(Phase.CHECKPOINT, 1.0)
    clock.tick(1.0)
    t.step_end()
    life = t.lifetime()
    assert life["phase_s"]["data"] == pytest.approx(0.2)
    assert life["phase_s"]["checkpoint"] == pytest.approx(1.0)


def test_state_dict_round_trip_keeps_lifetime_not_window() -> None:
    clock = FakeClock()
    t = PhaseTimer(use_cuda_events=False, clock=clock)
    for _ in range(3):
        run_step(t, clock, {Phase.FORWARD: 0.1})
    state = t.state_dict()
    u = PhaseTimer(use_cuda_events=False, clock=clock)
    u.load_state_dict(state)
    assert u.lifetime() == t.lifetime()
    assert u.summary()["steps"] == 0
    run_step(u, clock, {Phase.FORWARD: 0.1})
    assert u.lifetime()["steps"] == 4


def test_cuda_events_stay_off_without_cuda() -> None:
    t = PhaseTimer(use_cuda_events=False)
    import torch

    assert t.set_cuda_events(True) is bool(torch.cuda.is_available() and torch.cuda.is_initialized())
    assert t.set_cuda_events(False) is False


def test_empty_summary_is_all_zero() -> None:
    s = PhaseTimer(use_cuda_events=False).summary()
    assert s["steps"] == 0 and s["steps_per_s"] == 0.0
    assert set(s["phase_fraction"]) == {p.value for p in Phase}


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "10"])
def test_bad_window_names_the_argument(bad: Any) -> None:
    with pytest.raises(ConfigError, match="window"):
        PhaseTimer(window=bad)


def test_bad_state_is_rejected() -> None:
    with pytest.raises(ConfigError, match="state"):
        PhaseTimer().load_state_dict({"steps": 3})


class FakeEvent:
    """Stands in for torch.cuda.Event: completes when the test says so."""

    done = False

    def __init__(self, t: float) -> None:
        self.t = t

    def query(self) -> bool:
        return FakeEvent.done

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.t - self.t) * 1000.0


def test_device_times_are_read_a_step_later_without_synchronising() -> None:
    clock = FakeClock()
    t = PhaseTimer(use_cuda_events=False, clock=clock)
    # Inject a step whose device events are still in flight (what a GPU step looks like).
    t.start(Phase.FORWARD)
    clock.tick(0.01)  # CPU only launched the kernels
    t.stop(Phase.FORWARD)
    t._cur_events.append((Phase.FORWARD, FakeEvent(0.0), FakeEvent(0.5)))
    FakeEvent.done = False
    t.step_end()
    assert t.summary()["steps"] == 0 and t.summary()["pending_device_steps"] == 1
    FakeEvent.done = True
    run_step(t, clock, {Phase.DATA: 0.1})
    s = t.summary()
    assert s["steps"] == 2 and s["pending_device_steps"] == 0
    assert t.lifetime()["phase_s"]["forward"] == pytest.approx(0.5)


def test_pending_device_steps_are_bounded() -> None:
    clock = FakeClock()
    t = PhaseTimer(use_cuda_events=False, clock=clock, max_pending=2)
    FakeEvent.done = False
    for _ in range(5):
        t._cur_events.append((Phase.FORWARD, FakeEvent(0.0), FakeEvent(0.5)))
        run_step(t, clock, {Phase.FORWARD: 0.01})
    assert t.summary()["pending_device_steps"] <= 2
    assert t.lifetime()["steps"] == 3


@pytest.mark.gpu
def test_cuda_events_on_a_real_gpu() -> None:
    import torch

    t = PhaseTimer(use_cuda_events=False)
    torch.cuda.init()
    assert t.set_cuda_events(True) and t.uses_cuda_events
    x = torch.randn(1024, 1024, device="cuda")
    for _ in range(3):
        with t.phase(Phase.FORWARD):
            x = x @ x
            x = x / x.norm()
        t.step_end()
    torch.cuda.synchronize()
    t.step_end()
    assert t.lifetime()["steps"] == 4
    assert t.lifetime()["phase_s"]["forward"] > 0


def test_index_hot_path_matches_phase_api_across_window_laps() -> None:
    from gpupool_sdk.telemetry.phases import PHASE_INDEX, PHASES

    assert [PHASES[PHASE_INDEX[p]] for p in Phase] == list(Phase)
    d, f, b, o = (PHASE_INDEX[p] for p in (Phase.DATA, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER))
    ca, cb = FakeClock(), FakeClock()
    by_phase = PhaseTimer(window=3, use_cuda_events=False, clock=ca)
    by_index = PhaseTimer(window=3, use_cuda_events=False, clock=cb)
    by_index.begin(d)
    for i in range(8):  # more than two laps of the 3-step ring
        durations = {Phase.DATA: 0.1, Phase.FORWARD: 0.2 + i / 100, Phase.BACKWARD: 0.3, Phase.OPTIMIZER: 0.05}
        run_step(by_phase, ca, durations, gap=0.01)
        cb.tick(0.1)
        by_index.switch(d, f)
        cb.tick(0.2 + i / 100)
        by_index.switch(f, b)
        cb.tick(0.3)
        by_index.switch(b, -1)
        cb.tick(0.01)
        by_index.begin(o)
        cb.tick(0.05)
        assert by_index.finish_step(o) == cb.t
        by_index.begin(d, cb.t)
    sa, sb = by_phase.summary(), by_index.summary()
    assert sa["steps"] == sb["steps"] == 3
    assert sb["phase_s"] == pytest.approx(sa["phase_s"])
    assert sb["step_time_s"] == pytest.approx(sa["step_time_s"])
    la, lb = by_phase.lifetime(), by_index.lifetime()
    assert lb["steps"] == la["steps"] == 8
    assert lb["phase_s"] == pytest.approx(la["phase_s"])
    assert lb["phase_s"]["forward"] == pytest.approx(sum(0.2 + i / 100 for i in range(8)))
    assert lb["phase_s"]["other"] == pytest.approx(8 * 0.01)
    assert by_index.total_s[Phase.BACKWARD] == pytest.approx(8 * 0.3)


def test_totals_survive_a_load_in_the_middle_of_a_lap() -> None:
    clock = FakeClock()
    t = PhaseTimer(window=4, use_cuda_events=False, clock=clock)
    for _ in range(6):
        run_step(t, clock, {Phase.FORWARD: 0.1})
    state = {"version": 1, "steps": 10, "wall_s": 2.0, "phase_s": {"forward": 1.5, "checkpoint": 0.5}}
    t.load_state_dict(state)
    assert t.lifetime()["phase_s"]["forward"] == pytest.approx(1.5)
    run_step(t, clock, {Phase.FORWARD: 0.1})
    run_step(t, clock, {Phase.FORWARD: 0.1})
    run_step(t, clock, {Phase.FORWARD: 0.1})  # completes a lap: the ring is folded into the totals
    life = t.lifetime()
    assert life["steps"] == 13
    assert life["phase_s"]["forward"] == pytest.approx(1.8)
    assert life["phase_s"]["checkpoint"] == pytest.approx(0.5)
    t.add(Phase.CHECKPOINT, 0.25, standalone=True)
    assert t.state_dict()["phase_s"]["checkpoint"] == pytest.approx(0.75)
