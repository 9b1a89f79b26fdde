"""docs/configuration.md is generated from the Settings field descriptions; it must match them."""

from __future__ import annotations

from tests.paths import REPO_ROOT
from topics import native_codec
from topics.settings import Settings, env_var
from topics.settings_doc import REGENERATE, configuration_markdown

PAGE = REPO_ROOT / "docs" / "configuration.md"


def test_the_configuration_page_matches_the_settings() -> None:
    assert PAGE.read_text() == configuration_markdown(), f"docs/configuration.md is stale: run `{REGENERATE}`"


def test_every_variable_has_a_row_with_a_description() -> None:
    page = configuration_markdown()
    for name, field in Settings.model_fields.items():
        var = env_var(name)
        assert (field.description or "").startswith(f"{var}: "), f"Settings.{name}: start its description '{var}: '"
        assert f"| `{var}` |" in page
    assert f"| `{native_codec.ENV}` |" in page
