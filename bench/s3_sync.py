"""How long `sync_s3_prefix` takes to fetch a data set of many small objects, one download at a time against
several at once, from a local S3 server (moto's, in its own process; no MinIO runs here).

    .venv/bin/python bench/s3_sync.py [--objects 2000] [--repeats 3] [--threads 1 16]

Seeds one prefix with `--objects` objects, KITTI-like (half ~20 KB "images", half ~100 B labels), then times a
cold sync into a fresh folder per thread count and repeat, and a warm re-sync (everything skipped). Prints the
median seconds and objects per second. A real endpoint adds network latency per request, which the threads
overlap; on loopback the server's own request handling is most of what is timed.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "components"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import boto3

    from qatpipe.storage import sync_s3_prefix

    # the server in its own process, as a real endpoint is: in this one it would share the client's GIL
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    _wait_for(endpoint)
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    raw = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    raw.create_bucket(Bucket="bench")
    image, label = os.urandom(20_000), b"car 0.00 0 0.00 10 20 50 60 0 0 0 0 0 0 0\n"
    for i in range(args.objects):
        kind, body = ("images", image) if i % 2 == 0 else ("labels", label)
        raw.put_object(Bucket="bench", Key=f"data/train/{kind}/{i:06d}", Body=body)
    total_mb = sum(len(image if i % 2 == 0 else label) for i in range(args.objects)) / 1e6
    print(f"{args.objects} objects ({total_mb:.1f} MB) on a local moto S3 server; {os.cpu_count()} CPU cores")
    print("| threads | cold sync, median s | objects/s | warm re-sync s |")
    print("|---|---|---|---|")
    baseline = None
    with tempfile.TemporaryDirectory() as tmp:
        for threads in args.threads:
            cold, warm = [], []
            for repeat in range(args.repeats):
                dest = Path(tmp) / f"t{threads}-{repeat}"
                started = time.perf_counter()
                report = sync_s3_prefix("s3://bench/data/train", dest, threads=threads)
                cold.append(time.perf_counter() - started)
                assert report.downloaded == args.objects, report
                started = time.perf_counter()
                assert sync_s3_prefix("s3://bench/data/train", dest, threads=threads).skipped == args.objects
                warm.append(time.perf_counter() - started)
            seconds = statistics.median(cold)
            baseline = baseline or seconds
            print(f"| {threads} | {seconds:.2f} (x{baseline / seconds:.2f}) | {args.objects / seconds:.0f} | "
                  f"{statistics.median(warm):.2f} |")
    server.terminate()
    server.wait()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for(endpoint: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


if __name__ == "__main__":
    main()
