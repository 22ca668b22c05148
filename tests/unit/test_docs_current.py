"""The newcomer's pages stay true to the build: every command and alias is listed in the
quick start, its version example is this schema's, and the docs index reaches every page."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from pepsi.commands import COMMANDS
from pepsi.db.schema import build_version

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
QUICKSTART = (DOCS / "quickstart.md").read_text()


def test_the_quick_start_lists_every_command() -> None:
    table = [line for line in QUICKSTART.splitlines() if line.startswith("| `pepsi ")]
    listed = {
        m.group(1) for line in table if (m := re.search(r"pepsi (?:-c FILE )?([a-z-]+)", line))
    }
    missing = {c.name for c in COMMANDS if listed.isdisjoint({c.name, *c.aliases})}
    assert not missing, f"docs/quickstart.md's command table lacks {sorted(missing)}"


def test_the_quick_start_names_every_alias_and_the_schema_version() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    aliases = sorted(name for name in scripts if name.startswith("pepsi-"))
    section = QUICKSTART[QUICKSTART.index("### Aliases") :]
    section = section[: section.index("\n### ", 1)]
    assert [a for a in aliases if f"`{a}`" not in section] == []
    assert f"(schema version {build_version()})" in QUICKSTART


def test_the_docs_index_links_every_page() -> None:
    index = (DOCS / "README.md").read_text()
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "README.md")
    assert [p for p in pages if f"]({p})" not in index] == []
