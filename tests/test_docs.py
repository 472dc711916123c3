"""The docs follow the tree: docs/DESIGN.md's map of the code (section 8) names every module of
the package and every C source, and names none that is gone."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "blockspec"
DESIGN = ROOT / "docs" / "DESIGN.md"
# A unit's heading line in the map: "`dflash/`: the algorithm", "`blockspec/` (top level)".
UNIT = re.compile(r"^`([\w/]+)/`")
# A file the map names, relative to its unit's folder or to the package: `conv.py`, `csrc/rows.c`.
MENTION = re.compile(r"`([\w/]+\.(?:py|c|h))`")


def package_modules() -> list[str]:
    """Every module and C source of the package, relative to blockspec/. A package's
    `__init__.py` counts once it holds more than its docstring (re-exports, code)."""
    found = []
    for path in sorted(PACKAGE.rglob("*")):
        if "__pycache__" in path.parts or not path.is_file():
            continue
        rel = path.relative_to(PACKAGE).as_posix()
        if path.suffix in (".c", ".h") or path.suffix == ".py" and not _docstring_only(path):
            found.append(rel)
    return found


def _docstring_only(path: Path) -> bool:
    if path.name != "__init__.py":
        return False
    body = ast.parse(path.read_text()).body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def map_section(text: str) -> str:
    start = text.index("## 8. Map of the code")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def mapped_paths(section: str) -> tuple[set[str], list[str]]:
    """(the package files the map names, relative to blockspec/; the names that match no file
    of the package or the repository)."""
    unit = ""
    named: set[str] = set()
    stale: list[str] = []
    for line in section.splitlines():
        heading = UNIT.match(line)
        if heading:
            unit = "" if heading.group(1) == "blockspec" else heading.group(1)
        for name in MENTION.findall(line):
            # relative to the unit's folder first ("`native/llama.py`" under `targets/`), else to the package
            for rel in (f"{unit}/{name}" if unit else name, name):
                if (PACKAGE / rel).is_file():
                    named.add(rel)
                    break
            else:
                if not (ROOT / name).is_file():  # a file outside the package (`tests/...`) may be named too
                    stale.append(f"{name} (under `{unit or 'blockspec'}/`)")
    return named, stale


def test_the_map_of_the_code_names_every_module() -> None:
    named, _ = mapped_paths(map_section(DESIGN.read_text()))
    modules = package_modules()
    assert "dflash/batch.py" in modules and "cpu/csrc/rows.c" in modules  # the walk sees the tree
    missing = [m for m in modules if m not in named]
    assert not missing, ("docs/DESIGN.md section 8 (Map of the code) does not name these modules; add a "
                         "line for each under its unit:\n" + "\n".join(missing))


def test_the_map_of_the_code_names_no_missing_file() -> None:
    _, stale = mapped_paths(map_section(DESIGN.read_text()))
    assert not stale, "docs/DESIGN.md section 8 names files the package does not have:\n" + "\n".join(stale)


def test_the_map_check_catches_an_unnamed_module_and_a_stale_name() -> None:
    """The two checks above can fail: a map without one unit's module, and a name of no file."""
    section = map_section(DESIGN.read_text())
    without = section.replace("`conv.py`", "`gone.py`").replace("`dflash/conv.py`", "`dflash/gone.py`")
    named, stale = mapped_paths(without)
    assert "dflash/conv.py" not in named
    assert any(s.startswith("gone.py") or s.startswith("dflash/gone.py") for s in stale)
    # a name resolves within its own unit only: `conv.py` under `targets/` is no module there
    named, stale = mapped_paths("`targets/`: target models\n- `conv.py`: no such file here\n")
    assert named == set() and stale == ["conv.py (under `targets/`)"]
