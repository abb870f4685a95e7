"""Feeds each fault of issue 34 to the real `qatpipe` command line, as a user would meet it, and prints what
happened: exit code, the message a user reads, and what was lost.

    .venv/bin/python bench/faults.py [--work DIR] [--only NAME ...]

Faults: two `qatpipe run --local` into one folder at once; a training killed with a truncated, garbled,
checksum-failing or state-file-corrupt newest checkpoint beside an intact older one; the MLflow server killed
mid-run, restarted and the run repeated; a full disk under the results folder (a small tmpfs; needs root);
a label linked to /etc/passwd; an image linked to a valid file elsewhere; a file name carrying a forged log
line. The pipeline runs use the tiny spec with few epochs (about 2-3 minutes each on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QATPIPE = str(Path(sys.executable).with_name("qatpipe"))
# a short pipeline: the faults, not the figures, are measured
SHORT = ["--set", "train.epochs=2", "--set", "retrain.epochs=1", "--set", "qat.finetune_epochs=1",
         "--set", "train.checkpoint_interval=1"]
ROWS: list[tuple[str, str, str, str]] = []


def run(args: list[str], env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([QATPIPE, *args], capture_output=True, text=True, env={**os.environ, **(env or {})},
                          **kwargs)


def last_error(output: str) -> str:
    """The last ERROR line a user sees (or the last line), one line."""
    lines = [line for line in output.splitlines() if " ERROR " in line] or output.splitlines()[-1:] or [""]
    return lines[-1].split(": ", 1)[-1][:300]


def record(fault: str, code, message: str, lost: str) -> None:
    ROWS.append((fault, str(code), message.replace("|", "\\|"), lost))
    print(f"  {fault}: exit {code}; {message[:160]}; lost: {lost}", flush=True)


# ------------------------------------------------------------------ the faults


def concurrent_runs(work: Path) -> None:
    out = work / "concurrent"
    first = subprocess.Popen([QATPIPE, "run", "--local", "--spec", "tiny", "--output", str(out), *SHORT],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lock = out / ".qatpipe.lock"
    while not (lock.is_file() and lock.read_text().strip()):
        time.sleep(0.2)
    time.sleep(2)
    second = run(["run", "--local", "--spec", "tiny", "--output", str(out), *SHORT])
    output, _ = first.communicate()
    lost = "none: the first run finished" if first.returncode == 0 and (out / "summary.json").is_file() \
        else f"the first run ended with {first.returncode}: {last_error(output)}"
    record("two `run --local` into one folder", second.returncode, last_error(second.stderr), lost)
    parents = _pipeline_runs(out / "mlflow.db")
    record("... MLflow after both", "-", f"{len(parents)} parent run(s): {sorted(set(parents))}", "-")


def corrupt_checkpoints(work: Path) -> None:
    spec = ["-e", "tiny", "--set", "train.epochs=2", "--set", "train.checkpoint_interval=1",
            "--set", "model.backbone.width=0.0625", "--set", "train.validation_interval=0"]
    base = work / "checkpoint_base"
    done = run(["train", *spec, "-r", str(base)])
    assert done.returncode == 0, done.stderr[-2000:]

    def flip_middle(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    faults = {
        "truncated data file": lambda c: _truncate(next(c.glob("ckpt-2.data-*"))),
        "garbled index (not an sstable)": lambda c: (c / "ckpt-2.index").write_bytes(os.urandom(200)),
        "one flipped byte (checksum)": lambda c: flip_middle(next(c.glob("ckpt-2.data-*"))),
        "garbled state file (invalid checkpoint state)": lambda c: (c / "checkpoint").write_bytes(os.urandom(100)),
    }
    for name, fault in faults.items():
        folder = work / f"checkpoint_{name.split()[0]}_{name.split()[1]}"
        shutil.copytree(base, folder)
        for kept in ("model.keras", "train_summary.json"):
            (folder / kept).unlink()
        fault(folder / "checkpoints")
        again = run(["train", *spec, "-r", str(folder)])
        resumed = [line.split(": ", 1)[-1] for line in again.stderr.splitlines() if "resuming from" in line]
        record(f"newest checkpoint: {name}", again.returncode, " / ".join(resumed)[:300] or last_error(again.stderr),
               "epoch 2 trained again" if again.returncode == 0 else "the run")
    folder = work / "checkpoint_none"
    shutil.copytree(base, folder)
    (folder / "model.keras").unlink()
    for index in (folder / "checkpoints").glob("*.index"):
        index.write_bytes(os.urandom(100))
    again = run(["train", *spec, "-r", str(folder)])
    record("every checkpoint unreadable", again.returncode, last_error(again.stderr), "nothing written")


def mlflow_killed(work: Path) -> None:
    store, port = work / "mlflow_server", _free_port()
    store.mkdir()
    env = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"}
    server = _server(store, port)
    out = work / "mlflow_killed"
    first = subprocess.Popen([QATPIPE, "run", "--local", "--spec", "tiny", "--output", str(out), *SHORT],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **env})
    while not any(out.glob("kfp/*/prune")):  # mid-run: training done, pruning under way
        if first.poll() is not None:
            break
        time.sleep(0.5)
    _kill(server)
    output, _ = first.communicate()
    record("MLflow killed mid-run", first.returncode, last_error(output), "-")
    server = _server(store, port)
    again = run(["run", "--local", "--spec", "tiny", "--output", str(out), *SHORT], env=env)
    runs = _pipeline_runs(store / "mlflow.db")
    versions = _versions(store / "mlflow.db")
    third = run(["run", "--local", "--spec", "tiny", "--output", str(out), *SHORT], env=env)
    record("... restarted, run again (twice)", f"{again.returncode}, {third.returncode}",
           f"parent runs by status: {runs}; model versions after the 1st re-run {versions}, after the 2nd "
           f"{_versions(store / 'mlflow.db')}", "none" if again.returncode == 0 else last_error(again.stderr))
    _kill(server)


def disk_full(work: Path) -> None:
    folder = work / "full"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(folder)]).returncode:
        record("disk full", "-", "not run: mounting a tmpfs needs root", "-")
        return
    try:
        (folder / "filler").write_bytes(b"\0" * (8192 - 16) * 1024)  # 16 KiB left: the first results fit
        spec = ["-e", "tiny", "--set", "train.epochs=1", "--set", "model.backbone.width=0.0625"]
        full = run(["train", *spec, "-r", str(folder / "run")])
        left = [str(p.relative_to(folder)) for p in folder.rglob("*.part")]
        record("disk full under -r (train)", full.returncode, last_error(full.stderr),
               f"half-written files left: {left or 'none'}")
        (folder / "filler").unlink()
        again = run(["train", *spec, "-r", str(folder / "run")])
        record("... space freed, run again", again.returncode, last_error(again.stderr) if again.returncode else
               "trained", "none")
    finally:
        subprocess.run(["umount", "--lazy", str(folder)])


def data_outside(work: Path) -> None:
    data = work / "data"
    made = run(["data", "synth", "--out", str(data), "--train", "8", "--val", "4", "--overwrite"])
    assert made.returncode == 0, made.stderr[-2000:]
    spec = ["-e", "tiny", "--set", f"dataset.train={data / 'train'}", "--set", f"dataset.val={data / 'val'}",
            "--set", "train.epochs=1"]
    label = sorted((data / "train" / "labels").iterdir())[0]
    saved = label.read_bytes()
    label.unlink()
    label.symlink_to("/etc/passwd")
    result = run(["train", *spec, "-r", str(work / "outside_label")])
    echoed = "yes" if "root:" in result.stderr else "no"
    record("label linked to /etc/passwd", result.returncode, last_error(result.stderr),
           f"file content echoed: {echoed}")
    label.unlink()
    label.write_bytes(saved)

    image = sorted((data / "train" / "images").iterdir())[0]
    elsewhere = work / f"elsewhere{image.suffix}"
    shutil.move(image, elsewhere)
    image.symlink_to(elsewhere)
    result = run(["train", *spec, "-r", str(work / "outside_image")])
    record("image linked to a valid file elsewhere", result.returncode, last_error(result.stderr), "-")
    image.unlink()
    shutil.move(elsewhere, image)

    forged = "x\n12:00:00 ERROR qatpipe: forged"
    (data / "train" / "images" / f"{forged}.png").write_bytes(b"not an image")
    (data / "train" / "labels" / f"{forged}.txt").write_text("")
    result = run(["train", *spec, "-r", str(work / "forged")])
    forged_lines = [line for line in result.stderr.splitlines() if line.startswith("12:00:00 ERROR")]
    record("file name with a newline and a fake log line", result.returncode, last_error(result.stderr),
           f"forged log lines: {len(forged_lines)}")


FAULTS = {"concurrent": concurrent_runs, "checkpoints": corrupt_checkpoints, "mlflow": mlflow_killed,
          "disk": disk_full, "data": data_outside}


# ------------------------------------------------------------------ helpers


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _server(store: Path, port: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                                "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}", "--workers", "1",
                                "--artifacts-destination", str(store / "artifacts")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return process
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("mlflow server did not start")


def _kill(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _pipeline_runs(db: Path) -> dict[str, int]:
    """Parent (pipeline) runs by status, read from the store's database."""
    if not db.is_file():
        return {}
    with sqlite3.connect(db) as connection:
        rows = connection.execute("select r.status, count(*) from runs r join tags t on t.run_uuid = r.run_uuid "
                                  "where t.key = 'qatpipe.kind' and t.value = 'pipeline' group by r.status").fetchall()
    return dict(rows)


def _versions(db: Path) -> int:
    with sqlite3.connect(db) as connection:
        return connection.execute("select count(*) from model_versions").fetchone()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="folder for the runs (default: a temporary one)")
    parser.add_argument("--only", nargs="+", choices=sorted(FAULTS), help="run only these groups")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="qatpipe-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work folder {work}", flush=True)
    for name in args.only or FAULTS:
        started = time.monotonic()
        print(f"{name} ...", flush=True)
        (work / name).mkdir(exist_ok=True)
        FAULTS[name](work / name)
        print(f"  ({time.monotonic() - started:.0f} s)", flush=True)
    print("\n| fault | exit code | message | lost |\n|---|---|---|---|")
    for row in ROWS:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
