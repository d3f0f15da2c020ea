"""docs/ARCHITECTURE.md's package map against the tree: every module of swarm/ and peers/ has its line, and no line
names a module that is gone, so the map a new maintainer reads first cannot go stale."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def mapped_modules(text: str) -> list[str]:
    """The modules the map's rows name: the first cell of a table row, a path to a .py file."""
    section = text.split("\n## Packages\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `((?:swarm|peers)/[\w/]+\.py)` \|", section, flags=re.MULTILINE)


def modules_in_the_tree() -> set[str]:
    files = [*(ROOT / "swarm").rglob("*.py"), *(ROOT / "peers").rglob("*.py")]
    return {path.relative_to(ROOT).as_posix() for path in files}


def test_the_package_map_lists_every_module_once_and_nothing_else():
    mapped = mapped_modules((ROOT / "docs" / "ARCHITECTURE.md").read_text())
    twice = sorted({module for module in mapped if mapped.count(module) > 1})
    assert twice == [], f"listed more than once: {twice}"
    tree = modules_in_the_tree()
    assert sorted(tree - set(mapped)) == [], "modules the map lacks (one line each on its job)"
    assert sorted(set(mapped) - tree) == [], "the map lists modules that do not exist"


def test_the_map_reader_sees_rows_only():
    """The reader takes a row's module, not a package's row, a header or a path in the prose."""
    text = "\n## Packages\n\n| `swarm/net/` | x |\n| `swarm/*.py` | x |\n| `peers/a.py` | job, not `peers/b.py` |\n"
    text += "see `swarm/c.py`\n| `swarm/net/d.py` | x |\n\n## Next\n\n| `swarm/e.py` | x |\n"
    assert mapped_modules(text) == ["peers/a.py", "swarm/net/d.py"]
