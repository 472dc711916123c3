"""Public names that moved keep working for one release: their old module re-exports them and
warns, naming where they live now (README, "Moved names")."""

from __future__ import annotations

import warnings


def warn_moved(old_module: str, name: str, new_module: str) -> None:
    """A DeprecationWarning, pointed at the code that used the old name, that `old_module.name`
    is `new_module.name` now."""
    # stacklevel 3: past this function and the old module's __getattr__, to the caller's import
    warnings.warn(f"{old_module}.{name} moved to {new_module}.{name}; import it from {new_module} "
                  "(the old name goes away in the next release)", DeprecationWarning, stacklevel=3)


def no_attribute(module: str, name: str) -> AttributeError:
    """What a module's __getattr__ raises for a name it does not have."""
    return AttributeError(f"module {module!r} has no attribute {name!r}")
