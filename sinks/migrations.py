"""Numbered, reversible schema migrations for treadle's ClickHouse tables (chDB or a server).

Migrations live in sinks/migrations/ as NNNN_<name>.up.sql and NNNN_<name>.down.sql (Langfuse's layout);
`{database}` in them is replaced by the target database. Each applied or rolled-back version is recorded in
<database>.schema_migrations, so `apply_pending` is idempotent and `rollback` knows what to undo. Up scripts
are written to be re-runnable (IF NOT EXISTS, OR REPLACE), so a run interrupted half-way can simply run again.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from clickhouse_connect.driver.client import Client

from sinks.clickhouse import DEFAULT_DATABASE, ClickHouseStore, checked_identifier, ensure_database
from sinks.sql_lexer import split_statements

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.(up|down)\.sql$")
_PLACEHOLDER = "{database}"

_BOOKKEEPING = """
CREATE TABLE IF NOT EXISTS {database}.schema_migrations
(
    version UInt32 COMMENT 'Migration number (NNNN of NNNN_name.up.sql).',
    name String COMMENT 'Migration name.',
    checksum String COMMENT 'SHA-256 of the up script as applied.',
    applied UInt8 COMMENT '1: applied; 0: rolled back.',
    seq UInt64 COMMENT 'Order of bookkeeping records; the highest per version is the current state.',
    recorded_at DateTime64(6, 'UTC') DEFAULT now64(6) COMMENT 'When this record was written.'
)
ENGINE = ReplacingMergeTree(seq)
ORDER BY version
COMMENT 'Migration history written by sinks.migrations; read with FINAL.'
"""


class MigrationError(RuntimeError):
    """The migrations on disk and the ones recorded in the database disagree, or a script failed."""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    up_sql: str
    down_sql: str

    @property
    def label(self) -> str:
        return f"{self.version:04d}_{self.name}"

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.up_sql.encode()).hexdigest()

    def up_statements(self, database: str) -> list[str]:
        return split_statements(self.up_sql.replace(_PLACEHOLDER, database))

    def down_statements(self, database: str) -> list[str]:
        return split_statements(self.down_sql.replace(_PLACEHOLDER, database))


def load_migrations(directory: Path = MIGRATIONS_DIR) -> list[Migration]:
    """The migrations in `directory`, by version; each version needs exactly one up and one down script."""
    scripts: dict[int, dict[str, tuple[str, str]]] = {}
    for path in sorted(directory.glob("*.sql")):
        match = _FILE.match(path.name)
        if not match:
            raise MigrationError(f"{path.name}: migration files are named NNNN_name.up.sql / NNNN_name.down.sql")
        version, name, direction = int(match.group(1)), match.group(2), match.group(3)
        if direction in scripts.setdefault(version, {}):
            raise MigrationError(f"{path.name}: two {direction} scripts for version {version:04d}")
        scripts[version][direction] = (name, path.read_text())
    migrations = []
    for version, pair in sorted(scripts.items()):
        if set(pair) != {"up", "down"}:
            missing = ({"up", "down"} - set(pair)).pop()
            raise MigrationError(f"migration {version:04d} has no {missing} script")
        (up_name, up_sql), (down_name, down_sql) = pair["up"], pair["down"]
        if up_name != down_name:
            raise MigrationError(f"migration {version:04d}: up is named {up_name!r} but down {down_name!r}")
        migrations.append(Migration(version, up_name, up_sql, down_sql))
    return migrations


def applied_checksums(client: Client, database: str = DEFAULT_DATABASE) -> dict[int, str]:
    """{version: checksum} of the migrations currently applied in `database` (empty when none)."""
    _prepare(client, database)
    result = client.query(
        f"SELECT version, checksum FROM {database}.schema_migrations FINAL WHERE applied = 1 ORDER BY version"
    )
    return {int(version): checksum for version, checksum in result.result_rows}


def pending(
    client: Client, database: str = DEFAULT_DATABASE, migrations: list[Migration] | None = None
) -> list[Migration]:
    """Migrations not yet applied, in order."""
    migrations = load_migrations() if migrations is None else migrations
    applied = _verified_applied(client, database, migrations)
    return [m for m in migrations if m.version not in applied]


def apply_pending(
    client: Client,
    database: str = DEFAULT_DATABASE,
    migrations: list[Migration] | None = None,
    target: int | None = None,
) -> list[int]:
    """Apply the migrations not yet applied (up to `target` when given), in order; returns their versions."""
    migrations = load_migrations() if migrations is None else migrations
    done = []
    for migration in pending(client, database, migrations):
        if target is not None and migration.version > target:
            break
        _run_script(client, migration, migration.up_statements(database), "up")
        _record(client, database, migration, applied=True)
        done.append(migration.version)
    return done


def apply_migrations(store: ClickHouseStore) -> list[int]:
    """Bring the store's database up to date (on the store's thread); the sink calls this when it starts."""
    return store.call_sync(lambda client: apply_pending(client, store.database))


def rollback(
    client: Client, to_version: int, database: str = DEFAULT_DATABASE, migrations: list[Migration] | None = None
) -> list[int]:
    """Run the down scripts of applied migrations above `to_version`, newest first; returns their versions."""
    migrations = load_migrations() if migrations is None else migrations
    by_version = {m.version: m for m in migrations}
    applied = _verified_applied(client, database, migrations)
    undone = []
    for version in sorted((v for v in applied if v > to_version), reverse=True):
        migration = by_version[version]
        _run_script(client, migration, migration.down_statements(database), "down")
        _record(client, database, migration, applied=False)
        undone.append(version)
    return undone


def _prepare(client: Client, database: str) -> None:
    checked_identifier(database)
    ensure_database(client, database)
    client.command(_BOOKKEEPING.replace(_PLACEHOLDER, database))


def _verified_applied(client: Client, database: str, migrations: list[Migration]) -> dict[int, str]:
    applied = applied_checksums(client, database)
    known = {m.version: m for m in migrations}
    for version, checksum in applied.items():
        migration = known.get(version)
        if migration is None:
            raise MigrationError(
                f"{database} has migration {version:04d} applied, which this code does not know: "
                "is this an older treadle than the one that migrated the database?"
            )
        if migration.checksum != checksum:
            raise MigrationError(
                f"migration {migration.label} changed after it was applied to {database}; add a new migration "
                "instead of editing an applied one (or roll it back with the old code first)"
            )
    return applied


def _run_script(client: Client, migration: Migration, statements: list[str], direction: str) -> None:
    for number, statement in enumerate(statements, start=1):
        try:
            client.command(statement)
        except Exception as exc:
            reason = " ".join(str(exc).split())
            raise MigrationError(
                f"{migration.label}.{direction}.sql statement {number} of {len(statements)} failed: {reason}"
            ) from exc


def _record(client: Client, database: str, migration: Migration, *, applied: bool) -> None:
    last = client.query(f"SELECT max(seq) FROM {database}.schema_migrations").result_rows[0][0]
    client.insert(
        "schema_migrations",
        [[migration.version, migration.name, migration.checksum, int(applied), int(last or 0) + 1]],
        column_names=["version", "name", "checksum", "applied", "seq"],
        database=database,
    )
