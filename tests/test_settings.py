"""Settings: every variable round-trips through the environment and is documented in the README."""

from __future__ import annotations

import re

from streams.settings import REPO_ROOT, Settings


def test_every_setting_round_trips_through_the_environment(tmp_path) -> None:
    settings = Settings(home=tmp_path, partitions=7, processors=("steps", "state"), sink="off", redis_url="redis://x")
    assert Settings.from_env(settings.to_env()) == settings


def test_every_environment_variable_is_in_the_readme() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    documented = set(re.findall(r"^\| `([A-Z_]+)` \|", readme, flags=re.MULTILINE))
    variables = {field.description.split(":", 1)[0] for field in Settings.model_fields.values()}
    assert variables - documented == set(), "add these to the README's configuration table"
    assert documented - variables == set(), "the README documents variables that no longer exist"
