"""Spec validation errors as people read them: one line per key (`train.epochs: must be >= 1 (got -1)`), the
`--set` override that set a key named instead of the spec file, the nearest known key suggested for an unknown
one; never pydantic's own text or its URL."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Iterable, Sequence

from pydantic import BaseModel, ValidationError

# pydantic's error type -> the message, from its context (ctx); "(got <input>)" is added where it helps
_MESSAGES = {
    "missing": "required key is missing",
    "extra_forbidden": "unknown key",
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
    "multiple_of": "must be a multiple of {multiple_of}",
    "literal_error": "must be {expected}",
    "enum": "must be {expected}",
    "int_parsing": "must be an integer",
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "bool_parsing": "must be true or false",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a mapping (key: value)",
    "model_type": "must be a section (key: value)",
    "model_attributes_type": "must be a section (key: value)",
    "too_short": "must have at least {min_length} item(s)",
    "too_long": "must have at most {max_length} item(s)",
    "string_pattern_mismatch": "must match {pattern}",
}
_NO_INPUT = {"missing", "extra_forbidden", "value_error", "assertion_error", "unknown_architecture"}


def format_validation_error(exc: ValidationError, source: str | None = None, overrides: Sequence[str] = (),
                            schema: type[BaseModel] | None = None) -> str:
    """`exc` as one line per key. `source` names where the data came from (a spec file); an error on a key that
    one of `overrides` (`a.b=value`, applied last) set names that override instead; with `schema` (the model
    that was validated) an unknown key gets the nearest known one as a suggestion."""
    lines: dict[tuple[str, str], list[str]] = {}  # (origin, key) -> messages: a union's members share one line
    for err in exc.errors():
        key, section = _key(err, schema)
        origin = _override_for(key, overrides) or source
        message = _message(err)
        if err["type"] == "extra_forbidden" and section is not None:
            message += _suggestion(key, section)
        lines.setdefault((origin or "", _dotted(key)), []).append(message)
    if len(lines) == 1:
        (origin, key), messages = next(iter(lines.items()))
        return ": ".join(part for part in (origin, key, _joined(messages)) if part)
    header = f"{source}: invalid spec" if source else "invalid settings"
    shown = [": ".join(part for part in (origin if origin != source else "", key, _joined(messages)) if part)
             for (origin, key), messages in lines.items()]  # the header names the source: its lines do not
    return "\n  ".join([f"{header}, {len(shown)} errors:", *shown])


def _key(err: dict, schema: type[BaseModel] | None) -> tuple[list[str], list[type[BaseModel]] | None]:
    """The error's key as the spec spells it (union tags such as model.arch's `ssd` or `list[str]` dropped,
    fields by their alias), and the sections that could hold its last part (None where the schema is unknown)."""
    parts = list(err["loc"])
    if err["type"] == "unknown_architecture" and isinstance(err["input"], dict):
        parts.append("arch")  # the discriminator's error is the model section's; its key is model.arch
    candidates = [schema] if schema is not None else None
    key: list[str] = []
    for index, part in enumerate(parts):
        if isinstance(part, int):
            key.append(f"[{part}]")
            candidates = None
            continue
        last = index == len(parts) - 1
        if candidates is not None and len(candidates) > 1 and not (last and err["type"] == "extra_forbidden"):
            tagged = [model for model in candidates if _tag(model) == part]
            if tagged:  # a discriminated union's tag: it picks the section, it is no key
                candidates = tagged
                continue
        if any(bracket in part for bracket in "[('"):
            continue  # a union member's type (`list[str]`, `literal['auto']`), no key
        name, field = _field(candidates, part)
        key.append(name)
        if not last:
            candidates = _models_in(field.annotation) if field is not None else None
            candidates = candidates or None
    section = candidates if err["type"] == "extra_forbidden" else None
    return key, section


def _field(candidates: list[type[BaseModel]] | None, part: str):
    """The field called `part` (its name or alias) in the candidate sections: (the name the spec uses, info)."""
    for model in candidates or ():
        for name, info in model.model_fields.items():
            if part in (name, info.alias):
                return info.alias or name, info
    return part, None


def _tag(model: type[BaseModel]) -> Any:
    field = model.model_fields.get("arch")
    return field.default if field is not None else None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The sections an annotation admits: the class itself, or a Union's / Optional's / Annotated's members."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        args = typing.get_args(annotation)
        args = args[:1] if origin is typing.Annotated else args
        return [model for arg in args for model in _models_in(arg)]
    return []


def _override_for(key: list[str], overrides: Sequence[str]) -> str | None:
    """The last override that set `key`, a section holding it, or a key inside it (a section's own check)."""
    for item in reversed(overrides):
        path = [part for part in item.split("=", 1)[0].strip().split(".") if part]
        if key and path and (key[:len(path)] == path or path[:len(key)] == key):
            return f"--set {item}"
    return None


def _message(err: dict) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind in ("value_error", "assertion_error"):  # a section's own check: its message says it all
        return str(ctx.get("error", err["msg"])).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if kind == "unknown_architecture":  # the model section's discriminator: its arch, or not a section at all
        if not isinstance(err["input"], dict):
            return f"{_MESSAGES['model_type']} (got {_shown(err['input'])})"
        return f"{err['msg'].removeprefix('model.arch ')} (got {_shown(err['input'].get('arch'))})"
    template = _MESSAGES.get(kind)
    try:
        message = template.format(**{k: _shown(v, quote=False) for k, v in ctx.items()}) if template else None
    except (KeyError, IndexError):
        message = None
    message = message or err["msg"].replace("Input should be", "must be")
    if kind in ("too_short", "too_long") and "actual_length" in ctx:
        return f"{message} (got {ctx['actual_length']})"
    return message if kind in _NO_INPUT else f"{message} (got {_shown(err['input'])})"


def _dotted(key: list[str]) -> str:
    """['engine', 'bench', 'batch_sizes', '[0]'] -> engine.bench.batch_sizes[0]"""
    return "".join(part if part.startswith("[") or not index else f".{part}" for index, part in enumerate(key))


def _joined(messages: Iterable[str]) -> str:
    """One key's messages: a union's members each say what they take (`must be 'auto' or a list`), the input
    once at the end."""
    messages = list(dict.fromkeys(messages))
    if len(messages) == 1:
        return messages[0]
    got = {message.rpartition(" (got ")[2] for message in messages if " (got " in message}
    if len(got) == 1 and all(" (got " in message and message.startswith("must be ") for message in messages):
        takes = [message.rpartition(" (got ")[0].removeprefix("must be ") for message in messages]
        return f"must be {' or '.join(takes)} (got {got.pop()}"
    return "; ".join(messages)


def _suggestion(key: list[str], sections: list[type[BaseModel]]) -> str:
    """` (did you mean train.epochs?)` for the unknown key train.epoch, or nothing."""
    known = {info.alias or name for model in sections for name, info in model.model_fields.items()}
    close = difflib.get_close_matches(key[-1], sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {'.'.join([*key[:-1], close[0]])}?)" if close else ""


def _shown(value: Any, quote: bool = True) -> str:
    """A value as YAML writes it, shortened."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, float) and value.is_integer() and not quote:
        text = str(int(value))
    elif isinstance(value, str) and quote:
        text = repr(value)
    else:
        text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."
