"""The hybrid-target step benchmark (bench/hybrid_step.py) runs end to end at tiny shapes."""

from __future__ import annotations

import json

import pytest

from blockspec.bench import hybrid_step
from blockspec.errors import ConfigError


def test_hybrid_step_runs_at_tiny_shapes(capsys) -> None:
    assert hybrid_step.main(["--hidden", "160", "--layers", "4", "--vocab", "64", "--block", "4", "--context", "8",
                             "--batch", "1,2", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "| layers | batch | plain step (ms) | verify 4 + rollback (ms) | verify / plain |" in out
    rows = json.loads(out.strip().splitlines()[-1])["rows"]
    assert [(r["layers"], r["batch"]) for r in rows] == [
        ("3 Gated DeltaNet : 1 attention", 1), ("3 Gated DeltaNet : 1 attention", 2),
        ("attention only", 1), ("attention only", 2)]
    assert all(r["plain_ms"] > 0 and r["verify_ms"] > 0 for r in rows)


def test_the_hybrid_model_has_the_named_layers() -> None:
    import torch

    target = hybrid_step.qwen35_like(160, 8, 64, True, torch.bfloat16)
    assert target.model.config.model_type == "qwen3_5_text" and target.dtype == torch.bfloat16
    assert target.model.config.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    with pytest.raises(ConfigError, match="multiple of 4"):
        hybrid_step.run(160, 6, 64, 4, 8, [1], 1, torch.float32)


def test_the_published_qwen35_shape_is_transformers_own() -> None:
    import torch

    target = hybrid_step.qwen35_like(0, 4, 0, True, torch.bfloat16, "meta", "qwen3.5")  # no memory
    cfg = target.model.config
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.linear_num_value_heads) == (4096, 248320, 16, 32)
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    with pytest.raises(ConfigError, match="shape must be one of"):
        hybrid_step.qwen35_like(160, 4, 64, True, torch.float32, shape="qwen9")
