"""Reading a generation request: its body within the size limit, its prompts as token ids, and
its sampling parameters within the model's context (each failure a 400 that names the field)."""

from __future__ import annotations

from fastapi import Request
from jinja2 import TemplateError

from blockspec.config import SamplingParams
from blockspec.errors import BlockspecError
from blockspec.server import errors
from blockspec.server.completions_prompt import check_ids
from blockspec.server.schemas import GenerationRequest, parse_json
from blockspec.server.state import ServerState
from blockspec.server.tools import render_prompt
from blockspec.text import encode_prompt

INLINE_BYTES = 64 * 1024  # smaller bodies are parsed on the loop (a thread hop costs more)


async def read_json(state: ServerState, request: Request) -> dict:
    limit = state.max_request_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise errors.too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise errors.too_large(limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if len(raw) <= INLINE_BYTES:
        return parse_json(raw)
    return await state.offload(parse_json, raw)


def prompt_ids(state: ServerState, req: GenerationRequest) -> list[list[int]]:
    """Template rendering and tokenising (on the prep pool): the token ids of each prompt (one for
    chat); a 400 for what cannot be a prompt."""
    if req.kind == "completion":
        check_ids(req.prompts, state.vocab_size)
        return [text_ids(state, p, "prompt" if len(req.prompts) == 1 else f"prompt[{i}]") if isinstance(p, str)
                else list(p) for i, p in enumerate(req.prompts)]
    refuse_hopeless(state, sum(len((m.get("content") or "").encode("utf-8")) for m in req.messages), "messages")
    try:
        if req.tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in req.messages):
            return [render_prompt(state.tokenizer, req.messages, req.tools, state.tool_family,
                                  req.chat_template_kwargs)]
        return [encode_prompt(state.tokenizer, req.messages, chat=True,
                              chat_template_kwargs=req.chat_template_kwargs or None)]
    except BlockspecError as e:
        raise errors.bad_request(str(e), "messages") from None
    except TemplateError as e:  # a chat template may reject messages (e.g. roles must alternate)
        raise errors.bad_request(f"the chat template rejected the messages: {e}", "messages") from None


def text_ids(state: ServerState, text: str, param: str) -> list[int]:
    refuse_hopeless(state, len(text.encode("utf-8")), param)
    try:
        return encode_prompt(state.tokenizer, text, chat=False)
    except BlockspecError as e:
        raise errors.bad_request(str(e), param) from None


def refuse_hopeless(state: ServerState, size: int, param: str) -> None:
    """A prompt whose text alone (`size` UTF-8 bytes) needs more tokens than the context holds
    (see longest_token_bytes)."""
    if state.max_token_bytes is None:
        return
    at_least = size // state.max_token_bytes
    if at_least >= state.context_length:
        raise errors.bad_request(
            f"the prompt has at least {at_least} tokens but the model's context is {state.context_length} "
            "tokens; shorten the prompt", param, "context_length_exceeded")


def sampling_params(state: ServerState, req: GenerationRequest, prompt_len: int, seed: int | None) -> SamplingParams:
    room = state.context_length - prompt_len
    prompt_param = "messages" if req.kind == "chat" else "prompt"
    if room < 1 and req.max_tokens != 0:
        raise errors.bad_request(
            f"the prompt has {prompt_len} tokens but the model's context is {state.context_length} tokens "
            "(one more is needed for the answer); shorten the prompt", prompt_param, "context_length_exceeded")
    max_tokens = room if req.max_tokens is None else req.max_tokens
    if max_tokens > room:
        raise errors.bad_request(
            f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the model's context of "
            f"{state.context_length} tokens; lower max_tokens to at most {room} or shorten the prompt",
            "max_tokens", "context_length_exceeded")
    # echo: the prompt's scores with logprobs; max_tokens 0 asks for nothing else (scoring alone)
    scored = req.echo and (req.logprobs or max_tokens == 0)
    try:
        return SamplingParams(max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                              top_k=req.top_k, seed=seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
                              ignore_eos=req.ignore_eos, logprobs=req.top_logprobs if req.logprobs else None,
                              prompt_logprobs=req.top_logprobs if scored else None, logit_bias=req.logit_bias)
    except BlockspecError as e:
        raise errors.from_blockspec(e) from None


def check_bias(state: ServerState, req: GenerationRequest) -> None:
    outside = [t for t, _ in req.logit_bias if t >= state.vocab_size]
    if outside:
        raise errors.bad_request(f"logit_bias token id {outside[0]} is outside the vocabulary [0, {state.vocab_size})",
                                 "logit_bias", "invalid_value")


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request sampled with `seed`: choice 0 uses the seed itself
    (so n=1 and the first of n>1 agree), the others a splitmix64 scramble of (seed, index)."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) >> 1  # 63 bits
