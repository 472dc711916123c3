"""Lower layers never import higher ones (docs/DESIGN.md section 8, "Map of the code", lists the
same layers and why each unit sits where it does).

Every import in the package counts, the ones inside functions too (they are real dependencies,
only deferred), and so does `import blockspec` (the package facade, the top layer).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "blockspec"

# Low -> high. A module may import its own unit and the layers below its own; units that share
# a layer do not import each other.
LAYERS: list[set[str]] = [
    {"errors"},
    {"config", "text", "cache_dir"},
    {"cpu"},
    {"targets"},
    {"dflash"},
    {"engine", "zoo"},
    {"api", "export"},
    {"__init__"},
    {"server", "bench"},
    {"train"},
    {"commands"},
    {"cli"},
    {"__main__"},
]
RANK = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    """blockspec.dflash.batch -> dflash; blockspec.api -> api; blockspec -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str, name: str, is_package: bool) -> set[str]:
    """The blockspec modules that the source of module `name` imports, absolute."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.add(module)
            if module == "blockspec":  # `from blockspec import api` imports blockspec.api
                found |= {f"blockspec.{a.name}" for a in node.names if (PACKAGE / a.name).exists()
                          or (PACKAGE / f"{a.name}.py").exists()}
    return {m for m in found if m == "blockspec" or m.startswith("blockspec.")}


def upward_imports(modules: list[tuple[str, str, bool]]) -> list[str]:
    """(name, source, is_package) of each module -> one line per import of a layer not below."""
    bad = []
    for name, source, is_package in modules:
        mine = unit_of(name)
        for target in sorted(imported(source, name, is_package)):
            theirs = unit_of(target)
            if theirs != mine and RANK[theirs] >= RANK[mine]:
                bad.append(f"{name} ({mine}) imports {target} ({theirs})")
    return bad


def package_modules() -> list[tuple[str, str, bool]]:
    return [(module_name(p), p.read_text(), p.name == "__init__.py") for p in sorted(PACKAGE.rglob("*.py"))]


def test_every_unit_has_a_layer() -> None:
    units = {unit_of(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert units <= set(RANK), f"place {sorted(units - set(RANK))} in LAYERS"
    assert not set(RANK) - units, f"LAYERS names units that do not exist: {sorted(set(RANK) - units)}"


def test_lower_layers_never_import_higher_ones() -> None:
    assert upward_imports(package_modules()) == []


def test_the_check_sees_upward_and_lazy_imports() -> None:
    probe = ("def f():\n    from blockspec.dflash.batch import DecodeBatch\n    import blockspec\n"
             "from ..targets import base\nfrom . import kernels\nfrom blockspec import api\n")
    assert upward_imports([("blockspec.cpu.probe", probe, False)]) == [
        "blockspec.cpu.probe (cpu) imports blockspec (__init__)",
        "blockspec.cpu.probe (cpu) imports blockspec.api (api)",
        "blockspec.cpu.probe (cpu) imports blockspec.dflash.batch (dflash)",
        "blockspec.cpu.probe (cpu) imports blockspec.targets (targets)",
    ]
