"""`blockspec train`: train a DFlash drafter for a target on `blockspec datagen` shards.

Single process: `blockspec train --target T --data D --out O`. Data parallel:
`torchrun --nproc-per-node N -m blockspec.cli train ...` (gloo on CPU, nccl on GPU); add
`--parallel fsdp` to shard the drafter instead of replicating it. `--arch dflash2` trains a
DFlash 2 drafter; with `--init DIR` of a DFlash drafter it converts that drafter first.
"""

from __future__ import annotations

import argparse
import json

from blockspec.commands import DEFAULT_TARGET
from blockspec.commands.model_args import device_name

HELP = "train a DFlash (or DFlash 2) drafter for a target model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"zoo name (see `blockspec pull --list`), local HF directory or Hub id (default {DEFAULT_TARGET})")
    p.add_argument("--data", required=True, help="directory written by `blockspec datagen`")
    p.add_argument("--out", default=None, help="run directory: log.jsonl, checkpoint/, drafter/")
    p.add_argument("--cache-features", action="store_true",
                   help="compute and cache the target features of every shard, then exit")
    p.add_argument("--no-feature-cache", action="store_true", help="compute target features on the fly")
    p.add_argument("--feature-cache-dir", default=None, help="default: DATA/features")
    p.add_argument("--num-layers", type=int, default=None,
                   help="draft layers (default 1, or --init's; more than --init's adds layers on top that "
                        "start as no-ops, so training continues from the same outputs)")
    p.add_argument("--block-size", type=int, default=None, help="default 16, or --init's")
    p.add_argument("--target-layer-ids", default=None, help="comma list (default: spread like the published drafters)")
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--init", default="target",
                   help="target: draft layers start as copies of the target layers after the last fused one; "
                        "random; or a drafter directory (published format) to continue training from, e.g. "
                        "to fine-tune a published drafter on your data (its shape and layers are kept)")
    p.add_argument("--arch", default=None, choices=["dflash", "dflash2"],
                   help="dflash, or dflash2: block convolutions and a candidate selector trained beside the "
                        "unary loss (default: --init's architecture, else dflash). --init DIR of a DFlash "
                        "drafter with --arch dflash2 converts it: same proposals at the start")
    p.add_argument("--conv-kernel-size", type=int, default=None, help="DFlash 2 convolution taps (default 2)")
    p.add_argument("--conv-group-size", type=int, default=None,
                   help="DFlash 2 channels sharing one dynamic kernel (default 16)")
    p.add_argument("--selector-rank", type=int, default=None, help="DFlash 2 selector rank (default 256)")
    p.add_argument("--selector-top-k", type=int, default=None,
                   help="DFlash 2 candidates per block position (default 16)")
    p.add_argument("--selector-loss-alpha", type=float, default=1.0,
                   help="weight of the DFlash 2 selector loss beside the unary loss")
    p.add_argument("--train", default="all", choices=["all", "selector"],
                   help="all: every drafter weight learns; selector: a DFlash 2 drafter's candidate selector "
                        "alone (hidden projection, codebooks), on the frozen backbone, convolutions and draft "
                        "vocabulary of --init DIR (with --arch dflash2 to add a selector to a DFlash drafter); "
                        "far cheaper a step: no backward through the drafter")
    p.add_argument("--anchors", type=int, default=512, help="max anchors (blocks) per sequence")
    p.add_argument("--batch-seqs", type=int, default=4, help="sequences per optimizer step (global)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=float, default=0.04, help="warmup fraction of the steps")
    p.add_argument("--min-lr-ratio", type=float, default=0.05, help="cosine floor as a fraction of --lr")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16 = autocast")
    p.add_argument("--gamma", type=float, default=None, help="loss decay (default 7 for B=16, 5 for 10, 4 for 8)")
    p.add_argument("--max-seq-len", type=int, default=3072)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=0, help="steps between quick tau evals (0: end only)")
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out gsm8k TRAIN prompts for the eval")
    p.add_argument("--eval-max-new-tokens", type=int, default=128)
    p.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: end only)")
    p.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--head-chunk", type=int, default=1024, help="rows per chunk of the fused head loss")
    p.add_argument("--loss-vocab", default="full", choices=["full", "data"],
                   help="full: the published loss; data: softmax over the label tokens of the data only "
                        "(cheaper; the exact full loss is still logged at every eval)")
    p.add_argument("--distill", type=float, default=0.0,
                   help="weight in [0, 1] of the target's own next-token distribution in each label, beside "
                        "its greedy token (0: the published loss; computed from the top captured feature "
                        "layer when it is near the top of a native target, else by a target forward)")
    p.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp"],
                   help="with torchrun: ddp replicates the drafter on every rank; fsdp shards drafter "
                        "parameters, gradients and optimizer state across ranks, for drafters too large "
                        "to replicate (same updates either way)")
    p.add_argument("--time-limit", type=float, default=None, help="stop (and save) after this many seconds")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="a folder holding gsm8k_train.jsonl, for the --eval-prompts held-out gsm8k prompts; "
                        "default $BLOCKSPEC_DATA, else the Hugging Face Hub (needs `datasets` and a network)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="target dtype")
    p.add_argument("--device", default=None, type=device_name, metavar="{cpu,cuda[:N]}",
                   help="cpu or cuda (default: cuda when available; under torchrun each rank's own GPU)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def run(args: argparse.Namespace) -> int:
    import os

    import torch

    from blockspec.api import pick_mask_token, resolve_target_dir
    from blockspec.errors import ConfigError
    from blockspec.dflash.drafter import default_target_layer_ids, read_drafter_config
    from blockspec.targets.hf import load_hf_target
    from blockspec.text import encode_prompt
    from blockspec.train.data import heldout_prompts, read_examples
    from blockspec.train.features import FeatureStore
    from blockspec.train.train_config import TrainConfig, init_source
    from blockspec.train.trainer import Trainer

    source = init_source(args.init)  # before the target loads: a wrong path fails at once
    if args.threads:
        from blockspec.cpu.threads import pin

        pin(args.threads)  # the user's count, on every decoding thread (cpu/threads.py)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and "LOCAL_RANK" in os.environ:
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    target, tokenizer = load_hf_target(resolve_target_dir(args.target), dtype=args.dtype, device=device)
    n_layers = target.info.num_layers
    start = read_drafter_config(source) if source is not None else None
    num_layers = args.num_layers if args.num_layers is not None else (start.num_hidden_layers if start else 1)
    block_size = args.block_size if args.block_size is not None else (start.block_size if start else 16)
    mask_token_id = args.mask_token_id if args.mask_token_id is not None else (
        start.mask_token_id if start else pick_mask_token(tokenizer, target.info.vocab_size))
    if args.target_layer_ids:
        layer_ids = tuple(int(x) for x in args.target_layer_ids.split(","))
    elif start is not None:
        layer_ids = tuple(start.target_layer_ids)
    else:
        layer_ids = default_target_layer_ids(n_layers, num_layers)
    store = None if args.no_feature_cache else FeatureStore(args.data, layer_ids, args.feature_cache_dir)
    if args.cache_features:
        made = store.build(target)
        print(json.dumps({"feature_shards_built": made, "layer_ids": list(layer_ids)}))
        return 0
    if args.out is None:
        raise ConfigError("--out is required for training (the run directory)")
    if store is not None:
        if int(os.environ.get("RANK", "0")) == 0:
            store.build(target)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            import torch.distributed as dist

            from blockspec.train.distributed import DistInfo

            DistInfo()
            dist.barrier()
        store.open()
    examples = read_examples(args.data)
    eval_prompts = []
    if args.eval_prompts:
        eval_prompts = [encode_prompt(tokenizer, list(p.messages), chat=True)
                        for p in heldout_prompts(args.eval_prompts, data_dir=args.data_dir)]
    cfg = TrainConfig(
        out=args.out, num_layers=num_layers, block_size=block_size, target_layer_ids=layer_ids,
        mask_token_id=mask_token_id,
        init=args.init, anchors=args.anchors, batch_seqs=args.batch_seqs, epochs=args.epochs,
        max_steps=args.max_steps, lr=args.lr, warmup=args.warmup, min_lr_ratio=args.min_lr_ratio,
        weight_decay=args.weight_decay, grad_clip=args.grad_clip, precision=args.precision, gamma=args.gamma,
        max_seq_len=args.max_seq_len, seed=args.seed, log_every=args.log_every, eval_every=args.eval_every,
        eval_max_new_tokens=args.eval_max_new_tokens, save_every=args.save_every, save_dtype=args.save_dtype,
        head_chunk=args.head_chunk, time_limit_s=args.time_limit, loss_vocab=args.loss_vocab,
        distill=args.distill,
        parallel=args.parallel,
        arch=args.arch, conv_kernel_size=args.conv_kernel_size, conv_group_size=args.conv_group_size,
        selector_rank=args.selector_rank, selector_top_k=args.selector_top_k,
        selector_loss_alpha=args.selector_loss_alpha, train=args.train,
    )
    trainer = Trainer(cfg, target, examples, features=store, eval_prompts=eval_prompts, resume=args.resume)
    result = trainer.train()
    if trainer.dist.main:
        print(json.dumps(result, default=str))
    trainer.dist.close()
    return 0
