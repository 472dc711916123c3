"""The runtime flags of the verbs that load a model to decode (generate, demo, serve, bench), declared once.

Each flag is one `RuntimeFlag` row: its name, the `blockspec.load` keyword it feeds and its
argparse options, with the choices validated by argparse (a bad value exits with status 2 and
the usage line, before anything loads). A new runtime option is one row here, e.g.

    RuntimeFlag("--compile", "compile", "decoding", dict(action="store_true", help=...)),

`add_runtime_arguments` declares the rows a verb takes; `load_kwargs` turns the parsed flags
into `blockspec.load(**kwargs)`, `command_args` back into a command line. Flags that differ on purpose keep their own declaration in
their verb: bench's sweeps (`--block-sizes`, `--adaptive`, `--lookup on|off|both`), export's
output dtype, evaluate's repeatable --drafter, train's device.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from blockspec.zoo.registry import DEFAULT_TARGET

# The target's dtypes: `targets.base.DTYPES` (which imports torch; a test holds the two equal).
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")
DRAFTER_DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
# The compute modes: `targets.native.load.COMPUTES` (which imports torch; a test holds the two equal).
COMPUTE_NAMES = ("exact", "int8", "auto")
_DEVICE = re.compile(r"cpu|mps|cuda(:\d+)?")


def device_name(text: str) -> str:
    """argparse type of --device: cpu, cuda, cuda:N or mps."""
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N or mps, got {text!r}")
    return text


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type of a count >= 0."""
    return _int_at_least(text, 0)


def positive_int(text: str) -> int:
    """argparse type of a count >= 1."""
    return _int_at_least(text, 1)


@dataclass(frozen=True)
class RuntimeFlag:
    """One command-line flag that feeds one `blockspec.load` keyword."""

    flag: str  # "--drafter-dtype"
    kwarg: str  # its load() keyword, and the argparse dest
    group: str  # "model" (what loads) or "decoding" (how it decodes)
    options: dict = field(default_factory=dict)  # add_argument keywords

    def __post_init__(self) -> None:
        if self.group not in ("model", "decoding"):
            raise ValueError(f"group must be 'model' or 'decoding', got {self.group!r}")


FLAGS: tuple[RuntimeFlag, ...] = (
    RuntimeFlag("--target", "target", "model", dict(
        default=DEFAULT_TARGET,
        help=f"target model: zoo name (see `blockspec pull --list`), local HF directory or Hub id "
             f"(default {DEFAULT_TARGET})")),
    RuntimeFlag("--drafter", "drafter", "model", dict(
        default=None,
        help="DFlash drafter directory; default: the drafter shipped for a zoo target; 'fresh' = untrained "
             "(lossless, no speedup); 'none' = plain decoding")),
    RuntimeFlag("--dtype", "dtype", "model", dict(
        default="float32", choices=DTYPE_NAMES, help="the target's dtype (default float32)")),
    RuntimeFlag("--drafter-dtype", "drafter_dtype", "model", dict(
        default="auto", choices=DRAFTER_DTYPE_NAMES,
        help="the drafter's dtype; auto (default): float32 beside a target computing in int8 (the "
             "drafter then drafts in int8 too), bfloat16 beside a float32 target on a CPU with bf16 "
             "products, else the target's (the output is the same either way)")),
    RuntimeFlag("--device", "device", "model", dict(
        default="cpu", type=device_name, metavar="{cpu,cuda[:N],mps}", help="where the models run (default cpu)")),
    RuntimeFlag("--compute", "compute", "model", dict(
        default="auto", choices=COMPUTE_NAMES,
        help="the target's arithmetic on a CPU: exact (fp32 as transformers computes it), int8 (8-bit "
             "activations against the 4- / 8-bit weights, integer dot products; DFlash equals int8's own plain "
             "decoding), auto (default: int8 for the zoo's GGUF conversions on a CPU with AVX-512 VNNI, where "
             "its quality is shown to hold; exact everywhere else)")),
    RuntimeFlag("--block-size", "block_size", "decoding", dict(
        default=None, type=positive_int,
        help="the largest block a step verifies (default: the drafter's); with --no-adaptive-block, every "
             "step's block")),
    RuntimeFlag("--adaptive-block", "adaptive_block", "decoding", dict(
        default=True, action=argparse.BooleanOptionalAction,
        help="choose each step's block size (up to --block-size) from step costs measured on this machine and "
             "the acceptance so far, down to plain decoding where drafting does not pay; same output (default: "
             "on; --no-adaptive-block verifies the whole block every step, as the published DFlash does)")),
    RuntimeFlag("--lookup", "lookup", "decoding", dict(
        default=True, action=argparse.BooleanOptionalAction,
        help="where a sequence's last tokens occurred before, propose what followed them (n-gram lookup; "
             "same output; default: on; --no-lookup drafts every proposal with the drafter: pure DFlash)")),
    RuntimeFlag("--tree-nodes", "tree_nodes", "decoding", dict(
        default=None, type=non_negative_int, metavar="N",
        help="verify a token tree of up to N proposed tokens per step instead of one chain: each step spends "
             "its verify width best-first over the drafter's top choices at every depth, where the adaptive "
             "policy expects it to pay (same output; default: 15; 0: chains only; targets with recurrent "
             "layers keep chains)")),
)

BY_NAME = {f.kwarg: f for f in FLAGS}
MODEL = tuple(f.kwarg for f in FLAGS if f.group == "model")
DECODING = tuple(f.kwarg for f in FLAGS if f.group == "decoding")
_DECLARED = "_runtime_flags"  # the dest that records which rows a parser declared


def add_runtime_arguments(parser: argparse.ArgumentParser, names: Iterable[str] = MODEL + DECODING) -> None:
    """Declares the runtime flags `names` (load() keywords; default: all of them) on a verb's parser."""
    names = tuple(names)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown runtime flags {unknown}; known: {', '.join(BY_NAME)}")
    for name in names:
        flag = BY_NAME[name]
        parser.add_argument(flag.flag, dest=flag.kwarg, **flag.options)
    parser.set_defaults(**{_DECLARED: names})


def load_kwargs(args: argparse.Namespace) -> dict:
    """The `blockspec.load` keywords of the runtime flags the verb declared, as parsed."""
    return {name: getattr(args, name) for name in getattr(args, _DECLARED)}


def command_args(args: argparse.Namespace) -> list[str]:
    """The runtime flags the verb declared, spelled out with their parsed values (None: left out),
    so that a report's command line repeats the run exactly."""
    out: list[str] = []
    for name in getattr(args, _DECLARED):
        flag, value = BY_NAME[name], getattr(args, name)
        if value is None:
            continue
        if flag.options.get("action") is argparse.BooleanOptionalAction:
            out.append(flag.flag if value else f"--no-{flag.flag[2:]}")
        else:
            out += [flag.flag, str(value)]
    return out
