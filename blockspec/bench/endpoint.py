"""`blockspec bench --endpoint URL`: measure any OpenAI-compatible server (ours, vLLM, SGLang)
on the standard prompt sets, in the published table layout (Task | Concurrency | tokens/s)."""

from __future__ import annotations

import json
from pathlib import Path

from blockspec.bench.http import EndpointLevel, run_endpoint_bench


def markdown_table(rows: list[tuple[str, EndpointLevel]], url: str, model: str) -> str:
    """One row per task and concurrency: throughput, per-request tokens/s, latency, tau if reported."""
    lines = [
        f"Endpoint `{url}`, model `{model}`; throughput = output tokens / wall time of the level.",
        "",
        "| Task | Concurrency | Throughput (tok/s) | Per request (tok/s) | p50 latency (s) | p90 latency (s) "
        "| TTFT (s) | tau | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for task, lv in rows:
        tau = lv.tau
        lines.append(
            f"| {task} | {lv.concurrency} | {lv.throughput_tok_s:.1f} | {lv.mean_tokens_per_s:.1f} | "
            f"{lv.latency_p50_s:.2f} | {lv.latency_p90_s:.2f} | {lv.mean_ttft_s:.2f} | "
            f"{'-' if tau is None else f'{tau:.2f}'} | {lv.errors} |"
        )
    return "\n".join(lines) + "\n"


def run_endpoint(
    url: str,
    model: str,
    datasets: dict[str, list],
    concurrency: tuple[int, ...],
    max_tokens: int,
    temperature: float,
    api_key: str | None,
    out: Path,
    top_p: float = 1.0,
) -> str:
    """Benchmarks every data set at every concurrency level; writes report.md and results.json."""
    rows: list[tuple[str, EndpointLevel]] = []
    for task, samples in datasets.items():
        prompts = [s.turns[0] for s in samples]  # first turn: an endpoint sees no model-specific state
        extra = {"top_p": top_p} if top_p != 1.0 and temperature > 0 else None
        for level in run_endpoint_bench(url, model, prompts, concurrency, max_tokens, temperature, api_key,
                                        extra_body=extra):
            rows.append((task, level))
    table = markdown_table(rows, url, model)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text("# Endpoint benchmark\n\n" + table)
    data = [{"task": t, **lv.as_dict()} for t, lv in rows]
    (out / "results.json").write_text(json.dumps({"url": url, "model": model, "levels": data}, indent=2))
    return table
