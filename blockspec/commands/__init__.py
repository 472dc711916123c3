"""The `blockspec` CLI verbs, one module each; the runtime flags of the verbs that
load a model to decode are declared once, in `model_args`.

One story for the defaults: every verb that decodes (generate, serve, bench, demo) takes the demo
model, DEFAULT_TARGET, with the drafter shipped for it, the adaptive block policy (each step picks
its block size, up to the drafter's) and n-gram lookup proposals. `bench --block-sizes` adds
runs at fixed block sizes, as the published DFlash decodes.
"""

from __future__ import annotations

from blockspec.zoo.registry import DEFAULT_TARGET  # noqa: F401  (the verbs' default --target)

