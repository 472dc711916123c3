"""`TrainConfig`: everything a training run needs besides the target and the data, validated on
construction (what `blockspec train` builds from its flags)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from blockspec.errors import ConfigError
from blockspec.dflash.checkpoint import SAVE_DTYPES
from blockspec.dflash.drafter import DFLASH2, DFLASH2_DEFAULTS, read_drafter_config

ARCHS = {"dflash": "DFlashDraftModel", "dflash2": DFLASH2}


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs besides the target and the data."""

    out: str
    num_layers: int = 1
    block_size: int = 16
    target_layer_ids: tuple[int, ...] | None = None
    mask_token_id: int | None = None
    # "target": copy target layers (init.py); "random"; or a drafter directory in the published
    # format to continue from (fine-tuning a published drafter, or a longer run on more data)
    init: str = "target"
    anchors: int = 512  # max anchors per sequence
    batch_seqs: int = 4  # sequences per optimizer step (all ranks together)
    epochs: float = 1.0
    max_steps: int | None = None
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of steps
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    precision: str = "fp32"  # "fp32" or "bf16" (autocast of the drafter forward)
    gamma: float | None = None
    max_seq_len: int = 3072
    seed: int = 0
    log_every: int = 1
    eval_every: int = 0  # steps; 0 = only at the end
    eval_max_new_tokens: int = 128
    save_every: int = 0  # steps; 0 = only at the end
    save_dtype: str = "bfloat16"
    head_chunk: int = 1024
    # "full": the published loss over the whole vocabulary. "data": softmax restricted to the
    # tokens that occur as labels in the training data (much cheaper head on CPU); the exact
    # full-vocabulary loss is then still measured and logged at every eval ("loss_full").
    loss_vocab: str = "full"
    # weight of the target's own next-token distribution in each label (0: the published loss on
    # its greedy tokens alone; 1: pure distillation); train/teacher.py
    distill: float = 0.0
    time_limit_s: float | None = None
    # "ddp": every rank holds the whole drafter; "fsdp": parameters, gradients and optimizer state
    # are sharded across ranks (for drafters too large to replicate). Same update either way.
    parallel: str = "ddp"
    # "dflash" or "dflash2" (block convolutions + candidate selector); None: the --init drafter's
    # architecture, else "dflash". A DFlash drafter given to --init with "dflash2" is converted
    # (train/init.py `to_dflash2`): backbone kept, new modules start as no-ops.
    arch: str | None = None
    # DFlash 2 shape (None: the --init drafter's, else the published DFLASH2_DEFAULTS)
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    selector_loss_alpha: float = 1.0  # weight of the selector's K-way loss beside the unary loss
    # "all": every drafter weight learns. "selector": a DFlash 2 drafter's selector alone (hidden
    # projection, codebooks); the backbone, its convolutions and its draft vocabulary stay as
    # --init has them, so the drafter's forward and the unary loss run without autograd.
    train: str = "all"

    def __post_init__(self) -> None:
        init_source(self.init)
        if self.arch not in (None, *ARCHS):
            raise ConfigError(f"--arch must be one of {sorted(ARCHS)}, got {self.arch!r}")
        for name in DFLASH2_DEFAULTS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.arch == "dflash" and self.dflash2_settings():
            raise ConfigError(f"{', '.join('--' + k.replace('_', '-') for k in self.dflash2_settings())} "
                              "only apply to --arch dflash2")
        if not self.selector_loss_alpha >= 0:
            raise ConfigError(f"--selector-loss-alpha must be >= 0, got {self.selector_loss_alpha!r}")
        self.architecture()  # settings that need another architecture fail here, before any loading
        if self.train not in ("all", "selector"):
            raise ConfigError(f"--train must be 'all' or 'selector', got {self.train!r}")
        if self.train == "selector":
            if self.architecture() != DFLASH2:
                raise ConfigError("--train selector trains a DFlash 2 drafter's candidate selector: add --arch dflash2 "
                                  "(with --init DIR to put one on a trained DFlash drafter)")
            if init_source(self.init) is None:
                raise ConfigError("--train selector keeps the backbone as it is: give --init DIR, a trained drafter "
                                  f"(--init {self.init} would leave an untrained backbone frozen)")
            if not self.selector_loss_alpha > 0:
                raise ConfigError("--train selector learns from the selector loss alone: --selector-loss-alpha must be > 0")
            if self.distill > 0:
                raise ConfigError("--distill shapes the unary loss, which --train selector does not train; drop it")
        if self.loss_vocab not in ("full", "data"):
            raise ConfigError(f"--loss-vocab must be 'full' or 'data', got {self.loss_vocab!r}")
        if not 0.0 <= self.distill <= 1.0:
            raise ConfigError(f"--distill must be in [0, 1] (the target distribution's weight in each label), "
                              f"got {self.distill!r}")
        if self.precision not in ("fp32", "bf16"):
            raise ConfigError(f"--precision must be fp32 or bf16, got {self.precision!r}")
        if self.save_dtype not in SAVE_DTYPES:
            raise ConfigError(f"--save-dtype must be one of {sorted(SAVE_DTYPES)}, got {self.save_dtype!r}")
        if self.parallel not in ("ddp", "fsdp"):
            raise ConfigError(f"--parallel must be 'ddp' (replicated drafter) or 'fsdp' (sharded), "
                              f"got {self.parallel!r}")
        for name in ("num_layers", "anchors", "batch_seqs", "max_seq_len", "head_chunk"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)!r}")
        if self.block_size < 2:
            raise ConfigError(f"--block-size must be >= 2, got {self.block_size}")
        if not self.lr > 0 or self.epochs <= 0:
            raise ConfigError("--lr and --epochs must be positive")
        if not 0 <= self.warmup < 1 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("--warmup must be in [0, 1) and --min-lr-ratio in [0, 1]")

    def dflash2_settings(self) -> dict:
        """The DFlash 2 keys this run sets explicitly."""
        return {k: getattr(self, k) for k in DFLASH2_DEFAULTS if getattr(self, k) is not None}

    def architecture(self) -> str:
        """The drafter architecture this run trains (see `arch`)."""
        source = init_source(self.init)
        if self.arch is not None:
            arch = ARCHS[self.arch]
        else:
            arch = read_drafter_config(source).architecture if source is not None else ARCHS["dflash"]
        if arch != DFLASH2 and self.dflash2_settings():
            raise ConfigError(f"{', '.join('--' + k.replace('_', '-') for k in self.dflash2_settings())} "
                              "only apply to DFlash 2 drafters: add --arch dflash2")
        return arch


def init_source(init: str) -> Path | None:
    """The drafter directory `--init` names, or None for "target" / "random"."""
    if init in ("target", "random"):
        return None
    if not (Path(init) / "config.json").is_file():
        raise ConfigError(f"--init must be 'target', 'random' or a drafter directory with a config.json, "
                          f"got {init!r}")
    return Path(init)
