"""Benchmark any OpenAI-compatible endpoint (ours or another server) at several concurrencies.

    levels = run_endpoint_bench("http://127.0.0.1:30000", "smollm2-135m-instruct", prompts,
                                concurrency_levels=[1, 4, 16], max_tokens=128, temperature=0.0,
                                api_key=None)
    for level in levels:
        print(level.concurrency, level.throughput_tok_s, level.latency_p50_s)

Every request streams (stream_options.include_usage) so time to first token is measured and the
token count comes from the server's own usage (plus DFlash tau when the server reports it).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import httpx

from blockspec.errors import ConfigError

Prompt = str | list[dict]  # a user message, or a whole conversation


@dataclass
class EndpointRequest:
    """One measured request."""

    index: int
    ok: bool
    latency_s: float
    ttft_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    tokens_per_s: float = 0.0
    finish_reason: str | None = None
    tau: float | None = None
    steps: int | None = None
    text: str = ""
    error: str | None = None


@dataclass
class EndpointLevel:
    """All requests run at one concurrency, with aggregates over the successful ones."""

    concurrency: int
    wall_s: float
    requests: list[EndpointRequest] = field(default_factory=list)

    @property
    def ok(self) -> list[EndpointRequest]:
        return [r for r in self.requests if r.ok]

    @property
    def errors(self) -> int:
        return len(self.requests) - len(self.ok)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.ok)

    @property
    def throughput_tok_s(self) -> float:
        """Output tokens per second of wall time over the whole level (all clients together)."""
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_tokens_per_s(self) -> float:
        """Mean per-request decoding speed (what one user sees)."""
        return statistics.fmean(r.tokens_per_s for r in self.ok) if self.ok else 0.0

    def latency_quantile(self, q: float) -> float:
        values = sorted(r.latency_s for r in self.ok)
        if not values:
            return 0.0
        return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]

    @property
    def latency_p50_s(self) -> float:
        return self.latency_quantile(0.5)

    @property
    def latency_p90_s(self) -> float:
        return self.latency_quantile(0.9)

    @property
    def mean_ttft_s(self) -> float:
        values = [r.ttft_s for r in self.ok if r.ttft_s is not None]
        return statistics.fmean(values) if values else 0.0

    @property
    def tau(self) -> float | None:
        """Tokens per decode step over all requests whose server reports DFlash statistics."""
        rows = [r for r in self.ok if r.steps and r.tau is not None]
        if not rows:
            return None
        return sum(r.tau * r.steps for r in rows) / sum(r.steps for r in rows)

    def summary(self) -> dict:
        return {
            "concurrency": self.concurrency,
            "requests": len(self.requests),
            "errors": self.errors,
            "wall_s": round(self.wall_s, 4),
            "output_tokens": self.output_tokens,
            "throughput_tok_s": round(self.throughput_tok_s, 3),
            "mean_tokens_per_s": round(self.mean_tokens_per_s, 3),
            "latency_p50_s": round(self.latency_p50_s, 4),
            "latency_p90_s": round(self.latency_p90_s, 4),
            "mean_ttft_s": round(self.mean_ttft_s, 4),
            "tau": None if self.tau is None else round(self.tau, 4),
        }

    def as_dict(self) -> dict:
        return {**self.summary(), "per_request": [asdict(r) for r in self.requests]}


def base_url(url: str) -> str:
    """http://host:port[/v1][/] -> http://host:port/v1"""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"endpoint URL must start with http:// or https://, got {url!r}")
    return url if url.endswith("/v1") else url + "/v1"


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _preflight(client: httpx.Client, root: str, model: str) -> None:
    """Fails early, with the fix, when the server is unreachable or does not serve `model`."""
    try:
        response = client.get(f"{root}/models")
    except httpx.HTTPError as e:
        raise ConfigError(f"cannot reach {root}: {e}; is the server running (blockspec serve)?") from None
    if response.status_code == 401:
        raise ConfigError(f"{root} wants an API key; pass the one the server was started with")
    if response.status_code != 200:
        raise ConfigError(f"GET {root}/models answered {response.status_code}: {response.text[:200]}")
    served = [m.get("id") for m in response.json().get("data", [])]
    if model not in served:
        raise ConfigError(f"{root} does not serve model {model!r}; it serves {served}")


def _one(client: httpx.Client, root: str, index: int, body: dict) -> EndpointRequest:
    start = time.perf_counter()
    ttft = None
    pieces: list[str] = []
    usage: dict = {}
    finish = None
    try:
        with client.stream("POST", f"{root}/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                return EndpointRequest(index, False, time.perf_counter() - start,
                                       error=f"HTTP {response.status_code}: {response.text[:300]}")
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return EndpointRequest(index, False, time.perf_counter() - start,
                                           error=str(chunk["error"].get("message")))
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if ttft is None:
                            ttft = time.perf_counter() - start
                        pieces.append(content)
                    finish = choice.get("finish_reason") or finish
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return EndpointRequest(index, False, time.perf_counter() - start, error=f"{type(e).__name__}: {e}")
    latency = time.perf_counter() - start
    tokens = int(usage.get("completion_tokens", 0))
    dflash = usage.get("dflash") or {}
    return EndpointRequest(
        index, True, latency, ttft, int(usage.get("prompt_tokens", 0)), tokens,
        tokens / latency if latency > 0 else 0.0, finish,
        dflash.get("tau"), dflash.get("steps"), "".join(pieces),
    )


def run_endpoint_bench(
    url: str,
    model: str,
    prompts: Sequence[Prompt],
    concurrency_levels: Sequence[int] = (1,),
    max_tokens: int = 128,
    temperature: float = 0.0,
    api_key: str | None = None,
    *,
    timeout_s: float = 600.0,
    warmup: int = 1,
    extra_body: dict | None = None,
) -> list[EndpointLevel]:
    """Sends every prompt once per concurrency level (that many clients at a time) to the chat
    completions endpoint; returns one EndpointLevel per level with per-request latency, time to
    first token, output tokens and tokens/s. `warmup` requests run first and are not counted."""
    if not prompts:
        raise ConfigError("no prompts to benchmark")
    levels = [int(c) for c in concurrency_levels]
    if not levels or any(c < 1 for c in levels):
        raise ConfigError(f"concurrency levels must be integers >= 1, got {list(concurrency_levels)}")
    if max_tokens < 1:
        raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
    root = base_url(url)

    def body(p: Prompt) -> dict:
        messages = [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
        return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                "stream": True, "stream_options": {"include_usage": True}, **(extra_body or {})}

    results = []
    limits = httpx.Limits(max_connections=max(levels) + 1, max_keepalive_connections=max(levels) + 1)
    with httpx.Client(headers=_headers(api_key), timeout=timeout_s, limits=limits) as client:
        _preflight(client, root, model)
        for i in range(warmup):
            _one(client, root, -1, body(prompts[i % len(prompts)]))
        for c in levels:
            start = time.perf_counter()
            with ThreadPoolExecutor(max_workers=c) as pool:
                done = list(pool.map(lambda ip: _one(client, root, ip[0], body(ip[1])), enumerate(prompts)))
            results.append(EndpointLevel(c, time.perf_counter() - start, done))
    return results


__all__ = ["EndpointLevel", "EndpointRequest", "base_url", "run_endpoint_bench"]
