"""Where a spec comes from: a bundled name (`default`, `full`, `tiny`), a local file, or an s3:// object."""

from __future__ import annotations

from pathlib import Path

from qatpipe.spec import ExperimentSpec, bundled_spec_path, load_spec, load_spec_text


def spec_path(value: str) -> Path:
    """A spec file path, or the path of the bundled spec named `value`."""
    path = Path(value)
    if path.exists() or path.suffix in (".yaml", ".yml") or "/" in value:
        return path
    return bundled_spec_path(value)


def load_spec_uri(uri: str, overrides: list[str] | None = None) -> ExperimentSpec:
    """Load, override and validate the spec at `uri` (bundled name, path or s3://bucket/key)."""
    from qatpipe.storage import is_s3_uri, read_s3_text

    if is_s3_uri(uri):
        return load_spec_text(read_s3_text(uri), overrides, source=uri)
    return load_spec(spec_path(uri), overrides)
