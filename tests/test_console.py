"""What `qatpipe run --local` shows (qatpipe_pipelines/console.py): kfp.local's output as it prints it, with
the executor's input JSON and the output listings left to the run's log file, which keeps every line."""

from __future__ import annotations

import io
import sys

from qatpipe_pipelines.console import ConsoleFilter, filtered_stdout

# kfp.local 2.17's output for one task, as it prints it (one ANSI colour code kept, as in a terminal)
TASK = """\
00:31:33.303 - INFO - Executing task \x1b[96m'prepare-data'\x1b[0m
00:31:33.303 - INFO - Streamed logs:

    [KFP Executor 2026-11-29 00:31:33,353 INFO]: Looking for component `prepare_data` in --component_module_path `e.py`
    [KFP Executor 2026-11-29 00:31:33,353 INFO]: Loading KFP component "prepare_data" from /tmp/t/e.py
    [KFP Executor 2026-11-29 00:31:33,354 INFO]: Got executor_input:
    {
        "inputs": {
            "parameterValues": {
                "data_fingerprint": "synthetic"
            }
        },
        "outputFile": "/out/prepare-data/executor_output.json"
    }
    2026-11-29 00:31:33,668 INFO qatpipe: stage prepare-data: started
    2026-11-29 00:31:57,703 WARNING qatpipe.data.kitti: dataset.train: 3 boxes clipped
    2026-11-29 00:32:00,026 INFO qatpipe: stage prepare-data: done in 24.7 s
    2026-11-29 00:32:00,026 INFO root: Wrote executor output file to /out/prepare-data/executor_output.json.


00:32:00.575 - INFO - Task \x1b[96m'prepare-data'\x1b[0m finished with status \x1b[92mSUCCESS\x1b[0m
00:32:00.577 - INFO - Task \x1b[96m'prepare-data'\x1b[0m outputs:
    dataset: Dataset( name='dataset',
                      uri='/out/prepare-data/dataset',
                      metadata={'source': 'synthetic'} )
    data_spec: 'dataset:
  train: null
  classes: [car]
'
--------------------------------------------------------------------------------
00:32:00.579 - INFO - Executing task \x1b[96m'train'\x1b[0m
    Traceback (most recent call last):
    }
00:32:09.100 - ERROR - Task \x1b[96m'train'\x1b[0m finished with status \x1b[91mFAILURE\x1b[0m
"""
SHOWN = """\
00:31:33.303 - INFO - Executing task \x1b[96m'prepare-data'\x1b[0m
    2026-11-29 00:31:33,668 INFO qatpipe: stage prepare-data: started
    2026-11-29 00:31:57,703 WARNING qatpipe.data.kitti: dataset.train: 3 boxes clipped
    2026-11-29 00:32:00,026 INFO qatpipe: stage prepare-data: done in 24.7 s
00:32:00.575 - INFO - Task \x1b[96m'prepare-data'\x1b[0m finished with status \x1b[92mSUCCESS\x1b[0m
--------------------------------------------------------------------------------
00:32:00.579 - INFO - Executing task \x1b[96m'train'\x1b[0m
    Traceback (most recent call last):
    }
00:32:09.100 - ERROR - Task \x1b[96m'train'\x1b[0m finished with status \x1b[91mFAILURE\x1b[0m
"""


def test_the_terminal_gets_the_tasks_and_stage_logs_and_the_log_file_every_line():
    shown, raw = io.StringIO(), io.StringIO()
    console = ConsoleFilter(shown, raw)
    for start in range(0, len(TASK), 37):  # written in pieces that split lines, as a stream is
        console.write(TASK[start:start + 37])
    assert shown.getvalue() == SHOWN
    assert raw.getvalue() == TASK


def test_filtered_stdout_appends_to_the_log_file_and_passes_a_last_unfinished_line(tmp_path, capsys):
    log_file = tmp_path / "run.log"
    log_file.write_text("an earlier run\n")
    with filtered_stdout(log_file):
        print("    [KFP Executor 2026-11-29 00:31:33,353 INFO]: Got executor_input:\n    {\n        \"a\": 1\n    }")
        sys.stdout.write("00:32:00.575 - INFO - the end, without a newline")
    assert capsys.readouterr().out == "00:32:00.575 - INFO - the end, without a newline\n"
    assert log_file.read_text().startswith("an earlier run\n    [KFP Executor")
    assert log_file.read_text().endswith("the end, without a newline\n")
