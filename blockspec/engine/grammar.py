"""Output formats (JSON schema, JSON object, regex, choice, grammar, sequence) compiled with
xgrammar into per-request matchers that a DecodeBatch row masks its tokens with
(dflash/constraint.py).

    grammars = Grammars(tokenizer, target.info.vocab_size, target.info.eos_token_ids)
    handle = engine.submit(ids, params, constraint=grammars.matcher(OutputFormat("json_schema", schema)))

xgrammar (the `server` extra) is imported on first use; docs/SERVING.md says why it was chosen
over llguidance. JSON is generated without free whitespace (`", "` and `": "` separators): a
small model given free whitespace can fill its whole budget with newlines.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from blockspec.errors import ConfigError

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "sequence")
PIECES = ("text", "json", "regex")  # what a sequence is made of
CACHE_SIZE = 64  # compiled grammars kept per tokenizer (a client reuses its few schemas)


@dataclass(frozen=True)
class OutputFormat:
    """What a request's output must match. value: the schema (a dict) for json_schema, the
    pattern for regex, the alternatives (a tuple of strings) for choice, the EBNF (GBNF) or Lark
    text for grammar, None for json_object (any JSON object). A sequence (a forced tool call in a
    format that is not JSON) is a tuple of alternatives, each a tuple of pieces: ("text", literal),
    ("json", schema: a JSON value matching it) or ("regex", pattern)."""

    kind: str
    value: object = None
    # json_schema only: literal text around the JSON value (a forced tool call's markers)
    prefix: str = ""
    suffix: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"output format kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        ok = {"json_object": self.value is None, "json_schema": isinstance(self.value, dict),
              "regex": isinstance(self.value, str) and bool(self.value),
              "choice": isinstance(self.value, tuple) and bool(self.value)
              and all(isinstance(c, str) and c for c in self.value),
              "grammar": isinstance(self.value, str) and bool(self.value.strip()),
              "sequence": _is_sequence(self.value)}[self.kind]
        if not ok:
            raise ConfigError(f"a {self.kind} output format needs "
                              + {"json_object": "no value", "json_schema": "a JSON schema object",
                                 "regex": "a non-empty pattern", "choice": "non-empty strings to choose from",
                                 "grammar": "a non-empty grammar",
                                 "sequence": "alternatives of (text|json|regex, value) pieces"}[self.kind])
        if (self.prefix or self.suffix) and self.kind != "json_schema":
            raise ConfigError("only a json_schema output format takes a prefix or suffix")

    def key(self) -> str:
        return json.dumps([self.kind, self.value, self.prefix, self.suffix], sort_keys=True, ensure_ascii=False)


def _is_sequence(value: object) -> bool:
    def piece(p: object) -> bool:
        return (isinstance(p, tuple) and len(p) == 2 and p[0] in PIECES
                and (isinstance(p[1], dict) if p[0] == "json" else isinstance(p[1], str) and bool(p[1])))
    return (isinstance(value, tuple) and bool(value)
            and all(isinstance(alt, tuple) and alt and all(piece(p) for p in alt) for alt in value))


class XGrammarConstraint:
    """A TokenConstraint (dflash/constraint.py) over an xgrammar GrammarMatcher."""

    def __init__(self, matcher: object) -> None:
        self._m = matcher

    def fill_mask(self, out: torch.Tensor) -> None:
        self._m.fill_next_token_bitmask(out.view(1, -1))

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(int(token)))

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ConfigError("structured outputs need xgrammar: pip install 'blockspec[server]' && "
                          "pip install --no-deps xgrammar (--no-deps skips triton, which a CPU never uses)") from None
    return xgrammar


class Grammars:
    """Compiles OutputFormats for one tokenizer and vocabulary (the target's: rows of its LM head
    past the tokenizer's vocabulary are never allowed) and makes matchers; thread-safe, with the
    last CACHE_SIZE compiled grammars kept. The tokenizer's tables are built at the first use."""

    def __init__(self, tokenizer: object, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, object] = OrderedDict()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                if not self.stop_token_ids:
                    raise ConfigError("structured outputs need the target's end-of-sequence token ids "
                                      "(generation_config.json eos_token_id): a constrained answer ends with one")
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=list(self.stop_token_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, fmt: OutputFormat) -> object:
        """The compiled grammar of fmt (cached); ConfigError for a schema, pattern or grammar
        xgrammar cannot compile, with its reason."""
        key = fmt.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiler = self._get_compiler()
        try:
            compiled = _compile(compiler, fmt)
        except ConfigError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with the parser's reason
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"the {fmt.kind.replace('_', ' ')} cannot be compiled: {reason[:300]}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, fmt: OutputFormat) -> XGrammarConstraint:
        """A fresh matcher for one request (compiles fmt if needed)."""
        xgr = _xgrammar()
        return XGrammarConstraint(xgr.GrammarMatcher(self.compile(fmt)))


# xgrammar writes the characters of a string with a length bound (maxLength, minLength) as any
# character but a quote, a backslash or a line break: control characters too, which JSON forbids
# unescaped (json.loads refuses them). They are excluded here, as its unbounded strings do.
_BOUNDED_CHAR = r'[^\"\\\r\n]'
_JSON_CHAR = r'[^\0-\x1f\"\\]'


def _json_grammar(xgr: object, schema: dict) -> object:
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True))
    return xgr.Grammar.from_ebnf(ebnf.replace(_BOUNDED_CHAR, _JSON_CHAR))


def _compile(compiler: object, fmt: OutputFormat) -> object:
    xgr = _xgrammar()
    if fmt.kind in ("json_object", "json_schema"):
        parts = [_json_grammar(xgr, fmt.value if fmt.kind == "json_schema" else {"type": "object"})]
        if fmt.prefix:
            parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {json.dumps(fmt.prefix)}"))
        if fmt.suffix:
            parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(fmt.suffix)}"))
        return compiler.compile_grammar(parts[0] if len(parts) == 1 else xgr.Grammar.concat(*parts))
    if fmt.kind == "sequence":
        alternatives = []
        for alt in fmt.value:
            parts = [_piece(xgr, kind, value) for kind, value in alt]
            alternatives.append(parts[0] if len(parts) == 1 else xgr.Grammar.concat(*parts))
        return compiler.compile_grammar(alternatives[0] if len(alternatives) == 1
                                        else xgr.Grammar.union(*alternatives))
    if fmt.kind == "regex":
        return compiler.compile_regex(fmt.value)
    if fmt.kind == "choice":
        literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in fmt.value)
        return compiler.compile_grammar(f"root ::= {literals}")
    try:  # EBNF (GBNF, as vLLM's guided_grammar takes it for xgrammar), else Lark
        return compiler.compile_grammar(fmt.value)
    except Exception:
        return compiler.compile_lark(fmt.value)


def _piece(xgr: object, kind: str, value: object) -> object:
    if kind == "text":
        return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(value)}")
    if kind == "regex":
        return xgr.Grammar.from_regex(value)
    return _json_grammar(xgr, value)
