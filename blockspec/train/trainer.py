"""The DFlash drafter trainer (docs/DESIGN.md section 7): frozen target, packed anchor blocks,
position-decayed cross-entropy, warmup + cosine schedule, checkpoints, JSONL logs, quick tau evals.

Data parallel over `torchrun` processes (gloo on CPU, nccl on GPU): every global step takes
`batch_seqs` sequences, each rank handles its share, the loss is normalised by the GLOBAL weight
sum and gradients are summed across ranks, so N processes compute exactly the update one process
computes for the same step (up to float summation order). `parallel="ddp"` replicates the drafter
and all-reduces gradients; `parallel="fsdp"` shards parameters, gradients and optimizer state with
FSDP2 (`fully_shard`) and gathers full tensors only to save and evaluate on rank 0.
"""

from __future__ import annotations

import json
import math
import signal
import time
from dataclasses import asdict
from pathlib import Path

import torch

from blockspec.errors import CheckpointError, ConfigError
from blockspec.dflash.checkpoint import SAVE_DTYPES
from blockspec.dflash.drafter import DFLASH2, DFlashDrafter, load_drafter, new_drafter_for_target, save_drafter
from blockspec.train.data import Example
from blockspec.train.distributed import DistInfo, shard_drafter
from blockspec.train.loss import position_weights
from blockspec.train.sequence import attention_windows, derived_seed, prepare_sequence, sequence_forward
from blockspec.train.teacher import teacher_hidden, teacher_target
from blockspec.train.train_config import TrainConfig, init_source


