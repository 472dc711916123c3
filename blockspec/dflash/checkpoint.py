"""The published drafter checkpoint on disk: file names, reading and writing the tensors, and
checking them against a config.

A drafter directory is config.json plus safetensors weights (one file, or shards with an index),
DFlash and DFlash 2 alike (docs/DESIGN.md sections 2 and 3). Which tensors a checkpoint holds,
and their shapes, follow from the config alone (`expected_tensors`), so the same check serves
loading a drafter and exporting one without building the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from blockspec.dflash.drafter_config import DrafterConfig
from blockspec.errors import CheckpointError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Optional, next to the published files (other loaders ignore it): the token ids the drafter
# proposes from. Training with a restricted loss vocabulary writes it; drafting then scores only
# those rows of the head, which is most of a draft pass on CPU. Verification is untouched.
DRAFT_VOCAB_NAME = "draft_vocab.safetensors"
# A DFlash 2 drafter with a draft vocabulary stores its selector codebooks with rows for those
# tokens only ([Vd, r], in the file's order), not the published [V, r]; export writes [V, r].
CODEBOOK_NAMES = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
# The dtypes a drafter checkpoint may be written in (export's and training's --save-dtype).
SAVE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def read_config_json(path: str | Path) -> dict:
    """The raw config.json of a drafter directory."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"drafter directory {path} does not exist")
    cfg_file = path / CONFIG_NAME
    if not cfg_file.exists():
        raise CheckpointError(f"{cfg_file} is missing; a DFlash drafter directory needs config.json")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e}); re-download the drafter") from e


def read_drafter_config(path: str | Path) -> DrafterConfig:
    """The config.json of a drafter directory in the published format."""
    return DrafterConfig.from_dict(read_config_json(path))


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a drafter directory by its published name (one file or index + shards)."""
    from safetensors.torch import load_file

    path = Path(path)
    files: list[Path]
    if (path / INDEX_NAME).exists():
        try:
            index = json.loads((path / INDEX_NAME).read_text())
            files = [path / f for f in sorted(set(index["weight_map"].values()))]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{path / INDEX_NAME} is corrupt ({e}); re-download the drafter") from e
    elif (path / WEIGHTS_NAME).exists():
        files = [path / WEIGHTS_NAME]
    else:
        raise CheckpointError(
            f"no {WEIGHTS_NAME} or {INDEX_NAME} in {path}; point --drafter at a DFlash drafter "
            "directory (config.json + safetensors)"
        )
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.exists():
            raise CheckpointError(f"weight shard {f} is missing; re-download the drafter")
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # safetensors raises several types for truncated files
            raise CheckpointError(f"cannot read {f} ({e}); the file is corrupt, re-download it") from e
    return state


def read_draft_vocab(path: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The sorted token ids [Vd] of a drafter directory's draft_vocab.safetensors (None: no file)."""
    from safetensors.torch import load_file

    f = Path(path) / DRAFT_VOCAB_NAME
    if not f.exists():
        return None
    try:
        ids = load_file(str(f))["token_ids"].long().flatten()
    except Exception as e:  # KeyError, or one of several types safetensors raises several types for corrupt files
        raise CheckpointError(f"{f} is not a valid draft vocabulary ({e}); delete it to draft from the whole "
                              "vocabulary") from e
    if ids.numel() == 0 or not bool((ids[1:] > ids[:-1]).all()) or int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise CheckpointError(f"{f} is not a valid draft vocabulary: its token ids must be sorted, distinct and in "
                              f"[0, {vocab_size}); delete it to draft from the whole vocabulary")
    return ids


