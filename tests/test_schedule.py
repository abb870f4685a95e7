"""TAO's soft-start annealing schedule."""

from __future__ import annotations

import math

import pytest

from qatpipe.training.schedules import SoftStartAnnealingSchedule, soft_start_annealing_lr

ARGS = dict(min_lr=1e-5, max_lr=1e-3, soft_start=0.1, annealing_point=0.7)


def test_shape_of_the_schedule():
    lr = lambda p: soft_start_annealing_lr(p, **ARGS)  # noqa: E731
    assert lr(0.0) == pytest.approx(1e-5)
    assert lr(0.05) == pytest.approx(1e-4)  # half-way up the log ramp
    assert lr(0.1) == lr(0.5) == pytest.approx(1e-3)
    assert lr(0.85) == pytest.approx(1e-4)  # half-way down
    assert lr(1.0) == pytest.approx(1e-5)


def test_tensorflow_schedule_matches_reference():
    schedule = SoftStartAnnealingSchedule(total_steps=200, **ARGS)
    for step in (0, 7, 20, 100, 139, 140, 170, 199, 200):
        assert float(schedule(step)) == pytest.approx(soft_start_annealing_lr(step / 200, **ARGS), rel=1e-4)
    restored = SoftStartAnnealingSchedule(**schedule.get_config())
    assert float(restored(170)) == pytest.approx(math.exp((math.log(1e-3) + math.log(1e-5)) / 2), rel=1e-4)
