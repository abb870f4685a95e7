"""Kubernetes custom resources against the CustomResourceDefinitions that define them: the CRD's OpenAPI
schema as JSON Schema, every problem of a manifest as "path: message". No cluster needed: a job that would be
refused by the API server, or whose misspelt field the server would drop silently, fails here first."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from qatpipe.errors import QatpipeError

MAX_SHOWN = 25  # problems quoted in one error


def _kubernetes_to_jsonschema(node: Any) -> Any:
    """The CRD's structural schema as plain JSON Schema: int-or-string fields take either type, nullable
    fields take null, and objects with declared properties reject unknown ones (the API server would prune
    them silently: a misspelt field would be lost) unless marked x-kubernetes-preserve-unknown-fields."""
    if isinstance(node, list):
        return [_kubernetes_to_jsonschema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":  # field names, not keywords: keep them all
            out[key] = {name: _kubernetes_to_jsonschema(sub) for name, sub in value.items()}
        elif not key.startswith("x-kubernetes-") and key != "description":
            out[key] = _kubernetes_to_jsonschema(value)
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in out and "additionalProperties" not in out \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=8)
def _crd_schemas(crd_path: str, mtime: float) -> tuple[str, str, dict[str, dict]]:
    """(group, kind, {version: JSON Schema}); `mtime` is only part of the cache key."""
    import yaml

    try:
        # the C loader when PyYAML has it: these CRDs are ~9000 lines
        crd = yaml.load(Path(crd_path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        versions = {v["name"]: _kubernetes_to_jsonschema(v["schema"]["openAPIV3Schema"])
                    for v in crd["spec"]["versions"]}
    except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        raise QatpipeError(f"{crd_path}: not a readable CustomResourceDefinition with schemas ({exc})") from exc
    return group, kind, versions


def schema_problems(manifest: dict[str, Any], crd_path: str | Path) -> list[str]:
    """Every problem of `manifest` against the schema of the version its apiVersion names, as "path: message".
    Raises QatpipeError when the CRD cannot be read or defines another kind or group."""
    import jsonschema

    crd_path = Path(crd_path)
    if not crd_path.is_file():
        raise QatpipeError(f"{crd_path}: CRD file not found")
    group, kind, versions = _crd_schemas(str(crd_path), crd_path.stat().st_mtime)
    api_version = str(manifest.get("apiVersion", ""))
    want_group, _, version = api_version.partition("/")
    if want_group != group or manifest.get("kind") != kind or version not in versions:
        raise QatpipeError(f"manifest is {api_version or '?'} {manifest.get('kind', '?')}, but {crd_path} "
                           f"defines {kind} in {group} versions {', '.join(versions)}")
    validator = jsonschema.Draft7Validator(versions[version])
    problems = []
    for error in sorted(validator.iter_errors(manifest), key=lambda e: [str(p) for p in e.absolute_path]):
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
        message = error.message
        if error.validator == "pattern" and "[KMGTPE]i" in str(error.validator_value):
            message = f"{error.instance!r} is not a Kubernetes quantity (like 500m, 2, 16Gi)"
        message = message if len(message) <= 200 else message[:197] + "..."
        problems.append(f"{where or '(root)'}: {message}")
    return problems


def raise_problems(manifest: dict[str, Any], against: str, problems: list[str]) -> None:
    """QatpipeError listing `problems` (the first MAX_SHOWN), if there are any; `against` names what the
    manifest was checked against (a CRD file's name, or a set of rules)."""
    if not problems:
        return
    shown = problems[:MAX_SHOWN]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    raise QatpipeError(f"{manifest.get('kind', '?')} {manifest.get('apiVersion', '?')} manifest is invalid against "
                       f"{against} ({len(problems)} problem(s)):\n  " + "\n  ".join(shown) + more)
