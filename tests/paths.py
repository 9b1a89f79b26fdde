"""Where the checkout is: tests read its files (compose.yaml, docs) and share its Kafka jar cache."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
KAFKA_CACHE = REPO_ROOT / ".treadle" / "cache"  # Kafka's jars, downloaded once (ignored by git)
