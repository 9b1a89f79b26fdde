"""The configuration page (docs/configuration.md), generated from the `Settings` field descriptions.

The descriptions are the documentation: this renders them, with each field's environment variable and default, so
the page cannot drift from the code (a test compares them). Regenerate with
`python -m topics.settings_doc > docs/configuration.md`.
"""

from __future__ import annotations

from pathlib import Path

from topics import native_codec
from topics.settings import Settings, env_var

REGENERATE = "python -m topics.settings_doc > docs/configuration.md"

_INTRO = f"""\
# Configuration

<!-- Generated from the Settings field descriptions: edit those, then run `{REGENERATE}`. -->

Every setting comes from the environment. `Settings.from_env()` is the only reader, except `{native_codec.ENV}`, which
the Avro codec reads itself (the SDK uses the codec without settings). Lists are comma-separated; switches are `1` or
`0`. A value treadle cannot use stops the command with one `error:` line naming the variable, its value and why, e.g.
`error: TREADLE_PARTITIONS='four': Input should be a valid integer, unable to parse string as an integer`.

Which values change between one machine and a cluster is in [operations.md](operations.md#embedded-or-cluster).

| variable | default | meaning |
|---|---|---|
"""


def _default(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{int(value)}`"
    if isinstance(value, tuple):
        return f"`{','.join(map(str, value))}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    if isinstance(value, Path):
        if value.is_relative_to(Path.cwd()):
            return f"`{value.relative_to(Path.cwd())}` in the current directory"
        return f"`{value}`"
    return f"`{value}`"


def _meaning(var: str, description: str | None) -> str:
    text = (description or "").removeprefix(f"{var}:").strip()
    return text.replace("|", "\\|")


def configuration_markdown() -> str:
    """docs/configuration.md: one row per setting (environment variable, default, description), in field order."""
    rows = []
    for name, field in Settings.model_fields.items():
        var = env_var(name)
        default = field.default_factory() if field.default_factory is not None else field.default
        rows.append(f"| `{var}` | {_default(default)} | {_meaning(var, field.description)} |")
    rows.append(f"| `{native_codec.ENV}` | `1` | {native_codec.ENV_DOC} |")
    return _INTRO + "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(configuration_markdown(), end="")
