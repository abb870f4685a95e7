"""Tests for qatpipe.storage against a real HTTP S3 endpoint.

No real S3 or MinIO can run here, so moto's standalone server (ThreadedMotoServer)
stands in for it: boto3 talks HTTP to it exactly as it would to MinIO/S3.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import urllib.request
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ReadTimeoutError
from moto.server import ThreadedMotoServer

from qatpipe.storage import (
    MANIFEST_NAME,
    SyncReport,
    is_s3_uri,
    list_objects,
    parse_s3_uri,
    resolve_dataset_dir,
    s3_client,
    sync_s3_prefix,
    upload_dir,
)
from qatpipe.errors import StorageError
from qatpipe.fileio import LOCK_FILE

BUCKET = "bucket"
PREFIX = "datasets/train"
URI = f"s3://{BUCKET}/{PREFIX}"

# A tiny KITTI-like tree: relative path -> bytes.
TREE = {
    "images/000000.jpg": b"\xff\xd8\xff\xe0fake-jpeg-0" + bytes(range(256)),
    "images/000001.jpg": b"\xff\xd8\xff\xe0fake-jpeg-1" + bytes(range(255, -1, -1)),
    "labels/000000.txt": b"Car 0.00 0 -1.58 587.01 173.33 614.12 200.12 1.65 1.67 3.64 -0.65 1.71 46.70 -1.59\n",
    "labels/000001.txt": b"Pedestrian 0.00 0 0.21 423.17 173.67 433.17 224.03 1.60 0.38 0.30 -5.87 1.63 23.11 -0.03\n",
}


@pytest.fixture(scope="module")
def moto_endpoint():
    # Port 0: the OS picks a free port for the server's own socket (no race with other processes).
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_env(moto_endpoint, monkeypatch):
    """Point boto at the moto server with fake credentials; start each test with empty S3."""
    urllib.request.urlopen(urllib.request.Request(f"{moto_endpoint}/moto-api/reset", method="POST"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.delenv("S3_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return moto_endpoint


@pytest.fixture
def raw(s3_env):
    """A plain boto3 client (independent of the module under test) to seed/inspect S3."""
    return boto3.client("s3", endpoint_url=s3_env, region_name="us-east-1")


@pytest.fixture
def seeded(raw):
    raw.create_bucket(Bucket=BUCKET)
    for rel, data in TREE.items():
        raw.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{rel}", Body=data)
    # Neighbours that must NOT be synced: a sibling prefix sharing the string prefix.
    raw.put_object(Bucket=BUCKET, Key="datasets/train2/images/x.jpg", Body=b"nope")
    raw.put_object(Bucket=BUCKET, Key="datasets/val/labels/x.txt", Body=b"nope")
    return raw


def _local_files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_NAME}


def test_resolve_dataset_dir_downloads_tree(seeded, tmp_path):
    local = resolve_dataset_dir(URI, tmp_path)
    assert local == tmp_path / "s3" / BUCKET / "datasets" / "train"
    assert _local_files(local) == TREE
    assert not list(local.rglob("*.part"))
    assert (local / MANIFEST_NAME).is_file()


def test_resolve_local_path_unchanged(tmp_path):
    assert resolve_dataset_dir("/data/kitti/train", tmp_path) == Path("/data/kitti/train")
    assert not (tmp_path / "s3").exists()


def test_second_sync_skips_and_changed_object_is_redownloaded(seeded, tmp_path):
    first = sync_s3_prefix(URI, tmp_path)
    assert first == SyncReport(downloaded=4, skipped=0, bytes=sum(map(len, TREE.values())))

    second = sync_s3_prefix(URI, tmp_path)
    assert (second.downloaded, second.skipped, second.bytes) == (0, 4, 0)

    # Same size, different content: only the ETag tells them apart.
    old = TREE["labels/000000.txt"]
    new = old.replace(b"Car", b"Van")
    assert len(new) == len(old)
    seeded.put_object(Bucket=BUCKET, Key=f"{PREFIX}/labels/000000.txt", Body=new)

    third = sync_s3_prefix(URI, tmp_path)
    assert (third.downloaded, third.skipped, third.bytes) == (1, 3, len(new))
    assert (tmp_path / "labels/000000.txt").read_bytes() == new
    assert _local_files(tmp_path) == {**TREE, "labels/000000.txt": new}


def test_locally_deleted_file_is_redownloaded(seeded, tmp_path):
    sync_s3_prefix(URI, tmp_path)
    (tmp_path / "images/000001.jpg").unlink()
    report = sync_s3_prefix(URI, tmp_path)
    assert (report.downloaded, report.skipped) == (1, 3)
    assert _local_files(tmp_path) == TREE


def test_objects_deleted_from_bucket_are_removed_locally(seeded, tmp_path, caplog):
    dest = tmp_path / "dest"
    assert sync_s3_prefix(URI, dest).downloaded == 4
    # Things the pruning must leave alone: another process's download in flight, and a
    # symlinked folder whose files live outside dest.
    foreign_part = dest / "images" / "000002.jpg.4242-deadbeef.part"
    foreign_part.write_bytes(b"in flight")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_bytes(b"not ours")
    (dest / "linked").symlink_to(outside, target_is_directory=True)

    gone = ["images/000001.jpg", "labels/000001.txt"]
    for rel in gone:
        seeded.delete_object(Bucket=BUCKET, Key=f"{PREFIX}/{rel}")
    caplog.set_level(logging.INFO, logger="qatpipe")
    report = sync_s3_prefix(URI, dest)

    assert report == SyncReport(downloaded=0, skipped=2, bytes=0, removed=2)
    assert _local_files(dest) == {
        **{rel: data for rel, data in TREE.items() if rel not in gone},
        "images/000002.jpg.4242-deadbeef.part": b"in flight",
    }
    assert (dest / "linked").is_symlink()
    assert (outside / "keep.txt").read_bytes() == b"not ours"
    manifest = json.loads((dest / MANIFEST_NAME).read_text())
    assert sorted(manifest) == ["images/000000.jpg", "labels/000000.txt"]
    assert any("2 removed" in r.getMessage() for r in caplog.records)


class _FailingBodyClient:
    """Delegates to a real client, but every download dies after its first chunk.

    While a download is in flight it records the ``.part`` files under ``watch``.
    """

    def __init__(self, client, watch=None):
        self._client = client
        self._watch = watch
        self.parts_seen = []

    def __getattr__(self, name):
        return getattr(self._client, name)

    def get_object(self, **kwargs):
        resp = self._client.get_object(**kwargs)

        def chunks(_size):
            if self._watch is not None:
                self.parts_seen += sorted(p.name for p in self._watch.rglob("*.part"))
            yield resp["Body"].read(5)
            raise ReadTimeoutError(endpoint_url=self._client.meta.endpoint_url)

        resp["Body"].iter_chunks = chunks
        return resp


def test_interrupted_download_leaves_old_file_and_no_partial(seeded, tmp_path):
    sync_s3_prefix(URI, tmp_path)
    old = TREE["images/000000.jpg"]
    seeded.put_object(Bucket=BUCKET, Key=f"{PREFIX}/images/000000.jpg", Body=b"new-content" * 100)
    # Another process sharing the cache is downloading the same file right now.
    foreign = tmp_path / "images" / "000000.jpg.part"
    foreign.write_bytes(b"theirs")

    client = _FailingBodyClient(s3_client(max_attempts=1), watch=tmp_path)
    with pytest.raises(StorageError, match="unreachable"):
        sync_s3_prefix(URI, tmp_path, client=client)
    assert (tmp_path / "images/000000.jpg").read_bytes() == old
    # Our temp name is our own (pid + random suffix), and it is cleaned up; theirs is untouched.
    ours = [name for name in client.parts_seen if name != foreign.name]
    assert len(ours) == 1
    assert re.fullmatch(rf"000000\.jpg\.{os.getpid()}-[0-9a-f]{{8}}\.part", ours[0])
    assert list(tmp_path.rglob("*.part")) == [foreign]
    assert foreign.read_bytes() == b"theirs"

    # The next (healthy) sync picks up the change.
    report = sync_s3_prefix(URI, tmp_path)
    assert (report.downloaded, report.skipped, report.removed) == (1, 3, 0)
    assert (tmp_path / "images/000000.jpg").read_bytes() == b"new-content" * 100
    assert foreign.read_bytes() == b"theirs"


class _VanishingObjectClient:
    """Delegates to a real client; one object (`VANISHING`) is deleted between the listing and its GET."""

    VANISHING = "images/000001.jpg"

    def __init__(self, client, raw):
        self._client = client
        self._raw = raw
        self.gets = []
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._client, name)

    def get_object(self, **kwargs):
        with self._lock:  # downloads run in threads
            self.gets.append(kwargs["Key"])
            if kwargs["Key"].endswith(self.VANISHING):
                self._raw.delete_object(**kwargs)
        return self._client.get_object(**kwargs)


@pytest.mark.parametrize("threads", [1, 16])
def test_failed_sync_keeps_manifest_of_finished_downloads(seeded, tmp_path, threads):
    client = _VanishingObjectClient(s3_client(max_attempts=1), seeded)
    with pytest.raises(StorageError, match="NoSuchKey"):
        sync_s3_prefix(URI, tmp_path, client=client, threads=threads)
    failed = _VanishingObjectClient.VANISHING
    fetched = {key[len(PREFIX) + 1:] for key in client.gets} - {failed}
    # every download that finished, also alongside the failure, is in the manifest and on disk; nothing else
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert set(manifest) == fetched
    assert _local_files(tmp_path) == {rel: TREE[rel] for rel in fetched}

    # The object comes back; the retry fetches only what is still missing.
    seeded.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{failed}", Body=TREE[failed])
    report = sync_s3_prefix(URI, tmp_path)
    assert (report.downloaded, report.skipped) == (len(TREE) - len(fetched), len(fetched))
    assert _local_files(tmp_path) == TREE


def test_missing_bucket_names_uri(s3_env, tmp_path):
    uri = "s3://no-such-bucket/datasets/train"
    with pytest.raises(StorageError) as ei:
        sync_s3_prefix(uri, tmp_path)
    msg = str(ei.value)
    assert uri in msg
    assert "bucket not found" in msg
    assert s3_env in msg


def test_empty_prefix_says_no_objects(seeded, tmp_path):
    uri = f"s3://{BUCKET}/datasets/test"
    with pytest.raises(StorageError, match="no objects under s3://bucket/datasets/test"):
        resolve_dataset_dir(uri, tmp_path)
    assert list_objects(uri, must_exist=False) == []  # where an empty prefix is normal (a resume mirror)


def test_unreachable_endpoint_keeps_existing_files(monkeypatch, tmp_path):
    # A bound but non-listening socket: connecting to it is refused, and no one else can take the port.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        existing = tmp_path / "images" / "000000.jpg"
        existing.parent.mkdir()
        existing.write_bytes(b"precious")

        client = s3_client(max_attempts=2)
        sent = []  # every HTTP attempt, retries included, passes botocore's before-send event
        client.meta.events.register("before-send.s3", lambda request, **_: sent.append(request.url))
        with pytest.raises(StorageError) as ei:
            sync_s3_prefix(URI, tmp_path, client=client)
        assert len(sent) == 2  # max_attempts: one try and one retry, then it gave up

    msg = str(ei.value)
    assert "unreachable" in msg
    assert endpoint in msg and URI in msg
    assert existing.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["000000.jpg", "images"]


def test_missing_credentials_names_env_vars(s3_env, monkeypatch, tmp_path):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    # Keep boto from finding credentials anywhere else (files, instance metadata).
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StorageError) as ei:
        sync_s3_prefix(URI, tmp_path / "dest")
    msg = str(ei.value)
    assert "AWS_ACCESS_KEY_ID" in msg and "AWS_SECRET_ACCESS_KEY" in msg and URI in msg


@pytest.mark.parametrize("uri", ["s3://", "s3:///x", "http://bucket/x", "bucket/x"])
def test_malformed_uri(uri, tmp_path):
    with pytest.raises(StorageError):
        parse_s3_uri(uri)
    with pytest.raises(StorageError):
        sync_s3_prefix(uri, tmp_path)


def test_uri_helpers():
    assert is_s3_uri("s3://b/p") and not is_s3_uri("/data/s3://x")
    assert parse_s3_uri("s3://b") == ("b", "")
    assert parse_s3_uri("s3://b/a/b/") == ("b", "a/b")


def test_upload_dir_round_trip(s3_env, raw, tmp_path):
    raw.create_bucket(Bucket="results")
    src = tmp_path / "src"
    for rel, data in TREE.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    (src / MANIFEST_NAME).write_text("{}")  # bookkeeping is never published
    (src / LOCK_FILE).write_text("123 (qatpipe data synth)")  # nor a results folder's lock

    assert upload_dir(src, "s3://results/run-1/") == 4
    keys = sorted(o["Key"] for o in raw.list_objects_v2(Bucket="results")["Contents"])
    assert keys == sorted(f"run-1/{rel}" for rel in TREE)

    back = resolve_dataset_dir("s3://results/run-1", tmp_path / "cache")
    assert _local_files(back) == TREE


def test_data_upload_checks_the_data_set_then_publishes_it(s3_env, raw, tmp_path, capsys, caplog):
    """`qatpipe data upload` (upload_dir's user): with a spec, a data set that breaks the KITTI checks fails
    before anything is uploaded; a good one lands where dataset.train / dataset.val will name it."""
    from qatpipe.cli import main
    from qatpipe.data.synth import write_synthetic_dataset

    raw.create_bucket(Bucket="data")
    write_synthetic_dataset(tmp_path / "kitti", 4, 2, 0)
    label = next((tmp_path / "kitti" / "val" / "labels").iterdir())
    good = label.read_text()
    label.write_text("car 0 0 0 10 10\n")  # a malformed line
    assert main(["data", "upload", "--src", str(tmp_path / "kitti"), "--to", "s3://data/set1", "-e", "tiny"]) != 0
    assert f"val/labels/{label.name}:1: expected 15 KITTI fields" in caplog.text  # the file and line
    assert "Contents" not in raw.list_objects_v2(Bucket="data")
    label.write_text(good)
    assert main(["data", "upload", "--src", str(tmp_path / "kitti"), "--to", "s3://data/set1", "-e", "tiny"]) == 0
    keys = [o["Key"] for o in raw.list_objects_v2(Bucket="data")["Contents"]]
    assert sum(k.startswith(("set1/train/", "set1/val/")) for k in keys) == 12  # 6 images, 6 labels
    assert f"{len(keys)} files uploaded to s3://data/set1 (dataset.train: s3://data/set1/train" in \
        capsys.readouterr().out
    # a destination that is not S3, or a folder that is not there, is one line naming it
    caplog.clear()
    assert main(["data", "upload", "--src", str(tmp_path / "kitti"), "--to", "data/set1", "-e", "tiny"]) != 0
    assert "not an s3:// URI: 'data/set1'" in caplog.text
    assert main(["data", "upload", "--src", str(tmp_path / "nope"), "--to", "s3://data/set2"]) != 0
    assert f"cannot upload {tmp_path / 'nope'} to s3://data/set2: not a folder" in caplog.text


def test_secret_never_logged(s3_env, seeded, monkeypatch, caplog, tmp_path):
    secret = "testing-secret-xyz"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)  # moto accepts any credentials
    caplog.set_level(logging.DEBUG, logger="qatpipe")
    caplog.set_level(logging.DEBUG)  # botocore/urllib3 too
    report = sync_s3_prefix(URI, tmp_path)
    assert report.downloaded == 4
    assert any(r.name == "qatpipe.storage" and "4 downloaded" in r.getMessage() for r in caplog.records)
    assert secret not in caplog.text


def test_spec_with_s3_dataset_reads_through_the_cache(raw, tiny_dataset, tiny_spec, tmp_path):
    """The whole path a training pod takes: spec says s3://, boto3 fetches, the KITTI reader validates."""
    from qatpipe.data.splits import load_split

    raw.create_bucket(Bucket=BUCKET)
    local = tiny_dataset / "val"
    for path in sorted(local.rglob("*")):
        if path.is_file():
            raw.put_object(Bucket=BUCKET, Key=f"kitti/val/{path.relative_to(local)}", Body=path.read_bytes())
    spec = tiny_spec(f"dataset.val=s3://{BUCKET}/kitti/val", f"dataset.cache_dir={tmp_path / 'cache'}")
    from_s3 = load_split(spec, "val")
    from_disk = load_split(tiny_spec(), "val")
    assert len(from_s3) == len(from_disk) == 48
    assert from_s3[0].image_path.is_relative_to(tmp_path / "cache")
    for a, b in zip(from_s3, from_disk):
        assert a.image_path.name == b.image_path.name
        assert a.image_path.read_bytes() == b.image_path.read_bytes()
        assert (a.boxes == b.boxes).all() and (a.classes == b.classes).all()


def test_the_data_fingerprint_follows_the_s3_listing(seeded, tiny_spec, tmp_path):
    """prepare-data's cache key: the same URIs give another fingerprint once an object is added or replaced
    (its ETag), and the same one while nothing changed; nothing is downloaded to compute it."""
    from qatpipe.data.prepare import data_fingerprint

    spec = tiny_spec(f"dataset.train={URI}", f"dataset.val=s3://{BUCKET}/datasets/val",
                     f"dataset.cache_dir={tmp_path / 'cache'}")
    first = data_fingerprint(spec)
    assert data_fingerprint(spec) == first and not (tmp_path / "cache").exists()
    old = TREE["labels/000000.txt"]
    seeded.put_object(Bucket=BUCKET, Key=f"{PREFIX}/labels/000000.txt", Body=old.replace(b"Car", b"Van"))
    replaced = data_fingerprint(spec)
    seeded.put_object(Bucket=BUCKET, Key=f"{PREFIX}/labels/000002.txt", Body=old)
    assert len({first, replaced, data_fingerprint(spec)}) == 3


def test_a_spec_loads_from_s3_and_a_missing_one_is_named(raw, capsys, caplog):
    """`-e s3://bucket/key` (spec_sources.load_spec_uri): the object's YAML, overridden and validated as a local
    spec file is; a missing key or bucket and an invalid spec are one clear error naming the URI."""
    from qatpipe.cli import main
    from qatpipe.errors import SpecError
    from qatpipe.spec import bundled_spec_path, load_spec
    from qatpipe.spec_sources import load_spec_uri

    raw.create_bucket(Bucket=BUCKET)
    raw.put_object(Bucket=BUCKET, Key="specs/tiny.yaml", Body=bundled_spec_path("tiny").read_bytes())
    uri = f"s3://{BUCKET}/specs/tiny.yaml"
    spec = load_spec_uri(uri, ["train.epochs=2"])
    assert spec.to_dict() == load_spec(bundled_spec_path("tiny"), ["train.epochs=2"]).to_dict()
    assert main(["spec", "show", "-e", uri, "--set", "train.epochs=7"]) == 0
    assert "epochs: 7" in capsys.readouterr().out

    missing = f"s3://{BUCKET}/specs/nope.yaml"
    with pytest.raises(StorageError, match=rf"^S3 error NoSuchKey for {re.escape(missing)} \(endpoint: .*not exist"):
        load_spec_uri(missing)
    with pytest.raises(StorageError, match="^bucket not found: s3://no-such-bucket/spec.yaml"):
        load_spec_uri("s3://no-such-bucket/spec.yaml")
    with caplog.at_level(logging.ERROR):  # the command line: that one line, exit code 2
        assert main(["spec", "show", "-e", missing]) == 2
    assert f"S3 error NoSuchKey for {missing}" in caplog.text and "Traceback" not in caplog.text

    bad = f"s3://{BUCKET}/specs/bad.yaml"
    raw.put_object(Bucket=BUCKET, Key="specs/bad.yaml", Body=b"dataset: {classes: [car]}\ntrain: {epochz: 3}\n")
    with pytest.raises(SpecError, match=f"^{re.escape(bad)}: train.epochz: unknown key"):
        load_spec_uri(bad)
