"""The generated part of the wire-format page (docs/wire-format.md): every shipped schema's fingerprint and form.

For producers in other languages the fingerprint is the one fact they must get byte for byte, so the page's table
and Parsing Canonical Forms are rendered from `SchemaSet` and a test compares them with the page. Regenerate with
`python -m topics.wire_format_doc docs/wire-format.md` (rewrites the part between the markers).
"""

from __future__ import annotations

import sys
from pathlib import Path

from fastavro import parse_schema
from fastavro.schema import to_parsing_canonical_form

from topics.catalog import TopicCatalog
from topics.codec import MAGIC
from topics.schemas import AvroSchema, SchemaSet
from topics.settings import Settings

BEGIN = "<!-- BEGIN GENERATED: fingerprints (python -m topics.wire_format_doc docs/wire-format.md) -->"
END = "<!-- END GENERATED: fingerprints -->"
REGENERATE = "python -m topics.wire_format_doc docs/wire-format.md"


def header_bytes(schema: AvroSchema) -> bytes:
    """The 10 bytes before every record written with `schema`: marker, then the fingerprint little-endian."""
    return MAGIC + schema.fingerprint.to_bytes(8, "little")


def canonical_form(schema: AvroSchema) -> str:
    return to_parsing_canonical_form(parse_schema(schema.json, _write_hint=False))


def _topic(catalog: TopicCatalog, name: str) -> str:
    try:
        return f"`{catalog.for_schema(name).name}`"
    except KeyError:
        return "none: nested in other records"


def fingerprint_markdown(schemas: SchemaSet | None = None) -> str:
    """The generated block, markers included: a table of header bytes and printed fingerprints, then each form."""
    schemas = schemas if schemas is not None else SchemaSet.load()
    catalog = TopicCatalog(Settings())
    ordered = sorted(schemas, key=lambda s: (not s.name.startswith("treadle.events."), s.name))
    lines = [
        BEGIN,
        "",
        "| schema | topic (default prefix) | header bytes on the wire (C3 01 + fingerprint little-endian) "
        "| as printed (big-endian hex) |",
        "|---|---|---|---|",
    ]
    for schema in ordered:
        wire = header_bytes(schema).hex(" ").upper()
        lines.append(f"| `{schema.name}` | {_topic(catalog, schema.name)} | `{wire}` | `{schema.fingerprint:016x}` |")
    lines += ["", "Parsing Canonical Forms (what the fingerprint is computed over, logical types dropped):", ""]
    for schema in ordered:
        lines += [f"<details><summary><code>{schema.name}</code></summary>", "", "```json", canonical_form(schema)]
        lines += ["```", "", "</details>", ""]
    lines.append(END)
    return "\n".join(lines) + "\n"


def generated_part(page: str) -> str:
    """The block between the markers (markers included) of a page, or '' when it has none."""
    if BEGIN not in page or END not in page:
        return ""
    start = page.index(BEGIN)
    return page[start : page.index(END, start) + len(END)] + "\n"


def rewrite(path: Path) -> None:
    """Replace the generated block of the page at `path` with a freshly generated one."""
    page = path.read_text()
    old = generated_part(page)
    if not old:
        raise SystemExit(f"{path}: no generated block ({BEGIN} ... {END})")
    path.write_text(page.replace(old, fingerprint_markdown(), 1))


if __name__ == "__main__":
    if len(sys.argv) == 2:
        rewrite(Path(sys.argv[1]))
    else:
        print(fingerprint_markdown(), end="")
