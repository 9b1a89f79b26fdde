"""Pydantic validation errors as the one-line reasons users read (CLI, console, registrations)."""

from __future__ import annotations

from pydantic import ValidationError


def field_errors(exc: ValidationError, root: str) -> list[str]:
    """Each problem as `field.path: message`; `root` stands for the path of a problem about the whole value."""
    return [f"{'.'.join(map(str, e['loc'])) or root}: {e['msg']}" for e in exc.errors()]
