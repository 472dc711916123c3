"""The GPU step-cost benchmark (DFlash step / plain step on a model shape) runs end to end."""

from __future__ import annotations

import json

import pytest

from blockspec.bench import stepcost
from blockspec.errors import ConfigError


def test_stepcost_runs_on_a_tiny_shape(capsys) -> None:
    assert stepcost.main(["--shape", "tiny", "--draft-layers", "1", "--batch", "1,2", "--block", "4,16",
                          "--context", "16", "--steps", "2", "--device", "cpu", "--small-rows", "1",
                          "--cpu-matmul", "mkl"]) == 0
    out = capsys.readouterr().out
    assert "| batch | block | drafter dtype | plain step (ms) | DFlash step (ms) | DFlash / plain |" in out
    rows = json.loads(out.strip().splitlines()[-1])["rows"]
    assert [(r["batch"], r["block"]) for r in rows] == [(1, 4), (1, 16), (2, 4), (2, 16)]
    from blockspec.cpu import linear

    assert json.loads(out.strip().splitlines()[-1])["cpu_matmul"] == "mkl"
    assert linear.SMALL_ROWS == 64  # --small-rows and --cpu-matmul apply to that run only
    assert linear.CPU_MATMUL == ("native" if linear.onednn_available() else "small-rows")
    with pytest.raises(ConfigError, match="--block"):
        stepcost.main(["--shape", "tiny", "--block", "1"])
    assert all(r["plain_ms"] > 0 and r["dflash_ms"] > 0 and r["ratio"] == pytest.approx(
        r["dflash_ms"] / r["plain_ms"], rel=1e-2) for r in rows)


def test_stepcost_compares_drafter_dtypes_side_by_side(capsys) -> None:
    assert stepcost.main(["--shape", "tiny", "--draft-layers", "1", "--batch", "1", "--block", "4",
                          "--context", "16", "--steps", "2", "--device", "cpu",
                          "--draft-dtype", "float32,bfloat16", "--draft-vocab", "50"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert [(r["block"], r["draft_dtype"]) for r in result["rows"]] == [(4, "float32"), (4, "bfloat16")]
    assert result["draft_vocab"] == 50 and "draft vocabulary 50" in out
    with pytest.raises(ConfigError, match="drafter_dtype must be 'auto' or one of"):
        stepcost.main(["--shape", "tiny", "--block", "4", "--draft-dtype", "int4"])
    with pytest.raises(ConfigError, match="--draft-vocab must be in"):
        stepcost.main(["--shape", "tiny", "--block", "4", "--draft-vocab", "100000"])


def test_random_target_has_the_named_shape() -> None:
    from transformers import AutoConfig

    from blockspec.targets.native.config import native_config

    spec = dict(stepcost.SHAPES["qwen3-8b"])
    cfg = native_config(AutoConfig.for_model(spec.pop("model_type"), **spec))
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size) == (4096, 36, 151936)
    target = stepcost.random_target("tiny", device="cpu", dtype=__import__("torch").float32)
    assert target.info.num_layers == 4 and target.info.vocab_size == 256
    with pytest.raises(ConfigError, match="unknown shape"):
        stepcost.random_target("gpt-9", device="cpu", dtype=None)


def test_stepcost_rounds_alternate_the_sides_and_keep_each_sides_fastest(capsys, monkeypatch) -> None:
    calls: list[int] = []
    # plain, DFlash, plain, DFlash: round 1 slow on the DFlash side, round 2 slow on the plain side
    seconds = iter([0.010, 0.040, 0.030, 0.015])

    def fake(target, drafter, block, batch, context, steps, device, seed=0):
        calls.append(block)
        return next(seconds)

    monkeypatch.setattr(stepcost, "step_seconds", fake)
    assert stepcost.main(["--shape", "tiny", "--draft-layers", "1", "--batch", "1", "--block", "4",
                          "--context", "16", "--steps", "2", "--device", "cpu", "--rounds", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert calls == [1, 4, 1, 4] and result["rounds"] == 2
    assert [(r["plain_ms"], r["dflash_ms"], r["ratio"]) for r in result["rows"]] == [(10.0, 15.0, 1.5)]
    with pytest.raises(ConfigError, match="--rounds"):
        stepcost.main(["--shape", "tiny", "--rounds", "0"])
