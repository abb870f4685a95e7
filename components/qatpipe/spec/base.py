"""What every spec section shares: unknown keys are errors, assignments are validated; and a section's defaults
for code that takes a setting outside a spec."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A spec section: `extra="forbid"` so a typo never silently falls back to a default."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def field_default(section: type[BaseModel], name: str) -> Any:
    """A spec field's default, for code that takes the setting outside a spec (a CLI flag, a layer argument):
    the spec stays the one home of every default."""
    return section.model_fields[name].get_default(call_default_factory=True)


def field_choices(section: type[BaseModel], name: str) -> tuple[str, ...]:
    """The values a Literal spec field allows, for a CLI flag's choices."""
    return get_args(section.model_fields[name].annotation)
