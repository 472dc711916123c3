"""Moved public names keep working for one release from their old module, with a
DeprecationWarning that names the new place and points at the caller's line."""

from __future__ import annotations

import importlib

import pytest

# (old module, name, new module): every name README's "Moved names" lists.
MOVED = [
    ("blockspec.engine", "AdaptiveBlock", "blockspec.dflash.policy"),
    ("blockspec.engine", "CostModel", "blockspec.dflash.policy"),
    *[("blockspec.zoo.export", name, "blockspec.export")
      for name in ("DTYPES", "FORMATS", "TOKENIZER_FILES", "DrafterCheckpoint", "ExportResult", "engine_config",
                   "export_drafter", "export_hf_dir", "read_checkpoint", "serve_command")],
    *[("blockspec.zoo.export_gguf", name, "blockspec.export.gguf")
      for name in ("ARCH", "GLOBAL_TENSORS", "LAYER_TENSORS", "gguf_name", "resolve_target_gguf",
                   "write_dflash_gguf")],
    *[("blockspec.bench.datasets", name, "blockspec.datasets")
      for name in ("BUNDLED_DIR", "CONTEXT_INTRO", "CONTEXT_OUTRO", "DATASETS", "ENV_VAR", "HUMANEVAL_TEMPLATE",
                   "MATH_TEMPLATE", "DatasetSpec", "HubSource", "Row", "Sample", "SplitSpec", "bundled_path",
                   "data_dir", "find_file", "is_held_out", "load_dataset", "search_dirs", "sharegpt_messages",
                   "split_rows", "token_counter", "training_prompts", "where_to_put", "with_context")],
]


@pytest.mark.parametrize(("old", "name", "new"), MOVED, ids=[f"{o}.{n}" for o, n, _ in MOVED])
def test_a_moved_name_works_from_its_old_module_and_says_where_it_lives(old: str, name: str, new: str) -> None:
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} moved to {new}\.{name}") as caught:
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new), name)
    assert caught[0].filename == __file__  # pointed at the line that used the old name


def test_from_import_of_a_moved_name_warns_at_the_importing_line() -> None:
    with pytest.warns(DeprecationWarning, match="blockspec.export") as caught:
        from blockspec.zoo.export import export_drafter
    from blockspec.export import export_drafter as new

    assert export_drafter is new and caught[0].filename == __file__


def test_new_places_import_without_a_warning(recwarn: pytest.WarningsRecorder) -> None:
    for _, name, new in MOVED:
        getattr(importlib.import_module(new), name)
    from blockspec.engine import Engine  # the engine's own names do not warn

    assert Engine and not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize(("old", "other"), [("blockspec.engine", "calibrate"), ("blockspec.zoo.export", "check_dtype"),
                                            ("blockspec.zoo.export_gguf", "ConfigError"),
                                            ("blockspec.bench.datasets", "prompt_sets")])
def test_an_old_module_lends_only_the_names_that_moved(old: str, other: str) -> None:
    """`other` is in the new module but never was in the old one: it stays missing there."""
    module = importlib.import_module(old)
    for name in (other, "__path__" if old.startswith("blockspec.zoo") else "not_a_name"):
        with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
            getattr(module, name)
