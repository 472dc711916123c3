"""The one-script CUDA check (bench/cudacheck.py) runs every part at tiny shapes on a CPU; its
device checks, its lossless assertion and its report are tested without a GPU."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from blockspec.bench import cudacheck
from blockspec.errors import ConfigError


def test_every_part_runs_at_tiny_shapes_on_a_cpu(tmp_path: Path, capsys) -> None:
    out = tmp_path / "check" / "cudacheck.json"
    assert cudacheck.main(["--device", "cpu", "--tiny", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["machine"]["device"] == "cpu"
    parts = report["parts"]
    assert list(parts) == ["step_cost", "hybrid_step", "greedy"] and all(p["ok"] for p in parts.values())
    assert [(r["batch"], r["block"], r["draft_dtype"]) for r in parts["step_cost"]["rows"]] == [(1, 4, "bfloat16")]
    assert "--dtype bfloat16" in parts["step_cost"]["command"]
    assert [r["layers"] for r in parts["hybrid_step"]["rows"]] == ["3 Gated DeltaNet : 1 attention", "attention only"]
    for dtype in ("float32", "bfloat16"):
        run = parts["greedy"][dtype]
        assert run["dtype"] == dtype and run["tokens"] == 2 * 12 and run["rows"] == 2
    assert parts["greedy"]["float32"]["identical"] and parts["greedy"]["float32"]["agreement"] == 1.0
    assert parts["greedy"]["float32"]["tree_identical"] and parts["greedy"]["float32"]["tree_steps"] > 0
    printed = capsys.readouterr().out
    assert "[greedy] ok" in printed and "float32: identical True" in printed and "all parts ok" in printed
    assert "| layers | batch |" in printed and "| batch | block |" in printed


def test_a_speculative_difference_in_float32_fails_the_check(tmp_path: Path, monkeypatch, capsys) -> None:
    """The assertion itself: a float32 run that differs fails its part and the exit status; the
    bfloat16 difference is only reported."""
    def differing(plan, device, dtype):
        return {"dtype": dtype, "identical": False, "first_difference": [3, None], "agreement": 0.5, "tokens": 8,
                "mean_tau": 1.0, "tree_nodes": 3, "tree_identical": True, "tree_first_difference": [None, None],
                "tree_agreement": 1.0, "tree_steps": 4}

    monkeypatch.setattr(cudacheck, "decode_once", differing)
    out = tmp_path / "c.json"
    assert cudacheck.main(["--device", "cpu", "--tiny", "--parts", "greedy", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert not report["ok"] and list(report["parts"]) == ["greedy"]
    assert "float32 speculative output differs from plain decoding" in report["parts"]["greedy"]["error"]
    assert "[greedy] FAILED" in capsys.readouterr().out

    def bf16_differs(plan, device, dtype):
        return {**differing(plan, device, dtype), "identical": dtype == "float32"}

    monkeypatch.setattr(cudacheck, "decode_once", bf16_differs)
    entry = cudacheck.greedy(cudacheck.TINY, "cpu")  # bfloat16 may differ: reported, not required
    assert entry["float32"]["identical"] and not entry["bfloat16"]["identical"]

    def tree_differs(plan, device, dtype):
        return {**differing(plan, device, dtype), "identical": True, "tree_identical": False,
                "tree_first_difference": [None, 5]}

    monkeypatch.setattr(cudacheck, "decode_once", tree_differs)
    with pytest.raises(AssertionError, match="token-tree output differs"):
        cudacheck.greedy(cudacheck.TINY, "cpu")


def test_float32_means_float32_on_cuda(monkeypatch) -> None:
    """The greedy part turns TF32 products off for its float32 run, and back as they were after."""
    seen = {}
    monkeypatch.setattr(cudacheck, "decode_once", lambda plan, device, dtype: seen.setdefault(
        dtype, {"tf32": torch.backends.cuda.matmul.allow_tf32, "identical": True, "tree_identical": True}))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        cudacheck.greedy(cudacheck.TINY, "cuda:0")
        assert seen["float32"]["tf32"] is False and seen["bfloat16"]["tf32"] is True
        assert torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_device_strings(monkeypatch, capsys) -> None:
    assert cudacheck.check_device("cpu") == "cpu"
    for bad in ("gpu", "CUDA", "cuda:x", "mps", ""):
        with pytest.raises(ConfigError, match="--device must be cpu, cuda or cuda:N"):
            cudacheck.check_device(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA device.*--device cpu --tiny"):
        cudacheck.check_device("cuda")
    assert cudacheck.main(["--device", "cuda", "--out", "unused.json"]) == 2
    assert capsys.readouterr().err.startswith("error: --device cuda: this machine has no CUDA device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cudacheck.check_device("cuda") == "cuda" and cudacheck.check_device("cuda:0") == "cuda:0"
    with pytest.raises(ConfigError, match="there are 1 CUDA device"):
        cudacheck.check_device("cuda:1")
    assert cudacheck.main(["--device", "cpu", "--parts", "greedy,warp"]) == 2
    assert "--parts takes names from step_cost, hybrid_step, greedy" in capsys.readouterr().err


def test_machine_names_the_gpu(monkeypatch) -> None:
    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    info = cudacheck.machine("cuda:0")
    assert info["gpu"] == "NVIDIA H100 80GB HBM3" and info["gpu_memory_gib"] == 80.0 and "cuda" in info


def test_plans_name_known_shapes() -> None:
    from blockspec.bench.stepcost import SHAPES

    assert cudacheck.FULL.step_shape == cudacheck.FULL.decode_shape == "qwen3-8b" and "qwen3-8b" in SHAPES
    assert cudacheck.FULL.hybrid_shape == "qwen3.5" and cudacheck.FULL.decode_block == 16
    with pytest.raises(ConfigError, match="unknown shape"):
        cudacheck.Plan(step_shape="gpt-9")
    with pytest.raises(ConfigError, match="hybrid shape"):
        cudacheck.Plan(hybrid_shape="qwen9")
