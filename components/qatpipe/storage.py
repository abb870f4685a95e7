"""S3 (MinIO or AWS) access: sync a prefix into a local cache, upload a folder, fetch one object. On the ground floor:
data sets, pretrained weights (models/pretrained.py), resume state and spec sources all read S3 through it.

Credentials come only from the environment / boto's default chain; they are never
arguments and never logged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
)

from qatpipe.errors import StorageError
from qatpipe.fileio import LOCK_FILE, temp_path, write_json

log = logging.getLogger(__name__)

MANIFEST_NAME = ".qatpipe-s3-manifest.json"
_PROGRESS_EVERY = 50
DOWNLOAD_THREADS = 16  # objects fetched at once by sync_s3_prefix (bench/s3_sync.py measures 1 vs this)
_DENIED_CODES = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}


@dataclass
class SyncReport:
    downloaded: int = 0
    skipped: int = 0
    bytes: int = 0  # bytes actually downloaded in this sync
    removed: int = 0  # local files deleted because their object is gone from the bucket


def is_s3_uri(uri: str) -> bool:
    return str(uri).startswith("s3://")


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix/`` -> ``("bucket", "some/prefix")``."""
    if not is_s3_uri(uri):
        raise StorageError(f"not an s3:// URI: {uri!r}")
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    if not bucket:
        raise StorageError(f"malformed S3 URI {uri!r}: expected s3://bucket/prefix")
    return bucket, prefix.strip("/")


def _env_endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("S3_ENDPOINT_URL") or None


def s3_client(max_attempts: int = 5):
    """A boto3 S3 client configured from the environment (endpoint, region, credentials); each request is tried
    at most `max_attempts` times, the first included."""
    region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1"
    config = Config(
        # botocore's own `max_attempts` counts the retries only (2 would be 3 tries); total_max_attempts does not
        retries={"total_max_attempts": max_attempts, "mode": "standard"},
        connect_timeout=5,
        read_timeout=30,
        s3={"addressing_style": "path"},  # MinIO does not serve virtual-host buckets by default
        max_pool_connections=2 * DOWNLOAD_THREADS,  # one connection per download thread, and spare
    )
    # A fresh Session re-reads the environment; boto3's default session caches credentials.
    session = boto3.session.Session()
    return session.client("s3", endpoint_url=_env_endpoint(), region_name=region, config=config)


def _describe_endpoint(client) -> str:
    url = client.meta.endpoint_url
    return f"AWS default endpoint ({url})" if url.endswith("amazonaws.com") else url


