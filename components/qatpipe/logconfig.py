"""How qatpipe's commands and pipeline stages log: one format, INFO, and the libraries' chatter at WARNING."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# libraries whose INFO lines say nothing a user acts on (absl: TensorFlow's "Sharding callback duration" per fit)
NOISY_LOGGERS = ("botocore", "urllib3", "matplotlib", "PIL", "h5py", "absl", "alembic")


def configure_logging(level: int = logging.INFO, datefmt: str | None = None, force: bool = False) -> None:
    logging.basicConfig(level=level, format=FORMAT, datefmt=datefmt, force=force)
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)
