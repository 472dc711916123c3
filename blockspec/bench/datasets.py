"""Moved to `blockspec.datasets` (training shares the prompt sets, so they live below bench and
train): the old names work, with a DeprecationWarning, until the next release."""

from __future__ import annotations

import blockspec.datasets as datasets
from blockspec.deprecation import no_attribute, warn_moved


def __getattr__(name: str) -> object:
    if name not in datasets.__all__:
        raise no_attribute(__name__, name)
    warn_moved(__name__, name, "blockspec.datasets")
    return getattr(datasets, name)
