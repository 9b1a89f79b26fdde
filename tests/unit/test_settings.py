"""Settings: every variable round-trips through the environment and is documented in docs/configuration.md."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT
from topics import native_codec
from topics.settings import InvalidSettingError, Settings


def test_every_setting_round_trips_through_the_environment(tmp_path) -> None:
    settings = Settings(
        home=tmp_path, partitions=7, processors=("steps", "state"), sink="off", redis_url="redis://x",
        gc_thresholds=(1000, 20, 50),
    )  # fmt: skip
    assert Settings.from_env(settings.to_env()) == settings


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"TREADLE_PARTITIONS": "x"}, "TREADLE_PARTITIONS='x': Input should be a valid integer"),
        ({"TREADLE_GC_THRESHOLDS": "700,10"}, "TREADLE_GC_THRESHOLDS='700,10' (item 3): Field required"),
        ({"TREADLE_GC_THRESHOLDS": "700,-1,10"}, "TREADLE_GC_THRESHOLDS='700,-1,10' (item 2): Input should be greater"),
        ({"TREADLE_SINK": "maybe", "TREADLE_CREDIT_GAMMA": "2"}, "TREADLE_SINK='maybe': Input should be 'child' or"),
    ],
)
def test_an_unusable_variable_is_named_with_its_value_and_why(env: dict[str, str], says: str) -> None:
    with pytest.raises(InvalidSettingError) as raised:
        Settings.from_env(env)
    assert str(raised.value).startswith(says)
    assert ("(and 1 more)" in str(raised.value)) == (len(env) > 1)


def test_the_cli_prints_one_line_for_an_unusable_variable() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "processors"],
        cwd=REPO_ROOT, env={"PATH": "/usr/bin:/bin", "TREADLE_PARTITIONS": "four"}, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: TREADLE_PARTITIONS='four': Input should be a valid integer, unable to parse string as an integer"
    ]


def test_every_environment_variable_is_on_the_configuration_page() -> None:
    page = (REPO_ROOT / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `([A-Z_]+)` \|", page, flags=re.MULTILINE))
    variables = {field.description.split(":", 1)[0] for field in Settings.model_fields.values()}
    variables.add(native_codec.ENV)  # read by the codec itself, which the SDK uses without settings
    assert variables - documented == set(), "regenerate docs/configuration.md (python -m topics.settings_doc)"
    assert documented - variables == set(), "docs/configuration.md documents variables that no longer exist"


def test_a_local_three_broker_cluster_lists_every_node_and_replicates_three_times() -> None:
    from topics.settings import min_insync_replicas

    cluster = Settings.from_env({"TREADLE_KAFKA_BROKERS": "3", "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:18112"})
    assert cluster.kafka_bootstrap_servers == "127.0.0.1:18112,127.0.0.1:18114,127.0.0.1:18116"
    assert cluster.replication_factor == 3 and min_insync_replicas(cluster.replication_factor) == 2
    assert Settings.from_env(cluster.to_env()) == cluster  # a worker's environment reproduces it
    chosen = Settings.from_env({"TREADLE_KAFKA_BROKERS": "3", "TREADLE_REPLICATION_FACTOR": "2"})
    assert chosen.replication_factor == 2 and min_insync_replicas(2) == 1
    external = Settings.from_env({"TREADLE_KAFKA_BROKERS": "3", "TREADLE_LOCAL_KAFKA": "0"})
    assert external.replication_factor == 1 and "," not in external.kafka_bootstrap_servers
    with pytest.raises(InvalidSettingError, match="TREADLE_KAFKA_BROKERS='2'"):
        Settings.from_env({"TREADLE_KAFKA_BROKERS": "2"})
