"""Registered JSON Schemas of tool parameters, checked in the SDK and again at the processor boundary.

The SDK check gives the agent an immediate error; the processor check catches producers that
bypass the SDK (any language can write the topics), whose bad calls go to dead letters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from jsonschema.protocols import Validator

from topics.json_budget import json_depth_problem


class InvalidParamsError(ValueError):
    """Tool parameters that do not match the tool's registered JSON Schema."""


class ToolSchemas:
    """Tool name -> compiled JSON Schema validator. Tools with no schema accept any JSON object."""

    def __init__(self, schemas: dict[str, dict[str, Any]] | None = None) -> None:
        self._validators: dict[str, Draft202012Validator] = {}
        for tool, schema in (schemas or {}).items():
            self.register(tool, schema)

    @classmethod
    def load(cls, path: Path | None) -> ToolSchemas:
        if path is None:
            return cls()
        try:
            return cls(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read tool schemas from {path}: {exc}") from exc

    def register(self, tool: str, schema: dict[str, Any]) -> None:
        Draft202012Validator.check_schema(schema)
        self._validators[tool] = Draft202012Validator(schema)

    def __contains__(self, tool: str) -> bool:
        return tool in self._validators

    def error(self, tool: str, params: Any) -> str | None:
        """Why `params` is invalid for `tool`, or None when it is valid."""
        if not isinstance(params, dict):
            return f"params of {tool} must be a JSON object, got {type(params).__name__}"
        validator = self._validators.get(tool)
        return None if validator is None else first_problem(validator, params, f"params of {tool}")

    def error_in_json(self, tool: str, params_json: str) -> str | None:
        """Why `params_json` is invalid for `tool`, or None; too deep a document is refused before it is parsed."""
        if (problem := json_depth_problem("params_json", params_json)) is not None:
            return problem
        try:
            params = json.loads(params_json)
        except json.JSONDecodeError as exc:
            return f"params of {tool} are not valid JSON: {exc}"
        return self.error(tool, params)

    def validate(self, tool: str, params: Any) -> None:
        problem = self.error(tool, params)
        if problem is not None:
            raise InvalidParamsError(problem)


def first_problem(validator: Validator, data: Any, what: str) -> str | None:
    """The most relevant reason `data` fails `validator`, as one line naming where ("<root>" for the top)."""
    error = best_match(validator.iter_errors(data))
    if error is None:
        return None
    at = "/".join(str(p) for p in error.absolute_path) or "<root>"
    return f"{what} invalid at {at}: {error.message}"
