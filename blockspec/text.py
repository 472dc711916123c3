"""Text <-> token ids around the engine: chat templates, stop strings, incremental detokenising."""

from __future__ import annotations

from collections.abc import Sequence

from blockspec.errors import ConfigError

Messages = list[dict]


def encode_prompt(
    tokenizer: object,
    prompt: str | Messages,
    *,
    chat: bool | None = None,
    enable_thinking: bool | None = None,
    chat_template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids of a prompt: messages always go through the chat template; a string does when
    `chat` is True (None: raw text)."""
    if isinstance(prompt, str) and not chat:
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    _check_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "this model's tokenizer has no chat template (a base model?); pass a plain string "
            "prompt without chat, e.g. `--raw` on the command line"
        )
    kwargs = dict(chat_template_kwargs or {})
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _check_messages(messages: Sequence[object]) -> None:
    if not messages:
        raise ConfigError("messages is empty; give at least one {'role': 'user', 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ConfigError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        if m["role"] not in ("system", "user", "assistant", "tool", "developer"):
            raise ConfigError(f"messages[{i}].role {m['role']!r} is not one of system/user/assistant/tool")


def supports_thinking(tokenizer: object) -> bool:
    """Whether the chat template reacts to `enable_thinking` (Qwen3-style)."""
    return "enable_thinking" in str(getattr(tokenizer, "chat_template", "") or "")


class StopStrings:
    """Finds stop strings in generated text; returns how many tokens to keep."""

    def __init__(self, tokenizer: object, stops: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def find(self, text: str) -> int | None:
        """Index in text where the earliest stop string starts, or None."""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def tokens_to_keep(self, ids: Sequence[int]) -> int | None:
        if not self.stops:
            return None
        if self.find(self.decode(ids)) is None:
            return None
        lo = 1  # smallest prefix whose text already contains a stop string
        while lo < len(ids) and self.find(self.decode(ids[:lo])) is None:
            lo += 1
        return lo

    def visible_text(self, ids: Sequence[int]) -> str:
        """Decoded text with anything from the first stop string on removed."""
        text = self.decode(ids)
        cut = self.find(text)
        return text if cut is None else text[:cut]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back what may still change:
    an incomplete UTF-8 sequence, or a tail that could be the start of a stop string."""

    def __init__(self, stops: StopStrings) -> None:
        self.stops = stops
        self.ids: list[int] = []
        self.sent = 0

    def push(self, new_ids: Sequence[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        text = self.stops.visible_text(self.ids)
        if not final:
            if text.endswith("\ufffd"):
                text = text.rstrip("\ufffd")
            hold = max((len(s) - 1 for s in self.stops.stops), default=0)
            for k in range(min(hold, len(text)), 0, -1):
                if any(s.startswith(text[-k:]) for s in self.stops.stops):
                    text = text[:-k]
                    break
        if len(text) <= self.sent:
            return ""
        delta = text[self.sent :]
        self.sent = len(text)
        return delta