def compact_codebooks(cfg: DrafterConfig, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether a DFlash 2 checkpoint stores its codebooks over the draft vocabulary ([Vd, r])."""
    t = tensors.get(CODEBOOK_NAMES[0])
    return bool(cfg.dflash2 and t is not None and t.dim() == 2 and t.shape[0] != cfg.vocab_size)


def write_tensors(tensors: dict[str, torch.Tensor], path: str | Path, *, max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Writes the tensors as model.safetensors, or as shards with an index when larger than
    `max_shard_bytes`, replacing the weight files of an earlier save; returns the file names."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    for stale in [*path.glob("model*.safetensors"), path / INDEX_NAME]:  # an earlier save's shards
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(path / WEIGHTS_NAME), metadata={"format": "pt"})
        return [WEIGHTS_NAME]
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return [*dict.fromkeys(weight_map.values()), INDEX_NAME]


def expected_tensors(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a published DFlash (2) checkpoint with its shape, from the config alone."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        }
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (h,)}
        if cfg.dflash2:  # a kernel per side and tap, and its projection per channel group (conv.py)
            taps = cfg.conv_kernel_size
            projected = 2 * taps * (h // cfg.conv_group_size)
            for conv in ("attention_conv", "mlp_conv"):
                shapes |= {p + f"{conv}.base_kernel": (2, taps, h), p + f"{conv}.kernel_projection.weight": (projected, h)}
    shapes |= {"norm.weight": (h,), "fc.weight": (h, len(cfg.target_layer_ids) * h), "hidden_norm.weight": (h,)}
    if cfg.dflash2:
        rank = cfg.selector_rank
        shapes |= {"candidate_selector.hidden_projection.weight": (rank, h),
                   "candidate_selector.predecessor_codebook": (cfg.vocab_size, rank),
                   "candidate_selector.successor_codebook": (cfg.vocab_size, rank)}
    return shapes


def is_dflash2_tensor(name: str) -> bool:
    """Whether a published tensor name belongs to DFlash 2 only (block convolutions, selector)."""
    return name.startswith("candidate_selector.") or ".attention_conv." in name or ".mlp_conv." in name


def _listed(names: list[str]) -> str:
    return f"{names[:5]}{'...' if len(names) > 5 else ''}"


def check_tensors(cfg: DrafterConfig, tensors: dict[str, torch.Tensor], path: str | Path,
                  draft_vocab: torch.Tensor | None = None) -> None:
    """Raises CheckpointError naming the first tensor that is missing, unexpected or misshapen
    for this config; with `draft_vocab` (the directory's token ids) the codebooks may also hold
    one row per draft-vocabulary token."""
    want = expected_tensors(cfg)
    if draft_vocab is not None and compact_codebooks(cfg, tensors):
        want |= {name: (draft_vocab.numel(), cfg.selector_rank) for name in CODEBOOK_NAMES}
    arch = cfg.architecture
    missing = sorted(set(want) - set(tensors))
    unexpected = sorted(set(tensors) - set(want))
    if missing:
        kind = "DFlash 2 weight" if is_dflash2_tensor(missing[0]) else "weight"
        raise CheckpointError(
            f"{kind} {missing[0]} is missing from {path} (missing in all: {_listed(missing)}); its config.json "
            f"declares a {arch} of these sizes: the checkpoint is incomplete, re-download or re-save it"
        )
    if unexpected and is_dflash2_tensor(unexpected[0]) and not cfg.dflash2:
        raise CheckpointError(
            f"weight {unexpected[0]} in {path} belongs to a DFlash 2 drafter, but its config.json declares "
            f"{arch}; set \"architectures\": [\"DFlash2DraftModel\"] and the DFlash 2 keys in dflash_config"
        )
    if unexpected:
        raise CheckpointError(
            f"unexpected weight {unexpected[0]} in {path} (unexpected in all: {_listed(unexpected)}); "
            f"its config.json declares a {arch} with no such tensor"
        )
    for name, shape in want.items():
        if tuple(tensors[name].shape) != shape:
            why = ""
            if is_dflash2_tensor(name):
                why = (f" (DFlash 2 keys: conv_kernel_size {cfg.conv_kernel_size}, conv_group_size "
                       f"{cfg.conv_group_size}, selector_rank {cfg.selector_rank}, hidden_size {cfg.hidden_size}, "
                       f"vocab_size {cfg.vocab_size})")
                if name in CODEBOOK_NAMES:
                    why += (f"; a codebook over a draft vocabulary has one row per token id of {DRAFT_VOCAB_NAME}, "
                            f"which must lie beside it ({'absent' if draft_vocab is None else draft_vocab.numel()})")
            raise CheckpointError(f"weight {name} in {path} has shape {tuple(tensors[name].shape)}, config.json "
                                  f"implies {shape}{why}")