def lr_factor(step: int, total: int, warmup: float, min_ratio: float) -> float:
    """Linear warmup over `warmup * total` steps, then cosine decay to `min_ratio`."""
    warm = max(1, int(round(warmup * total)))
    if step < warm:
        return (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, total - warm))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def _optimizer_state_by_name(state: dict, names: list[str]) -> dict:
    """An `optimizer.state_dict()` (parameters as indices) keyed by parameter names instead, the
    layout `set_optimizer_state_dict` takes: lets an FSDP run resume a replicated run's checkpoint."""
    return {
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


class Trainer:
    """Runs one training job; see `blockspec train --help` for the knobs."""

    def __init__(
        self,
        cfg: TrainConfig,
        target: object,
        examples: list[Example],
        *,
        features: object | None = None,
        eval_prompts: list[list[int]] | None = None,
        resume: bool = False,
        log_fn=print,
    ) -> None:
        self.cfg = cfg
        self.target = target
        self.examples = examples
        self.examples_by_id = {e.id: e for e in examples}
        self.features = features
        self.eval_prompts = eval_prompts or []
        self.dist = DistInfo()
        self.out = Path(cfg.out)
        self.log_fn = log_fn if self.dist.main else (lambda *a, **k: None)
        self.device = target.device
        if not examples:
            raise ConfigError("no training examples; run `blockspec datagen` first")
        for p in target.model.parameters():
            p.requires_grad_(False)
        self.pos_weights = position_weights(cfg.block_size, cfg.gamma)
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * len(examples) / cfg.batch_seqs))
        self.step = 0
        self.arch = cfg.architecture()
        ckpt = self.out / "checkpoint"
        if resume and (ckpt / "config.json").exists():
            self.drafter = load_drafter(ckpt, dtype=torch.float32, device=str(self.device))
            self._check_resumable()
        else:
            self.drafter = self._new_drafter()
        attention_windows(self.drafter)  # refused here, before any data is read, if it cannot be trained
        self.drafter.train()
        self.candidates, self.candidate_head = None, None
        # a drafter continued from (--init or --resume) keeps every token it could propose before:
        # new data alone would drop the tokens only the earlier stages' data held
        prior = self.drafter.draft_vocab
        selector_only = cfg.train == "selector"
        if selector_only and prior is None and cfg.loss_vocab == "data":
            raise ConfigError("--train selector keeps the drafter's proposals, and this drafter proposes from the whole "
                              "vocabulary: --loss-vocab data would restrict them; use --loss-vocab full")
        self.drafter.set_draft_vocab(None)
        if cfg.loss_vocab == "data" or (selector_only and prior is not None):
            if selector_only:  # the backbone's draft vocabulary as it is; other labels do not count
                toks = set(prior.tolist())
            else:
                toks = {t for e in examples for t, m in zip(e.input_ids, e.loss_mask) if m}
                if prior is not None:
                    seen = len(toks)
                    toks.update(prior.tolist())
                    self.log_fn(f"candidate tokens: {seen} seen in the data + {len(toks) - seen} more from the "
                                "starting drafter's draft vocabulary")
            toks = sorted(toks)
            self.candidates = torch.tensor(toks, dtype=torch.long, device=self.device)
            full = target.head()
            self.candidate_head = torch.nn.Linear(full.weight.shape[1], len(toks), bias=full.bias is not None)
            with torch.no_grad():
                self.candidate_head.weight.copy_(full.weight[self.candidates])
                if full.bias is not None:
                    self.candidate_head.bias.copy_(full.bias[self.candidates])
            self.candidate_head.requires_grad_(False).to(self.device)
            self.log_fn(f"loss over {len(toks)} candidate tokens (of {target.info.vocab_size})")
            # the drafter only learns to rank these tokens: it proposes from them too (saved as
            # draft_vocab.safetensors; verification is unchanged, so output stays lossless)
            self.drafter.set_draft_vocab(self.candidates, target.info.vocab_size)
            if self.drafter.candidate_selector is not None and self.drafter.candidate_selector.token_ids is not None:
                # compact codebooks follow the draft vocabulary (a new token's rows start at zero)
                self.drafter.candidate_selector.use_rows(self.drafter.draft_vocab)
        if selector_only:
            for name, p in self.drafter.named_parameters():
                p.requires_grad_(name.startswith("candidate_selector."))
            self.log_fn("training the candidate selector alone: every other weight stays as --init has it")
        # a single process has nothing to shard: "fsdp" then trains the plain drafter
        self.fsdp = cfg.parallel == "fsdp" and self.dist.active
        self._gathered: tuple[int, dict] | None = None  # (step, full weights) under FSDP, rank 0
        if self.fsdp:
            shard_drafter(self.drafter, self.device)
            self.log_fn(f"drafter sharded over {self.dist.world} ranks (FSDP2)")
        self.optimizer = torch.optim.AdamW(
            [p for p in self.drafter.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.95),
            weight_decay=cfg.weight_decay,
        )
        if resume and (ckpt / "trainer_state.pt").exists():
            state = torch.load(ckpt / "trainer_state.pt", map_location=self.device, weights_only=False)
            self._load_optimizer(state)
            self.step = int(state["step"])
            self.log_fn(f"resumed from {ckpt} at step {self.step}")
        # distillation reads the target's distributions from a native copy where it can (teacher.py)
        self.teacher = teacher_target(target) if cfg.distill > 0 else None
        self._stop = False

    def _load_optimizer(self, state: dict) -> None:
        """Optimizer state from a checkpoint of either kind: "optimizer" (a replicated run's
        state_dict) or "optimizer_full" (an FSDP run's full tensors keyed by parameter name)."""
        if "optimizer_full" not in state and not self.fsdp:
            self.optimizer.load_state_dict(state["optimizer"])
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        full = state.get("optimizer_full")
        if full is None:
            full = _optimizer_state_by_name(state["optimizer"], [n for n, _ in self.drafter.named_parameters()])
        # every rank holds the whole file and keeps its own shard of it
        set_optimizer_state_dict(self.drafter, self.optimizer, full, options=StateDictOptions(full_state_dict=True))

    def _check_resumable(self) -> None:
        c = self.drafter.cfg
        if c.architecture != self.arch:
            raise CheckpointError(
                f"checkpoint in {self.out / 'checkpoint'} holds a {c.architecture}, but this run trains a "
                f"{self.arch}; use another --out or the same --arch"
            )
        if c.block_size != self.cfg.block_size or c.num_hidden_layers != self.cfg.num_layers:
            raise CheckpointError(
                f"checkpoint in {self.out / 'checkpoint'} has block_size {c.block_size} and "
                f"{c.num_hidden_layers} layers, but this run asks for {self.cfg.block_size} and "
                f"{self.cfg.num_layers}; use another --out or the same settings"
            )

    def _new_drafter(self) -> DFlashDrafter:
        cfg = self.cfg
        if cfg.mask_token_id is None:
            raise ConfigError("a mask token id is needed (--mask-token-id)")
        torch.manual_seed(cfg.seed)
        source = init_source(cfg.init)
        if source is not None:
            return self._drafter_from(source)
        dflash2 = self.arch == DFLASH2
        drafter = new_drafter_for_target(
            self.target.model.config, mask_token_id=cfg.mask_token_id, num_layers=cfg.num_layers,
            block_size=cfg.block_size, target_layer_ids=cfg.target_layer_ids, seed=cfg.seed,
            architecture=self.arch, dflash2=cfg.dflash2_settings() if dflash2 else None,
        ).to(self.device)
        if cfg.init == "target":
            from blockspec.train.init import init_from_target

            calib = torch.tensor([self.examples[0].input_ids[: cfg.max_seq_len]])
            src = init_from_target(drafter, self.target.model, calibration_ids=calib, log_fn=self.log_fn)
            self.log_fn(f"draft layers initialised from target layers {src}")
        return drafter

    def _drafter_from(self, path: Path) -> DFlashDrafter:
        """A drafter directory as the starting point; its shape must be the run's, but it may grow deeper."""
        from blockspec.dflash.drafter import check_compatible

        cfg = self.cfg
        drafter = load_drafter(path, dtype=torch.float32, device=str(self.device))
        d = drafter.cfg
        tcfg = getattr(self.target.model.config, "text_config", None) or self.target.model.config
        check_compatible(d, hidden_size=int(tcfg.hidden_size), vocab_size=int(tcfg.vocab_size),
                         num_layers=int(tcfg.num_hidden_layers))
        if cfg.num_layers != d.num_hidden_layers:
            from blockspec.train.init import grow_layers

            drafter = grow_layers(drafter, cfg.num_layers)
            self.log_fn(f"drafter grown from {d.num_hidden_layers} to {cfg.num_layers} layers "
                        "(new layers on top, outputs unchanged at the start)")
        wanted = {"--block-size": (d.block_size, cfg.block_size),
                  "--mask-token-id": (d.mask_token_id, cfg.mask_token_id),
                  "--target-layer-ids": (tuple(d.target_layer_ids), cfg.target_layer_ids or tuple(d.target_layer_ids))}
        for flag, (have, want) in wanted.items():
            if have != want:
                raise ConfigError(f"--init {path}: the drafter has {flag} {have}, the run asks for {want}; "
                                  f"drop {flag} (it is read from the drafter) or start from 'target'/'random'")
        self.log_fn(f"draft weights initialised from {path}")
        return self._as_architecture(drafter, path).train()

    def _as_architecture(self, drafter: DFlashDrafter, path: Path) -> DFlashDrafter:
        """The --init drafter in this run's architecture: a DFlash one converted to DFlash 2 (its
        outputs unchanged at the start); a DFlash 2 one kept, its DFlash 2 keys as asked."""
        d = drafter.cfg
        if d.architecture == self.arch:
            if d.dflash2:
                for key, want in self.cfg.dflash2_settings().items():
                    if getattr(d, key) != want:
                        flag = "--" + key.replace("_", "-")
                        raise ConfigError(f"--init {path}: the drafter has {flag} {getattr(d, key)}, the run asks "
                                          f"for {want}; drop {flag} (it is read from the drafter)")
            return drafter
        if self.arch != DFLASH2:
            raise ConfigError(f"--init {path} is a {d.architecture}; a DFlash drafter cannot be made from it "
                              "(drop --arch, or use --arch dflash2)")
        from blockspec.train.init import to_dflash2

        two = to_dflash2(drafter, self.cfg.dflash2_settings(), seed=self.cfg.seed)
        c = two.cfg
        self.log_fn(f"converted to DFlash 2 (conv kernel {c.conv_kernel_size}, group {c.conv_group_size}, selector "
                    f"rank {c.selector_rank}, top-{c.selector_top_k}): identity convolutions, a selector that "
                    "adds nothing yet")
        return two

    # ------------------------------------------------------------------ data order

    def _step_examples(self, step: int) -> list[tuple[int, int]]:
        """(epoch, example index) of the global step's sequences, the same on every rank."""
        n = len(self.examples)
        out = []
        for j in range(self.cfg.batch_seqs):
            g = step * self.cfg.batch_seqs + j
            epoch, pos = divmod(g, n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(derived_seed(self.cfg.seed, "epoch", epoch)))
            out.append((epoch, int(perm[pos])))
        return out

    def _features(self, ex: Example, seq_len: int) -> torch.Tensor:
        if self.features is not None and ex.id in self.features:
            return self.features.get(ex.id)[:seq_len]
        from blockspec.train.features import target_features

        return target_features(self.target, [ex.input_ids[:seq_len]], self.drafter.target_layer_ids)[0]

    # ------------------------------------------------------------------ training

    def train_step(self, step: int) -> dict:
        cfg = self.cfg
        t0 = time.perf_counter()
        self._gathered = None  # the weights are about to change
        todo = self._step_examples(step)[self.dist.rank :: self.dist.world]
        seqs = []
        for epoch, i in todo:
            ex = self.examples[i]
            s = prepare_sequence(ex, cfg.block_size, cfg.anchors, cfg.max_seq_len, self.pos_weights,
                                 derived_seed(cfg.seed, "anchors", epoch, i))
            if s is not None:
                if cfg.train == "selector" and self.candidates is not None:
                    # a label the drafter cannot propose teaches its frozen selector nothing
                    s.weights = s.weights * torch.isin(s.labels, self.candidates.cpu()).float()
                seqs.append(s)
        local_w = torch.tensor([sum(s.weight_sum for s in seqs)], dtype=torch.float64)
        global_w = float(self.dist.sum_(local_w.clone())[0])
        passes = len(seqs)
        if self.fsdp:  # every forward/backward gathers and reduces shards: all ranks make as many
            passes = int(self.dist.max_(torch.tensor([passes], dtype=torch.float64))[0])
        for g in self.optimizer.param_groups:
            g["lr"] = cfg.lr * lr_factor(step, self.total_steps, cfg.warmup, cfg.min_lr_ratio)
        self.optimizer.zero_grad(set_to_none=False)
        B1 = cfg.block_size - 1
        stats = torch.zeros(3 + 2 * B1, dtype=torch.float64)  # sum wce, n anchors, streak sum, hits, counts
        dflash2 = self.drafter.candidate_selector is not None
        # DFlash 2: unary sum, selector sum, selector streak sum, top-K hits, selector hits
        stats2 = torch.zeros(3 + 2 * B1, dtype=torch.float64)
        for s in seqs:
            feats = self._features(self.examples_by_id[s.example_id], s.ids.numel())
            teacher = None
            if cfg.distill > 0:
                teacher = teacher_hidden(self.teacher, s.ids, feats, self.drafter.target_layer_ids)
            parts: dict = {}
            total, correct = sequence_forward(
                self.drafter, self.target, s, feats, head_chunk=cfg.head_chunk, autocast=cfg.precision == "bf16",
                candidates=self.candidates, candidate_head=self.candidate_head, teacher=teacher, distill=cfg.distill,
                selector_alpha=cfg.selector_loss_alpha, parts=parts, frozen=cfg.train == "selector",
            )
            if global_w > 0:
                (total / global_w).backward()
            elif self.fsdp:
                (total * 0).backward()  # FSDP reduces gradients in backward: every rank takes part
            valid = (s.weights > 0).to(correct.device)
            hit = (correct & valid).cpu()
            stats[0] += float(total.detach())
            stats[1] += s.anchors.numel()
            # accepted-length proxy: consecutive correct predictions from k = 1, +1 for the bonus
            stats[2] += float((hit.long().cumprod(1).sum(1) + 1).sum())
            stats[3 : 3 + B1] += hit.sum(0).double()
            stats[3 + B1 :] += valid.cpu().sum(0).double()
            if dflash2:
                in_top = (parts["in_top_k"] & valid).cpu()
                sel_hit = (parts["selector_correct"] & valid).cpu()
                stats2[0] += parts["unary"]
                stats2[1] += parts["selector"]
                stats2[2] += float((sel_hit.long().cumprod(1).sum(1) + 1).sum())
                stats2[3 : 3 + B1] += in_top.sum(0).double()
                stats2[3 + B1 :] += sel_hit.sum(0).double()
        for _ in range(passes - len(seqs)):
            self._idle_pass()
        if self.dist.active and not self.fsdp:
            # a rank whose sequences were all too short made no backward: it still joins the sum
            for p in self.drafter.parameters():
                if p.grad is None and p.requires_grad:
                    p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.drafter.parameters() if p.grad is not None]
        if self.dist.active and not self.fsdp and grads:  # FSDP has reduce-scattered them already
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.dist.sum_(flat)
            o = 0
            for g in grads:
                g.copy_(flat[o : o + g.numel()].view_as(g))
                o += g.numel()
        norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
        if hasattr(norm, "full_tensor"):  # FSDP: a replicated DTensor holding the global norm
            norm = norm.full_tensor()
        if global_w > 0:
            self.optimizer.step()
        self.dist.sum_(stats)
        counts = stats[3 + B1 :].clamp_min(1)
        extra = {}
        if dflash2:
            self.dist.sum_(stats2)
            extra = {
                "unary_loss": float(stats2[0] / max(global_w, 1e-12)),
                "selector_loss": float(stats2[1] / max(global_w, 1e-12)),
                "selector_top_k": self.drafter.cfg.selector_top_k,
                "topk_recall": [round(float(a), 4) for a in (stats2[3 : 3 + B1] / counts)],
                "selector_acc": [round(float(a), 4) for a in (stats2[3 + B1 :] / counts)],
                "tau_proxy_selector": round(float(stats2[2] / stats[1]), 4) if stats[1] > 0 else 1.0,
            }
        return {
            "type": "train",
            "step": step + 1,
            "loss": float(stats[0] / max(global_w, 1e-12)),
            # --train selector scores over the --init drafter's draft vocabulary whatever --loss-vocab says
            "loss_vocab": "draft" if cfg.train == "selector" and self.candidates is not None else cfg.loss_vocab,
            **({"distill": cfg.distill} if cfg.distill > 0 else {}),
            "acc": [round(float(a), 4) for a in (stats[3 : 3 + B1] / counts)],
            "tau_proxy": round(float(stats[2] / stats[1]), 4) if stats[1] > 0 else 1.0,
            **extra,
            "anchors": int(stats[1]),
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": round(float(norm), 4),
            "step_s": round(time.perf_counter() - t0, 3),
        }

    def _idle_pass(self) -> None:
        """A forward and backward that adds zero to every gradient: under FSDP a rank with fewer
        sequences than another in this step must still join each pass's collectives."""
        d = self.drafter
        H, B = d.cfg.hidden_size, d.block_size
        dtype = d.fc.weight.dtype
        feats = torch.zeros(1, 1, len(d.target_layer_ids) * H, dtype=dtype, device=self.device)  # [1, 1, L*H]
        embeds = torch.zeros(1, B, H, dtype=dtype, device=self.device)  # [1, B, H]
        ctx_pos = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        blk_pos = torch.arange(1, B + 1, device=self.device)[None]
        with torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16, enabled=self.cfg.precision == "bf16"):
            hidden = d(feats, ctx_pos, embeds, blk_pos)  # [1, B, H]
        zero = hidden.float().sum() * 0
        if d.candidate_selector is not None:  # used outside the forward: its gradients must exist too
            zero = zero + sum(p.sum() for p in d.candidate_selector.parameters()) * 0
        zero.backward()

    def unsharded_drafter(self, device: torch.device | str | None = None) -> DFlashDrafter | None:
        """The drafter as a plain module with the current weights: `self.drafter` itself when it is
        replicated; under FSDP a copy built on rank 0 from the gathered shards (None on the other
        ranks), so under FSDP EVERY rank must call this together."""
        if not self.fsdp:
            return self.drafter
        if self._gathered is None or self._gathered[0] != self.step:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(self.drafter, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            self._gathered = (self.step, full if self.dist.main else {})
        if not self.dist.main:
            return None
        with torch.device("meta"):  # no throwaway initialisation: the weights come from the gather
            model = DFlashDrafter(self.drafter.cfg)
            if model.candidate_selector is not None:  # the codebooks' layout, compact or published
                model.candidate_selector.use_rows(self.drafter.candidate_selector.token_ids)
        model.load_state_dict(self._gathered[1], assign=True)
        for name, buf in self.drafter.named_buffers():  # buffers are not sharded, and not all are saved
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, buf.detach().clone())
        return model.to(device or self.device).train(self.drafter.training)

    def _evaluate_and_log(self, t_start: float) -> dict | None:
        """Runs the quick tau evaluation and logs it (rank 0 gets a result; others None)."""
        result = self.evaluate()
        if result:
            result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
            self._log(result)
            self.log_fn(f"eval step {self.step}: tau {result['tau']:.3f}")
        return result

    def evaluate(self) -> dict | None:
        """Quick tau and the full loss on rank 0 (every rank must call it: FSDP gathers)."""
        if not self.eval_prompts:
            return None
        drafter = self.unsharded_drafter()
        if not self.dist.main:
            return None
        from blockspec.train.evaluate import quick_tau

        res = quick_tau(self.target, drafter, self.eval_prompts, max_new_tokens=self.cfg.eval_max_new_tokens)
        return {"type": "eval", "step": self.step, **self.full_losses(drafter=drafter), **res}

    def full_loss(self, n: int = 4, drafter: DFlashDrafter | None = None) -> float:
        """The exact published loss (full vocabulary) on the first n training sequences, with
        fixed anchors: comparable across steps and runs whatever `loss_vocab` trains with, and
        between DFlash and DFlash 2 drafters (the unary loss only).
        `drafter` defaults to `self.drafter`; pass `unsharded_drafter()` under FSDP."""
        return self.full_losses(n, drafter)["loss_full"]

    @torch.no_grad()
    def full_losses(self, n: int = 4, drafter: DFlashDrafter | None = None) -> dict:
        """{"loss_full": `full_loss`} and for DFlash 2 "selector_loss_full", the selector's loss
        over the full vocabulary's top K on the same blocks."""
        drafter = drafter if drafter is not None else self.drafter
        tot, sel, wsum = 0.0, 0.0, 0.0
        for i, ex in enumerate(self.examples[:n]):
            s = prepare_sequence(ex, self.cfg.block_size, self.cfg.anchors, self.cfg.max_seq_len,
                                 self.pos_weights, derived_seed(self.cfg.seed, "fixed", i))
            if s is None:
                continue
            parts: dict = {}
            sequence_forward(drafter, self.target, s, self._features(ex, s.ids.numel()),
                             head_chunk=self.cfg.head_chunk, parts=parts)
            tot, sel, wsum = tot + parts["unary"], sel + parts.get("selector", 0.0), wsum + s.weight_sum
        out = {"loss_full": tot / max(wsum, 1e-12)}
        if drafter.candidate_selector is not None:
            out["selector_loss_full"] = sel / max(wsum, 1e-12)
        return out

    def save_checkpoint(self) -> None:
        """fp32 drafter + optimizer state to OUT/checkpoint (every rank must call it: FSDP gathers
        full tensors to rank 0, which writes them)."""
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            model = self.unsharded_drafter("cpu")
            optim = {"optimizer_full": get_optimizer_state_dict(
                self.drafter, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))}
        else:
            model = self.drafter
            optim = {"optimizer": self.optimizer.state_dict()} if self.dist.main else {}
        if not self.dist.main:
            return
        ckpt = self.out / "checkpoint"
        tmp = self.out / "checkpoint.tmp"
        save_drafter(model, tmp)
        torch.save({**optim, "step": self.step, "config": asdict(self.cfg)}, tmp / "trainer_state.pt")
        if ckpt.exists():
            for f in ckpt.iterdir():
                f.unlink()
            ckpt.rmdir()
        tmp.rename(ckpt)

    def save_final(self) -> Path:
        """The published-format drafter in `save_dtype` to OUT/drafter (every rank must call it)."""
        final = self.out / "drafter"
        model = self.unsharded_drafter("cpu")
        if self.dist.main:
            import copy

            if not self.fsdp:  # under FSDP `model` is already a copy
                model = copy.deepcopy(model)
            save_drafter(model.to(SAVE_DTYPES[self.cfg.save_dtype]), final)
        return final

    def _log(self, record: dict) -> None:
        if not self.dist.main:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        with (self.out / "log.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")

    def _on_signal(self, *_: object) -> None:
        self._stop = True

    def train(self) -> dict:
        """Runs until the step budget, the time limit or SIGTERM/SIGINT; returns the last records."""
        cfg = self.cfg
        if self.dist.main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str) + "\n")
        old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for s in old:
                signal.signal(s, self._on_signal)
        except ValueError:  # not the main thread
            old = {}
        t_start = time.perf_counter()
        last_train, last_eval = None, None
        first_step = self.step
        window: list[dict] = []
        if self.step == 0 and cfg.eval_every:
            last_eval = self.evaluate()
            if last_eval:
                self._log({**last_eval, "elapsed_s": 0.0})
                self.log_fn(f"eval step 0: tau {last_eval['tau']:.3f}")
        try:
            while self.step < self.total_steps:
                rec = self.train_step(self.step)
                self.step += 1
                window.append(rec)
                rec = _average(window)  # a log line summarises the steps since the last one
                rec["elapsed_s"] = round(time.perf_counter() - t_start, 1)
                rec["seqs"] = self.step * cfg.batch_seqs
                last_train = rec
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    window = []
                    self._log(rec)
                    two = ""
                    if "selector_acc" in rec:
                        two = (f" | top{rec['selector_top_k']}@1 {rec['topk_recall'][0]:.3f} sel1 "
                               f"{rec['selector_acc'][0]:.3f} sel-tau~{rec['tau_proxy_selector']:.2f}")
                    self.log_fn(
                        f"step {rec['step']}/{self.total_steps} loss {rec['loss']:.4f} acc1 {rec['acc'][0]:.3f} "
                        f"tau~{rec['tau_proxy']:.2f}{two} lr {rec['lr']:.2e} {rec['step_s']:.2f}s/step"
                    )
                stop_flag = torch.tensor([1.0 if self._stop else 0.0])
                if cfg.time_limit_s and time.perf_counter() - t_start > cfg.time_limit_s:
                    stop_flag[0] = 1.0
                stop = bool(self.dist.sum_(stop_flag)[0] > 0)
                if cfg.save_every and self.step % cfg.save_every == 0 and not stop:
                    self.save_checkpoint()
                    self.save_final()
                    self.plot_curves()
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < self.total_steps and not stop:
                    last_eval = self._evaluate_and_log(t_start)
                    self.dist.barrier()
                if stop:
                    self.log_fn(f"stopping at step {self.step} (time limit or signal); saving")
                    break
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        self.save_checkpoint()
        final = self.save_final()
        # a signal on any rank wants a quick exit; all ranks must agree (FSDP evals gather on all)
        quick_exit = bool(self.dist.sum_(torch.tensor([1.0 if self._stop else 0.0]))[0] > 0)
        if self.eval_prompts and self.step > first_step and not quick_exit:
            last_eval = self._evaluate_and_log(t_start)
        self.plot_curves()
        self.dist.barrier()
        return {"train": last_train, "eval": last_eval, "drafter": str(final), "steps": self.step,
                "curves": str(self.out / "curves.png")}

    def plot_curves(self) -> None:
        """OUT/curves.png from log.jsonl (loss, accuracy by block position, tau); rank 0 only."""
        if self.dist.main and (self.out / "log.jsonl").exists():
            from blockspec.train.curves import plot_curves

            name = "DFlash 2" if self.arch == DFLASH2 else "DFlash"
            plot_curves(self.out / "log.jsonl", self.out / "curves.png", title=f"{name} drafter training: {self.out.name}")


def _average(records: list[dict]) -> dict:
    """The last record with loss, accuracy and tau proxy averaged over steps that had anchors."""
    out = dict(records[-1])
    used = [r for r in records if r["anchors"] > 0] or records[-1:]
    out["loss"] = sum(r["loss"] for r in used) / len(used)
    out["acc"] = [round(sum(r["acc"][k] for r in used) / len(used), 4) for k in range(len(used[0]["acc"]))]
    out["tau_proxy"] = round(sum(r["tau_proxy"] for r in used) / len(used), 4)
    for key in ("unary_loss", "selector_loss", "tau_proxy_selector"):
        if key in out:
            out[key] = round(sum(r[key] for r in used) / len(used), 6)
    for key in ("topk_recall", "selector_acc"):
        if key in out:
            out[key] = [round(sum(r[key][k] for r in used) / len(used), 4) for k in range(len(used[0][key]))]
    out["anchors"] = sum(r["anchors"] for r in records)
    out["steps_averaged"] = len(records)
    out["step_s"] = round(sum(r["step_s"] for r in records) / len(records), 3)
    return out