@contextlib.contextmanager
def s3_errors(uri: str, client):
    """Turn boto errors into one-line StorageErrors naming the URI and the endpoint."""
    where = f"{uri} (endpoint: {_describe_endpoint(client)})"
    try:
        yield
    except (NoCredentialsError, PartialCredentialsError) as exc:
        raise StorageError(
            f"no S3 credentials for {where}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        ) from exc
    except (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError, ConnectionClosedError) as exc:
        raise StorageError(f"S3 endpoint unreachable for {where}: {exc}") from exc
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("NoSuchBucket", "404"):
            raise StorageError(f"bucket not found: {where}") from exc
        if code in _DENIED_CODES:
            raise StorageError(
                f"access denied to {where}: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
            ) from exc
        raise StorageError(f"S3 error {code or '?'} for {where}: {exc}") from exc
    except BotoCoreError as exc:
        raise StorageError(f"S3 request failed for {where}: {exc}") from exc


def _safe_join(base: Path, rel: str) -> Path:
    # Object keys are remote input: refuse any that would escape the destination folder.
    target = (base / rel).resolve()
    if target != base.resolve() and base.resolve() not in target.parents:
        raise StorageError(f"refusing S3 key {rel!r}: it points outside {base}")
    return target


def _load_manifest(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # missing or unreadable manifest: everything is re-checked by downloading


def _download(client, bucket: str, key: str, target: Path) -> tuple[int, str]:
    """Stream one object to ``target`` via a ``.part`` file; returns (size, etag)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    part = temp_path(target)
    try:
        resp = client.get_object(Bucket=bucket, Key=key)
        with open(part, "wb") as fh:
            for chunk in resp["Body"].iter_chunks(1 << 20):
                fh.write(chunk)
        size = part.stat().st_size
        os.replace(part, target)  # only a complete file ever gets the real name
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return size, resp["ETag"]


def _prune(dest: Path, keep: set[str]) -> list[str]:
    """Delete files under ``dest`` whose relative path is not in ``keep``; returns what went."""
    removed = []
    # os.walk does not descend into symlinked folders, so nothing outside dest is ever visited.
    for root, _dirs, names in os.walk(dest):
        for name in names:
            path = Path(root) / name
            rel = path.relative_to(dest).as_posix()
            # The manifest is ours to keep; a .part may be another process's download in flight.
            if rel in keep or rel == MANIFEST_NAME or name.endswith(".part"):
                continue
            path.unlink(missing_ok=True)
            removed.append(rel)
    return removed


def list_objects(uri: str, client=None, must_exist: bool = True) -> list[dict]:
    """Every object under the prefix `uri` names (Key, Size, ETag, ...); a StorageError when there is none,
    unless `must_exist` is false (an empty list then)."""
    bucket, prefix = parse_s3_uri(uri)
    client = client or s3_client()
    list_prefix = f"{prefix}/" if prefix else ""  # trailing slash: "train" must not match "train2"
    with s3_errors(uri, client):
        objects = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=list_prefix):
            objects += [o for o in page.get("Contents", []) if not o["Key"].endswith("/")]
        if not objects and must_exist:
            raise StorageError(f"no objects under {uri} (endpoint: {_describe_endpoint(client)})")
    return objects


def sync_s3_prefix(uri: str, dest_dir: str | Path, *, client=None, threads: int = DOWNLOAD_THREADS) -> SyncReport:
    """Mirror every object under ``uri`` into ``dest_dir``, skipping unchanged ones, ``threads`` downloads at
    a time (a boto3 client is thread-safe).

    Local files whose object is no longer listed are deleted (``.part`` files excepted).
    """
    bucket, prefix = parse_s3_uri(uri)
    client = client or s3_client()
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    manifest_path = dest / MANIFEST_NAME
    manifest = _load_manifest(manifest_path)
    list_prefix = f"{prefix}/" if prefix else ""  # trailing slash: "train" must not match "train2"
    report = SyncReport()

    objects = list_objects(uri, client)
    log.info("syncing %d objects from %s to %s", len(objects), uri, dest)

    # Check every key before touching the disk: one bad key must not leave a half-pruned cache.
    rels = [obj["Key"][len(list_prefix):] for obj in objects]
    targets = [_safe_join(dest, rel) for rel in rels]
    # Compare in resolved form: the key "a//b" and the local file "a/b" are the same path.
    keep = {t.relative_to(dest.resolve()).as_posix() for t in targets}
    report.removed = len(_prune(dest, keep))
    if report.removed:
        log.info("%s: removed %d local files no longer in the bucket", uri, report.removed)
    listed = set(rels)
    manifest = {rel: entry for rel, entry in manifest.items() if rel in listed}

    wanted = []
    for obj, rel, target in zip(objects, rels, targets):
        if (manifest.get(rel) == {"size": obj["Size"], "etag": obj["ETag"]}
                and target.is_file() and target.stat().st_size == obj["Size"]):
            report.skipped += 1
        else:
            wanted.append((obj["Key"], rel, target))
    pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="s3-sync")
    pending: dict = {}

    def record(done) -> None:
        size, etag = done.result()
        manifest[pending.pop(done)] = {"size": size, "etag": etag}
        report.downloaded += 1
        report.bytes += size

    try:
        with s3_errors(uri, client):
            pending.update({pool.submit(_download, client, bucket, key, target): rel for key, rel, target in wanted})
            for done in as_completed(list(pending)):
                record(done)  # the first failure stops the sync: queued downloads are cancelled
                if report.downloaded % _PROGRESS_EVERY == 0:
                    write_json(manifest_path, manifest)  # keep progress if killed later
                    log.info("%s: %d/%d objects downloaded (%.1f MB)", uri, report.downloaded, len(wanted),
                             report.bytes / 1e6)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # downloads in flight finish or clean up their .part
        for done in [f for f in pending if f.done() and not f.cancelled() and f.exception() is None]:
            record(done)  # finished while the failure was being handled: keep them too
        # Also on failure, so files already fetched are not downloaded again by the retry.
        write_json(manifest_path, manifest)
    log.info("synced %s: %d downloaded, %d skipped, %d removed, %.1f MB",
             uri, report.downloaded, report.skipped, report.removed, report.bytes / 1e6)
    return report


def resolve_dataset_dir(uri: str, cache_dir: str | Path) -> Path:
    """A local path as-is; an s3:// URI synced into ``cache_dir/s3/<bucket>/<prefix>``."""
    if not is_s3_uri(uri):
        return Path(uri)
    bucket, prefix = parse_s3_uri(uri)
    root = Path(cache_dir) / "s3"
    local = _safe_join(root, f"{bucket}/{prefix}" if prefix else bucket)
    sync_s3_prefix(uri, local)
    return local


def download_s3_file(uri: str, cache_dir: str | Path, *, client=None) -> Path:
    """One object (a weights file, say) cached at ``cache_dir/s3/<bucket>/<key>``; downloaded again only when
    its size or ETag changed."""
    bucket, key = parse_s3_uri(uri)
    if not key:
        raise StorageError(f"{uri}: names a bucket, not a file (expected s3://bucket/path/to/file)")
    client = client or s3_client()
    target = _safe_join(Path(cache_dir) / "s3", f"{bucket}/{key}")
    etag_file = target.with_name(target.name + ".etag")
    with s3_errors(uri, client):
        try:
            head = client.head_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code", "")) in ("404", "NoSuchKey", "NoSuchBucket"):
                raise StorageError(f"no such object: {uri} (endpoint: {_describe_endpoint(client)})") from exc
            raise
        if (target.is_file() and target.stat().st_size == head["ContentLength"] and etag_file.is_file()
                and etag_file.read_text() == head["ETag"]):
            log.info("%s: cached at %s", uri, target)
            return target
        size, etag = _download(client, bucket, key, target)
    etag_file.write_text(etag)
    log.info("downloaded %s to %s (%.1f MB)", uri, target, size / 1e6)
    return target


def upload_dir(local_dir: str | Path, uri: str, *, client=None) -> int:
    """Upload every file under ``local_dir`` to ``uri``; returns the number of files."""
    bucket, prefix = parse_s3_uri(uri)
    src = Path(local_dir)
    if not src.is_dir():
        raise StorageError(f"cannot upload {src} to {uri}: not a folder")
    client = client or s3_client()
    # not the sync manifest, half-written `.part` files, nor a results folder's lock
    files = sorted(p for p in src.rglob("*")
                   if p.is_file() and p.name not in (MANIFEST_NAME, LOCK_FILE) and not p.name.endswith(".part"))
    with s3_errors(uri, client):
        for path in files:
            rel = path.relative_to(src).as_posix()
            client.upload_file(str(path), bucket, f"{prefix}/{rel}" if prefix else rel)
    log.info("uploaded %d files from %s to %s", len(files), src, uri)
    return len(files)


def read_s3_text(uri: str, *, client=None) -> str:
    """The UTF-8 text of one S3 object (a spec file, say)."""
    bucket, key = parse_s3_uri(uri)
    client = client or s3_client()
    with s3_errors(uri, client):
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise StorageError(f"{uri}: not a UTF-8 text file") from None
