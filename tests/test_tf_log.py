"""A CPU-only run is quiet about CUDA: TF_CPP_MIN_LOG_LEVEL holds also for what TensorFlow prints while it loads
(qatpipe.tf_log), and nothing but those records is dropped."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qatpipe.tf_log import filter_lines

NOISE = "Could not find cuda drivers"
LOADED = '''WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1795894949.368147   28719 port.cc:153] oneDNN custom operations are on.
I0000 00:00:1795894949.407101   28719 cpu_feature_guard.cc:227] This TensorFlow binary is optimized
To enable the following instructions: AVX2 AVX512F, in other operations, rebuild TensorFlow
/site-packages/x.py:3: UserWarning: a Python warning while loading
2025-09-17 14:44:05.157831: I external/local_xla/xla/tsl/cuda/cudart_stub.cc:32] Could not find cuda drivers
W0000 00:00:1795894951.017858   28719 cuda_platform.cc:52] a warning
E0000 00:00:1795894951.017858   28719 cuda_platform.cc:52] an error
'''


@pytest.mark.parametrize("level, kept", [
    (0, LOADED.splitlines()),
    (1, ["/site-packages/x.py:3: UserWarning: a Python warning while loading",
         "W0000 00:00:1795894951.017858   28719 cuda_platform.cc:52] a warning",
         "E0000 00:00:1795894951.017858   28719 cuda_platform.cc:52] an error"]),
    (2, ["/site-packages/x.py:3: UserWarning: a Python warning while loading",
         "E0000 00:00:1795894951.017858   28719 cuda_platform.cc:52] an error"]),
    (3, ["/site-packages/x.py:3: UserWarning: a Python warning while loading"]),
])
def test_records_below_the_level_go_and_everything_else_stays_in_order(level, kept):
    assert filter_lines(LOADED, level).splitlines() == kept


def _import_tensorflow(level: str | None) -> str:
    env = {key: value for key, value in os.environ.items() if key != "TF_CPP_MIN_LOG_LEVEL"}
    if level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = level
    code = ("import qatpipe, sys, tensorflow as tf; assert tf.constant(1).numpy() == 1; "
            "sys.stderr.write('after\\n')")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_tensorflow_loads_quietly_under_the_level_and_speaks_at_level_0():
    loud = _import_tensorflow("0")  # TensorFlow's own behaviour: the notices this machine prints while loading
    assert "I0000" in loud or NOISE in loud, f"TensorFlow printed no load-time notice at level 0: {loud!r}"
    quiet = _import_tensorflow("2")  # a user's explicit level
    assert "I0000" not in quiet and "absl::InitializeLog" not in quiet and quiet.endswith("after\n"), quiet
    default = _import_tensorflow(None)  # qatpipe's default: 3 without a GPU device, else 2
    assert NOISE not in default and "cuInit" not in default and default == "after\n", default
