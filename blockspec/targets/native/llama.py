"""Native Llama-family target (Llama, SmolLM2, Qwen2, Qwen3) over a position-indexed KV cache.

Numerically the same computation as the Hugging Face modeling code (RMSNorm in fp32, RoPE angles
in fp32, SDPA attention) in the exact compute mode, arranged for speed: q/k/v projections are
fused into one matmul, K/V go straight into the preallocated cache (targets/native/cache.py), and
grouped query heads attend as [kv_heads, groups * q] so the cache is never repeated per query
head. `NativeLlama.forward` is one straight line: the pass's geometry, its backend's layers
(targets/native/backends.py: PyTorch's operators, the exact CPU kernels or the int8 mode's
integer products, chosen at load), the final norm, the backend's head. Greedy steps ask for the
argmax ids only (`forward_greedy`), which an fp32 head on a CPU finds by screening in bf16
(cpu/greedy_head.py).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from blockspec.cpu.linear import fast_cpu_single_row
from blockspec.cpu.packed_cache import pack_cached
from blockspec.targets.base import TargetInfo
from blockspec.targets.native.attention import visible_keys
from blockspec.targets.native.backends import (
    PACKED_HEAD_ROWS,
    Pass,
    TorchBackend,
    backend_for,
    rms_norm,
    rope_bqhd,
    silu_mul,
    spread,
)
from blockspec.targets.native.cache import KVStore, StaticCache
from blockspec.targets.native.config import NativeConfig
from blockspec.targets.native.tree_slots import TreeSlots, tree_slots
from blockspec.targets.rope import Rotary, rope_inv_freq
from blockspec.targets.slots import EMPTY
from blockspec.targets.tree_mask import check_tree_pass


class NativeLayer(nn.Module):
    """One decoder layer's weights; q/k/v fused into qkv [(h + 2 kvh) d, H], gate and up into
    gate_up [2 I, H]. One product instead of two: each output column is the same dot product
    either way (the same bits), and the CPU kernel's call and thread start-up are paid once
    (measured: BENCHMARKS.md, "Kernel measurements")."""

    def __init__(self, cfg: NativeConfig) -> None:
        super().__init__()
        d, h, kvh, hidden = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
        self.input_norm = nn.Parameter(torch.ones(hidden))
        self.qkv = nn.Linear(hidden, (h + 2 * kvh) * d, bias=cfg.qkv_bias)
        self.q_norm = nn.Parameter(torch.ones(d)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(d)) if cfg.qk_norm else None
        self.o = nn.Linear(h * d, hidden, bias=cfg.o_bias)
        self.post_norm = nn.Parameter(torch.ones(hidden))
        self.gate_up = nn.Linear(hidden, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down = nn.Linear(cfg.intermediate_size, hidden, bias=cfg.mlp_bias)


class NativeLlama(nn.Module):
    """The network. Stateless: K/V live in the StaticCache passed to `forward`. How it computes is
    its backend's (targets/native/backends.py), chosen at load by `use`."""

    def __init__(self, cfg: NativeConfig, hf_config: object | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(NativeLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        inv_freq, scaling = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, hf_config)
        self.rotary = Rotary(inv_freq, scaling)
        self.scale = cfg.head_dim**-0.5
        # Transposed [in, out] copies of qkv and gate|up (by module) and of the LM head, used for
        # single-token forwards where the CPU kernel of cpu/linear.py is MKL's: it streams x @ W
        # through memory faster than linear(x, W) for one row, while the [out, in] originals stay
        # faster for blocks of tokens. Costs memory; see `prepare_single_token_weights`.
        self.single: dict[nn.Linear, torch.Tensor] | None = None
        self.single_head: torch.Tensor | None = None
        self.split = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
        self.backend: TorchBackend | None = None  # set by `use`; the first forward takes the exact mode's otherwise

    @property
    def compute(self) -> str:
        """The compute mode: "exact" (fp32 / bf16 as transformers computes, bit-exact kernels) or
        "int8" (integer products, cpu/int8.py)."""
        return self.backend.compute if self.backend is not None else "exact"

    def use(self, compute: str = "exact") -> TorchBackend:
        """Chooses the backend of `compute` ("exact" or "int8") for the weights' device and dtype
        as they are now (backends.backend_for); returns it."""
        self.backend = backend_for(self, compute)
        return self.backend

    def prepare_single_token_weights(self, enabled: bool = True) -> None:
        """Keeps transposed copies of qkv, gate|up and the LM head for one-token forwards, unless
        cpu/linear.py's kernel is faster for one row already (oneDNN)."""
        if not enabled or fast_cpu_single_row():
            self.single, self.single_head = None, None
            return
        with torch.no_grad():
            self.single = {m: m.weight.t().contiguous() for layer in self.layers for m in (layer.qkv, layer.gate_up)}
            self.single_head = self.lm_head.weight.t().contiguous()

    def pack_weights(self, sources: dict[str, torch.Tensor] | None = None, *, cache: Path | None = None,
                     key: dict | None = None) -> int:
        """Packs the projections and the LM head whose fp32 weights a 4- or 8-bit GGUF left
        (cpu/packed_weights.py); the outputs keep their bits and a decoding step streams a fifth of
        the bytes. Greedy steps of more than backends.PACKED_HEAD_ROWS tokens keep the bf16 screen
        of the head (cpu/greedy_head.py), which is faster there. A bf16 model packs the fp32
        `sources` it was rounded from (its native state dict before the cast), where their packed
        values round to its weights. `cache`: a file that keeps the packed forms for the next load
        with the same `key` (cpu/packed_cache.py). Returns how many were packed."""
        pairs = self.packable()
        done = pack_cached(pairs, None if sources is None else [sources.get(n) for n, _ in pairs], cache, key)
        if self.backend is not None:
            self.backend.prepare()  # what it built points at the weights' earlier forms
        return done

    def packable(self) -> list[tuple[str, nn.Linear]]:
        """(name of its weight in the native state dict, module) of each matrix `pack_weights` tries."""
        names = [f"layers.{i}.{n}" for i in range(len(self.layers)) for n in ("qkv", "o", "gate_up", "down")]
        head = "embed" if self.lm_head.weight is self.embed.weight else "lm_head"
        return [(n + ".weight", self.get_submodule(n)) for n in names] + [(head + ".weight", self.lm_head)]

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: StaticCache,
        layer_ids: tuple[int, ...] = (),
        last_logits_only: bool = False,
        real: torch.Tensor | None = None,
        resume: tuple[int, torch.Tensor] | None = None,
        greedy: bool = False,
        tree: TreeSlots | None = None,
        until_rejected: bool = False,
        parents: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids, positions [b, q] (EMPTY = padding) -> logits [b, q|1, V], features [b, q, L*H].

        greedy: the greedy ids [b, q|1] (int64, the argmax of each position's logits, the first of
        ties) in place of the logits; an fp32 head on a CPU is then screened in bf16 and computes
        only the near-maximal logits exactly (cpu/greedy_head.py), the same ids.

        real [T]: flat indices (into b * q) of the tokens that are not padding. The projections,
        norms, rope, K/V writes and the LM head then run on those T tokens only, and attention on
        the [b, q] layout (the kernel skips padding queries); padding positions get zero logits
        and features. What a ragged verify (rows verifying different lengths) or a batch of
        unequal prompts saves: on a CPU the matmuls cost by rows.

        resume (start, x [b, q, H]): x is the output of layer start - 1 (a captured feature), and
        the pass runs layers start.. only; the skipped layers leave no K/V in the cache.

        tree: the q tokens are a token tree's nodes (`NativeTarget.forward_tree`), placed and
        masked as it says (targets/native/tree_slots.py) instead of by position.

        until_rejected (with greedy): the pass verifies proposals, ids[:, 1:] or a tree's nodes
        (parents [b, q]: each node's parent, the root's -1); a row's ids are only needed along
        its accepted path, and the head may skip the others (-1: `TorchBackend.head_until_rejected`).
        """
        backend = self.backend if self.backend is not None else self.use("exact")
        b, q = ids.shape
        chunk = backend.prompt_chunk() if tree is None and resume is None and real is None and b == 1 else 0
        if 0 < chunk < q and _consecutive(positions[0]):
            # a long pass in chunks, each through every layer before the next: the chunk's queries
            # find the earlier chunks' K/V in the cache, and every product and attention row has
            # the bits the batch-invariant kernels give it in any pass (a one-pass prompt longer
            # than attention.MAX_TOKENS would go through PyTorch's attention instead)
            parts = [self._hidden(ids[:, a : a + chunk], positions[:, a : a + chunk], cache, layer_ids, None, None,
                                  None, backend) for a in range(0, q, chunk)]
            x = torch.cat([h for h, _ in parts], dim=1)
            features = torch.cat([f for _, f in parts], dim=1) if layer_ids else None
        else:
            x, features = self._hidden(ids, positions, cache, layer_ids, real, resume, tree, backend)
        if real is not None:
            features = spread(features, real, b, q) if features is not None else None
            if last_logits_only:  # the last column of every row, padding or not
                x = spread(x, real, b, q)
        x = x[:, -1:] if last_logits_only else x
        if greedy and until_rejected and real is None and (tree is None) == (parents is None) and not last_logits_only:
            return backend.head_until_rejected(x, ids, parents), features  # ids [b, q]
        out = backend.head(x, greedy)  # [b, q|1, V] or ids [b, q|1]; [T, ..] without padding
        if real is not None and not last_logits_only:
            out = spread(out[:, None], real, b, q)[..., 0] if greedy else spread(out, real, b, q)
        return out, features

    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, cache: StaticCache, layer_ids: tuple[int, ...],
                real: torch.Tensor | None, resume: tuple[int, torch.Tensor] | None, tree: TreeSlots | None,
                backend: TorchBackend) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`'s layers: (the final norm's output [b, q, H] or [T, H], features [b, q, F] or
        [T, F] or None), the K/V written into `cache`."""
        cfg = self.cfg
        b, q = ids.shape
        start, x = resume if resume is not None else (0, None)
        if x is None:  # x: [b, q, H], or [T, H] without padding
            x = self.embed(ids if real is None else ids.reshape(-1)[real])
        elif real is not None:
            x = x.reshape(b * q, -1)[real]
        p = self._pass(positions, cache, real, x.dtype, tree)
        x, features = backend.layers(x, p, start, layer_ids)
        if tree is None:
            cache.note_written(positions)
        else:
            cache.note_tree(tree)
        x = backend.norm(x, self.norm, cfg.rms_norm_eps)
        last = cfg.num_layers - 1
        if last in layer_ids:  # HF's hidden_states[-1] is taken after the final norm
            at = layer_ids.index(last) * cfg.hidden_size
            features[..., at : at + cfg.hidden_size] = x
        return x, features

    def _pass(self, positions: torch.Tensor, cache: StaticCache, real: torch.Tensor | None,
              dtype: torch.dtype, tree: TreeSlots | None = None) -> Pass:
        """This forward's geometry (backends.Pass): K/V destinations, rope, what each query sees."""
        b, q = positions.shape
        horizon = cache.horizon if cache.fresh else int(positions.max()) + 1
        visible = visible_keys(positions, dtype)
        tree_keys = None
        if tree is not None:  # slots by node index; each node sees the context and what `tree` says
            write = tree.slots  # [b, q]
            horizon = max(horizon, tree.end)
            if visible is not None:
                visible, tree_keys = tree.visible.contiguous(), tree.keys()
        else:
            write = cache.write_index(positions)  # [b, q]
        rows = torch.arange(b, device=positions.device)[:, None]
        if real is not None:  # rope and the K/V writes of the T real tokens only
            write, rows = write.reshape(-1)[real], torch.div(real, q, rounding_mode="floor")  # [T]
            cos, sin = self.rotary.below(positions.reshape(-1)[real][None], dtype, horizon)  # [1, T, d]
            cos, sin = cos[0, :, None], sin[0, :, None]  # [T, 1, d]
        else:
            cos, sin = self.rotary.below(positions, dtype, horizon)  # [b, q, d]
            cos, sin = cos[:, :, None], sin[:, :, None]
        return Pass(b, q, positions, real, rows, write, cos, sin, horizon, visible, cache, tree=tree,
                    tree_keys=tree_keys)

    def packed_summary(self) -> str | None:
        """What `pack_weights` packed, e.g. "120 matrices in 4 bits, 1 in 8 bits", or None."""
        bits = Counter(p.bits for _, m in self.packable() if (p := m.__dict__.get("packed")) is not None)
        if not bits:
            return None
        return ", ".join(f"{n} {'matrices' if n > 1 else 'matrix'} in {b} bits" for b, n in sorted(bits.items()))


def tree_parents(ancestors: torch.Tensor, b: int) -> torch.Tensor:
    """Each node's parent [b, n] (the root's -1) from a tree pass's ancestors [n, n] or [b, n, n]
    (row i True at node i and its ancestors): the deepest of its other ancestors."""
    a = ancestors.bool()
    a = a.expand(b, *a.shape[-2:]) if a.dim() == 2 else a
    n = a.shape[-1]
    others = a & ~torch.eye(n, dtype=torch.bool, device=a.device)  # [b, n, n]
    depth = a.sum(-1)  # [b, n]: a node's ancestors and itself
    score = torch.where(others, depth[:, None, :], 0)  # [b, n, n]: each ancestor's depth
    return torch.where(others.any(-1), score.argmax(-1), -1)


def _consecutive(positions: torch.Tensor) -> bool:
    """Whether positions [q] (CPU) run p, p + 1, ..., each token after the ones before it."""
    return positions.device.type == "cpu" and bool((positions[1:] - positions[:-1] == 1).all()) \
        and int(positions[0]) >= 0


def padding_index(positions: torch.Tensor) -> torch.Tensor | None:
    """Flat indices of the non-padding tokens of positions [b, q] (CPU), or None when there is
    no padding (or the tensor lives on a GPU, where finding it would cost a host sync and the
    kernels do not price by rows alike)."""
    if positions.device.type != "cpu" or positions.numel() <= 1:
        return None
    valid = positions.reshape(-1) != EMPTY
    if bool(valid.all()):
        return None
    return valid.nonzero()[:, 0]


class NativeTarget:
    """The Target protocol (see targets/hf.py) over a NativeLlama and StaticCaches."""

    def __init__(self, net: NativeLlama, eos_token_ids: tuple[int, ...] = (), hf_config: object | None = None) -> None:
        self.net = net.eval()
        self.config = hf_config  # the Hugging Face (text) config, e.g. to shape a fresh drafter
        cfg = net.cfg
        self.info = TargetInfo(
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            num_layers=cfg.num_layers,
            max_position_embeddings=cfg.max_position_embeddings,
            model_type=cfg.model_type,
            eos_token_ids=tuple(eos_token_ids),
        )

    @property
    def device(self) -> torch.device:
        return self.net.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.net.embed.weight.dtype

    @property
    def compute(self) -> str:
        """The compute mode: "exact" or "int8" (targets/native/backends.py)."""
        return self.net.compute

    @property
    def compute_detail(self) -> str:
        """The mode and what runs it, for reports: e.g. "exact (kernels)", "int8 (vnni)"."""
        backend = self.net.backend if self.net.backend is not None else self.net.use(self.net.compute)
        return backend.describe()

    supports_trees = True  # `forward_tree`: nodes take slots by index (targets/native/tree_slots.py)

    @property
    def skips_padding(self) -> bool:
        """Whether padding tokens (EMPTY positions) cost nothing in `forward`'s matmuls, so rows
        of a batch may verify different lengths for the price of their sum (`padding_index`)."""
        return self.device.type == "cpu"

    def new_cache(self, batch: int, capacity: int = 64) -> StaticCache:
        cfg = self.net.cfg
        store = KVStore(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=self.dtype, device=self.device,
                        rows=max(1, batch), capacity=capacity)
        return StaticCache(store, 0, batch)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Raw input embeddings [b, n, H] (Llama-family targets do not scale them)."""
        return F.embedding(ids, self.net.embed.weight)

    def head(self) -> nn.Module:
        return self.net.lm_head

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: StaticCache,
        layer_ids: tuple[int, ...] = (),
        last_logits_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Same contract as HFTarget.forward; positions are absolute, EMPTY marks padding."""
        return self._run(ids, positions, cache, layer_ids, last_logits_only, greedy=False)

    @torch.inference_mode()
    def forward_tree(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        ancestors: torch.Tensor,
        cache: StaticCache,
        layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One verify pass over a token tree per row, as HFTarget.forward_tree: ids, positions
        [b, n] in node order (root first; a node's position is the root's plus its depth; EMPTY
        for padding nodes), ancestors [b, n, n] or [n, n] (`TokenTree.ancestor_mask`). The nodes
        take slots root .. root + n - 1 (targets/native/tree_slots.py); each node attends to the
        committed context and its ancestors only, with the bits its token gets in plain decoding
        where the C attention runs. Returns what `forward` does; then `cache.reject(keep)` with
        the accepted path's nodes moves their K/V to the slots of their positions and forgets the
        rest."""
        return self._run_tree(ids, positions, ancestors, cache, layer_ids, greedy=False)

    @torch.inference_mode()
    def forward_tree_greedy(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        ancestors: torch.Tensor,
        cache: StaticCache,
        layer_ids: tuple[int, ...] = (),
        until_rejected: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward_tree`, but each node's greedy id [b, n] in place of its logits (see
        `greedy_forward_tree`): on a CPU the head computes only near-maximal logits exactly.
        until_rejected: only the ids along each row's accepted path (and its last node) are
        needed (tree_verify.walk), the others may be -1 (`NativeLlama.forward`)."""
        return self._run_tree(ids, positions, ancestors, cache, layer_ids, greedy=True, until_rejected=until_rejected)

    def _run_tree(self, ids: torch.Tensor, positions: torch.Tensor, ancestors: torch.Tensor, cache: StaticCache,
                  layer_ids: tuple[int, ...], greedy: bool, until_rejected: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        check_tree_pass(ids, positions, ancestors)
        positions = positions.to(self.device)
        tree = tree_slots(positions, ancestors, cache.scratch)
        cache.reserve(max(tree.end, cache.horizon if cache.fresh else 0))
        tree = tree.with_scratch(cache.scratch)  # the store may have grown, moving its scratch slot
        parents = None
        if greedy and until_rejected:
            parents = tree.parents()
            parents = tree_parents(ancestors, ids.shape[0]) if parents is None else parents
        return self.net(ids, positions, cache, layer_ids, real=padding_index(positions), tree=tree, greedy=greedy,
                        until_rejected=parents is not None, parents=parents)

    @torch.inference_mode()
    def forward_greedy(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: StaticCache,
        layer_ids: tuple[int, ...] = (),
        last_logits_only: bool = False,
        until_rejected: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, but the greedy ids [b, q|1] in place of the logits (see targets/hf.py's
        `greedy_forward`): on a CPU an fp32 head computes only its near-maximal logits exactly.
        until_rejected: a verify pass of proposals ids[:, 1:], whose ids past a row's first
        rejected proposal are not needed (`NativeLlama.forward`)."""
        return self._run(ids, positions, cache, layer_ids, last_logits_only, greedy=True,
                         until_rejected=until_rejected)

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, cache: StaticCache, layer_ids: tuple[int, ...],
             last_logits_only: bool, greedy: bool, until_rejected: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not cache.fresh:
            cache.reserve(int(positions.max()) + 1)
        return self.net(ids, positions, cache, layer_ids, last_logits_only, real=padding_index(positions),
                        greedy=greedy, until_rejected=until_rejected)

    @torch.inference_mode()
    def final_hidden(self, ids: torch.Tensor, start: int, x: torch.Tensor) -> torch.Tensor:
        """What the LM head reads (the final norm's output) [b, q, H] for whole sequences ids
        [b, q] from position 0, given x [b, q, H], the output of layer start - 1: only layers
        start.. run (a training teacher's logits from a captured late-layer feature)."""
        cfg = self.net.cfg
        if not 0 < start <= cfg.num_layers:
            raise ValueError(f"start must be in 1..{cfg.num_layers}, got {start}")
        b, q = ids.shape
        positions = torch.arange(q, device=self.device)[None].expand(b, q)
        cache = self.new_cache(b, capacity=q)
        last = cfg.num_layers - 1
        _, feats = self.net(ids.to(self.device), positions, cache, (last,), last_logits_only=True,
                            resume=(start, x.to(self.device, self.dtype)))
        return feats


__all__ = ["EMPTY", "PACKED_HEAD_ROWS", "NativeLlama", "NativeTarget", "rms_norm", "rope_bqhd", "silu_mul"]
