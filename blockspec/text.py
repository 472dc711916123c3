"""Text <-> token ids around the engine: chat templates, stop strings, incremental detokenising."""

from __future__ import annotations

from collections.abc import Callable, Sequence

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

    def __init__(self, tokenizer: object, stops: Sequence[str], keep_special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.keep_special = keep_special  # special tokens' text too (a format whose markers are special)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=not self.keep_special)

    def find(self, text: str, start: int = 0) -> int | None:
        """Index in text where the earliest stop string starts (at or after `start`), or None."""
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def tokens_to_keep(self, ids: Sequence[int]) -> int | None:
        """The shortest prefix of ids whose text holds a stop string (None: no stop string). Once a
        prefix holds one every longer prefix does, so the prefix is found by bisection."""
        if not self.stops or self.find(self.decode(ids)) is None:
            return None
        lo, hi = 1, len(ids)  # the answer lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if self.find(self.decode(ids[:mid])) is None:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def watch(self) -> Callable[[list[int]], int | None]:
        """A `tokens_to_keep` for one growing sequence of ids (the engine's stop check): it decodes
        only the tokens added since its last call, so a long answer costs linear time, not quadratic."""
        text = IncrementalDetokenizer(StopStrings(self.tokenizer, ()))
        longest = max((len(s) for s in self.stops), default=0)

        def check(ids: list[int]) -> int | None:
            if not self.stops:
                return None
            seen = len(text.ids)
            if len(ids) < seen or (seen and ids[seen - 1] != text.ids[-1]):
                return self.tokens_to_keep(ids)  # not the sequence it followed: the exact way
            before = len(text.text)
            text.push(ids[len(text.ids):])
            if self.find(text.text, max(0, before - longest + 1)) is None:
                return None
            return self.tokens_to_keep(ids)

        return check

    def visible_text(self, ids: Sequence[int]) -> str:
        """Decoded text with anything from the first stop string on removed."""
        text = self.decode(ids)
        cut = self.find(text)
        return text if cut is None else text[:cut]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back what may still change:
    an incomplete UTF-8 sequence, or a tail that could be the start of a stop string.

    Each push decodes only a window of recent tokens (the text of the tokens before it is fixed
    once its characters are complete), so a stream costs time linear in its length. The deltas
    add up to `stops.visible_text(ids)`.
    """

    def __init__(self, stops: StopStrings) -> None:
        self.stops = stops
        self.ids: list[int] = []
        self.text = ""  # the decoded text of ids[:read]
        self.prefix = 0  # ids[prefix:read] are decoded again with the new ones, as their context
        self.read = 0
        self.sent = 0
        self.cut: int | None = None  # where the first stop string starts in text
        self.checked = 0  # text searched for stop strings so far

    def _advance(self, final: bool) -> None:
        if self.read == len(self.ids):
            return
        decode = self.stops.decode
        before = decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        after = decode(self.ids[self.prefix:])
        if not final and (after.endswith("\ufffd") or len(after) <= len(before)):
            return  # the last character is incomplete (or nothing printable yet): wait for more
        self.text += after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)

    def _find_stop(self) -> None:
        if self.cut is not None or not self.stops.stops:
            return
        longest = max(len(s) for s in self.stops.stops)
        self.cut = self.stops.find(self.text, max(0, self.checked - longest + 1))
        self.checked = len(self.text)

    def push(self, new_ids: Sequence[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        self._advance(final)
        self._find_stop()
        text = self.text if self.cut is None else self.text[: self.cut]
        end = len(text)
        if not final and self.cut is None:
            hold = max((len(s) - 1 for s in self.stops.stops), default=0)
            for k in range(min(hold, end), 0, -1):
                if any(s.startswith(text[end - k:]) for s in self.stops.stops):
                    end -= k
                    break
        if end <= self.sent:
            return ""
        delta = text[self.sent:end]
        self.sent = end
        return delta
