"""Lower layers never import higher ones, and a unit imports only the units ALLOWED lists for it
(docs/DESIGN.md section 8, "Map of the code", lists the same layers and why each unit sits where
it does).

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
    {"errors", "deprecation"},
    {"config", "text", "cache_dir", "datasets"},
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

# The units each unit imports, besides itself: every one of these edges goes down LAYERS, and an
# import along an edge not listed fails even where the layers would allow it. A new dependency
# between units is a design decision: make it here, where review sees it. An edge no import uses
# any more fails too, so the table stays the map of what is.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "deprecation": set(),
    "config": {"errors"},
    "text": {"errors"},
    "cache_dir": set(),
    "datasets": {"errors"},
    "cpu": {"errors", "cache_dir"},
    "targets": {"errors", "cache_dir", "cpu"},
    "dflash": {"errors", "config", "cpu", "targets"},
    "engine": {"errors", "deprecation", "config", "text", "cpu", "targets", "dflash"},
    "zoo": {"errors", "deprecation", "cache_dir"},
    "api": {"errors", "config", "text", "cpu", "targets", "dflash", "engine", "zoo"},
    "export": {"errors", "dflash", "zoo"},
    "__init__": {"config", "api"},
    "server": {"errors", "config", "text", "dflash", "engine", "api", "__init__"},
    "bench": {"errors", "deprecation", "config", "text", "datasets", "cpu", "targets", "dflash", "engine", "zoo",
              "api"},
    "train": {"errors", "config", "text", "datasets", "targets", "dflash", "engine"},
    "commands": {"errors", "config", "text", "cache_dir", "datasets", "cpu", "targets", "dflash", "engine", "zoo",
                 "api", "export", "server", "bench", "train"},
    "cli": {"errors", "__init__", "commands"},
    "__main__": {"cli"},
}

# Edges that must never be added to ALLOWED, whatever the layers would let through, and why.
NEVER: dict[tuple[str, str], str] = {
    ("train", "server"): "training runs offline: it needs no HTTP stack",
    ("train", "bench"): "the prompt sets both use live below both (datasets/)",
    ("bench", "train"): "measuring a drafter never needs the training stack",
    ("server", "train"): "the server ships without the training stack",
    ("server", "bench"): "the server ships without the measurement tools",
    ("export", "api"): "export reads checkpoint files, never a loaded pipeline",
}

# Old modules that re-export moved names for one release (blockspec/deprecation.py): each may
# import its new home, upward if it must. Delete the shim and its line here together.
SHIMS: dict[str, str] = {
    "blockspec.zoo.export": "blockspec.export",
    "blockspec.zoo.export_gguf": "blockspec.export",
}


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


def cross_unit_imports(modules: list[tuple[str, str, bool]]) -> list[tuple[str, str, str, str]]:
    """(name, source, is_package) of each module -> (module, its unit, imported module, its unit)
    for each import of another unit, less a shim's import of its new home."""
    found = []
    for name, source, is_package in modules:
        mine = unit_of(name)
        for target in sorted(imported(source, name, is_package)):
            theirs = unit_of(target)
            if theirs != mine and SHIMS.get(name) != target:
                found.append((name, mine, target, theirs))
    return found


def upward_imports(modules: list[tuple[str, str, bool]]) -> list[str]:
    """One line per import of a layer not below the importer's."""
    return [f"{name} ({mine}) imports {target} ({theirs})"
            for name, mine, target, theirs in cross_unit_imports(modules) if RANK[theirs] >= RANK[mine]]


def unlisted_imports(modules: list[tuple[str, str, bool]]) -> list[str]:
    """One line per import along an edge ALLOWED does not list."""
    return [f"{name} ({mine}) imports {target} ({theirs}): {mine} -> {theirs} is not in ALLOWED"
            for name, mine, target, theirs in cross_unit_imports(modules) if theirs not in ALLOWED.get(mine, ())]


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


def test_every_import_between_units_is_an_allowed_edge() -> None:
    assert unlisted_imports(package_modules()) == []


def test_the_allowed_edges_go_down_the_layers_and_each_is_used() -> None:
    assert set(ALLOWED) == set(RANK), "ALLOWED needs one entry per unit of LAYERS"
    upward = [(a, b) for a, targets in ALLOWED.items() for b in targets if RANK[b] >= RANK[a]]
    assert upward == [], "ALLOWED may only list edges down LAYERS"
    used = {(mine, theirs) for _, mine, _, theirs in cross_unit_imports(package_modules())}
    unused = sorted((a, b) for a, targets in ALLOWED.items() for b in targets if (a, b) not in used)
    assert unused == [], f"no module imports along these edges any more: remove them from ALLOWED: {unused}"


def test_edges_that_must_never_exist_are_not_allowed() -> None:
    assert [edge for edge in NEVER if edge[1] in ALLOWED[edge[0]]] == []


def test_each_shim_is_a_module_that_imports_its_new_home() -> None:
    modules = {name: (source, is_package) for name, source, is_package in package_modules()}
    for shim, home in SHIMS.items():
        assert shim in modules, f"{shim} is gone: remove it from SHIMS"
        assert home in imported(modules[shim][0], shim, modules[shim][1]), f"{shim} no longer imports {home}"


def test_the_check_refuses_a_downward_edge_not_in_the_table() -> None:
    probe = "from blockspec.config import SpecConfig\nfrom blockspec.errors import ConfigError\n"
    assert unlisted_imports([("blockspec.cpu.probe", probe, False)]) == [
        "blockspec.cpu.probe (cpu) imports blockspec.config (config): cpu -> config is not in ALLOWED",
    ]
    assert upward_imports([("blockspec.cpu.probe", probe, False)]) == []  # the layers alone would let it pass
    shim = "import blockspec.export as export\n"
    assert upward_imports([("blockspec.zoo.export", shim, False)]) == []
    assert upward_imports([("blockspec.zoo.registry", shim, False)]) == [
        "blockspec.zoo.registry (zoo) imports blockspec.export (export)"]  # only the shim may
