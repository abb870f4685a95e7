"""Training utilities: learning-rate schedules, callbacks, checkpoint/resume."""
