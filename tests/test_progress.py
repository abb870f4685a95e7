"""Training shows where it is: each progress line an ETA for its epoch and for the stage, each epoch's line the
stage's (training/callbacks.ProgressLogger)."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import tf_keras as keras

from qatpipe.training.callbacks import ProgressLogger, duration


@pytest.mark.parametrize("seconds, shown", [(0, "0s"), (-3, "0s"), (44.6, "45s"), (60, "1m00s"), (185, "3m05s"),
                                            (3599, "59m59s"), (3720, "1h02m"), (90061, "25h01m")])
def test_durations_read_as_people_read_them(seconds, shown):
    assert duration(seconds) == shown


def test_progress_lines_give_the_epoch_and_stage_eta_and_the_last_epoch_says_nothing_is_left(caplog):
    model = keras.Sequential([keras.layers.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    x, y = np.ones((32, 3), np.float32), np.ones((32, 1), np.float32)
    with caplog.at_level(logging.INFO, logger="qatpipe.train"):
        model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[ProgressLogger(8, 3, 4, every_n_steps=4)])
    steps = [r.getMessage() for r in caplog.records if "step 4/8" in r.getMessage()]
    ends = [r.getMessage() for r in caplog.records if " done in " in r.getMessage()]
    assert len(steps) == 3 and len(ends) == 3
    for line in steps:
        assert re.search(r"ETA epoch \d+s, stage \d+s$", line), line
    assert all(re.search(r"ETA stage \d+s$", line) for line in ends)
    assert ends[-1].endswith("ETA stage 0s")  # the stage is over
