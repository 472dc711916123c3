"""Data-parallel training: two gloo processes give the same losses as one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from blockspec.train.data import Example, ShardWriter

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    from conftest import make_tiny_target
    from blockspec.models.target import HFTarget
    from blockspec.train.data import read_examples
    from blockspec.train.trainer import TrainConfig, Trainer

    model = make_tiny_target("llama", seed=3, dtype=torch.float32, vocab_size=64, hidden_size=32,
                             intermediate_size=64, num_hidden_layers=4)
    target = HFTarget(model)
    examples = read_examples({data!r})
    cfg = TrainConfig(out=sys.argv[1], num_layers=1, block_size=4, mask_token_id=63, anchors=8,
                      batch_seqs=4, max_steps=3, lr=1e-2, warmup=0.0, init="random", save_dtype="float32")
    tr = Trainer(cfg, target, examples, log_fn=lambda *a: None)
    tr.train()
    if tr.dist.main:
        losses = [json.loads(l)["loss"] for l in open(sys.argv[1] + "/log.jsonl") if '"train"' in l]
        json.dump(losses, open(sys.argv[1] + "/losses.json", "w"))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_processes_match_one(tmp_path):
    g = torch.Generator().manual_seed(0)
    writer = ShardWriter(tmp_path / "data")
    exs = []
    for i in range(8):
        n_prompt, n_gen = 3 + i % 3, 10 + i
        ids = torch.randint(0, 64, (n_prompt + n_gen,), generator=g).tolist()
        exs.append(Example(f"e{i}", ids, [0] * n_prompt + [1] * n_gen))
    writer.write(exs)
    script = tmp_path / "run.py"
    tests = str(Path(__file__).parent)
    script.write_text(SCRIPT.format(tests=tests, data=str(tmp_path / "data")))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    single = subprocess.run([sys.executable, str(script), str(tmp_path / "one")], env=env,
                            capture_output=True, text=True, timeout=240)
    assert single.returncode == 0, single.stderr[-2000:]
    env["BLOCKSPEC_BACKEND"] = "gloo"
    multi = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(_free_port()), str(script), str(tmp_path / "two")],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert multi.returncode == 0, multi.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "losses.json").read_text())
    two = json.loads((tmp_path / "two" / "losses.json").read_text())
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        assert abs(a - b) < 1e-4 * max(1.0, abs(a)), (one, two)
    assert one[2] < one[0]  # and it trains
