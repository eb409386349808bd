"""glm-serve's settings (`ServeConfig`), the loaded model (`Loaded`) and the app's shared `State`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from glmkit.errors import GlmkitError
from glmkit.generate.constraint import (
    GrammarError,
    GrammarTokenizer,
    ThinkingBudget,
    TokenConstraint,
    json_grammar,
    thinking_budget,
)
from glmkit.generate.engine import Engine
from glmkit.serve.bridge import Channels
from glmkit.serve.protocol import ApiError, SamplingDefaults, shutting_down
from glmkit.serve.scheduler import Scheduler
from glmkit.serve.tool_grammar import MARKERS, ToolChoice, tool_call_grammar
from glmkit.serve.toolcalls import TemplateSupport

log = logging.getLogger("glmkit.serve")


@dataclass
class ServeConfig:
    model_name: str  # the id replies and /v1/models give
    model_aliases: tuple[str, ...] = ()  # other ids requests may name (ANY_MODEL: every id)
    api_key: str | None = None
    max_request_bytes: int = 16 << 20
    default_max_tokens: int = 4096  # when a request sets no max_tokens (also capped by the context)
    split_reasoning: bool = False  # chat: text before </think> goes to `reasoning_content`
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)

    @property
    def model_names(self) -> frozenset[str]:
        """The model ids requests may name."""
        return frozenset((self.model_name, *self.model_aliases))


@dataclass
class Loaded:
    engine: Engine
    scheduler: Scheduler
    defaults: SamplingDefaults | None = None  # overrides ServeConfig.defaults (read from the snapshot)

    def __post_init__(self) -> None:
        self.support = TemplateSupport.of(self.engine.tokenizer.chat_template if self.engine.tokenizer else None)
        self._grammar_tokenizer: GrammarTokenizer | None = None
        self._grammar_lock = threading.Lock()

    def thinking_budget(self, budget: int) -> ThinkingBudget | None:
        """The constraint that closes a reply's thinking block past `budget` tokens; None where `</think>` is not
        one added token of the vocabulary (a text marker cannot be cut in)."""
        assert self.engine.tokenizer is not None
        return thinking_budget(self.engine.tokenizer.tokenizer, self.engine.config.vocab_size, budget)

    def json_constraint(self, schema: dict[str, Any] | None, field: str = "response_format") -> TokenConstraint:
        """A token constraint to JSON matching `schema` (None: any JSON object); a 400 on `field` naming what the
        grammar library refuses."""
        try:
            grammar = json_grammar(schema)
        except ValueError as e:
            raise ApiError(400, f"{field}: the JSON schema cannot be used: {e}", param=field,
                           code="invalid_schema") from None
        return self._constraint(grammar, field, "the JSON schema")

    def tool_constraint(self, tools: list[dict[str, Any]], choice: ToolChoice, reasoning: bool,
                        field: str = "tools", thinking_budget: int | None = None) -> TokenConstraint:
        """A token constraint to replies that call these tools as `choice` asks (tool_grammar.py; `reasoning`: the
        reply starts inside the thinking block, of at most `thinking_budget` tokens); a 400 on `field` naming what
        cannot be enforced."""
        markers = self._grammar(field).added_token_ids(MARKERS)
        try:
            grammar = tool_call_grammar(tools, choice, reasoning, markers, thinking_budget)
        except ValueError as e:
            raise ApiError(400, f"{field}: {e}", param=field, code="invalid_schema") from None
        return self._constraint(grammar, field, "a tool's parameters")

    def _grammar(self, field: str) -> GrammarTokenizer:
        """The grammar library's view of the vocabulary, built on first use; a 400 on `field` where this model's
        tokenizer and generation_config.json do not allow constrained output."""
        with self._grammar_lock:
            if self._grammar_tokenizer is None:
                tok = self.engine.tokenizer
                assert tok is not None
                try:
                    self._grammar_tokenizer = GrammarTokenizer(tok.tokenizer, self.engine.config.vocab_size,
                                                               tuple(self.engine.eos_token_ids))
                except GlmkitError as e:
                    raise ApiError(400, f"{field}: unavailable for this model: {e}", param=field,
                                   code="invalid_request") from None
            return self._grammar_tokenizer

    def _constraint(self, grammar: str, field: str, what: str) -> TokenConstraint:
        try:
            return self._grammar(field).constraint(grammar)
        except GrammarError as e:
            raise ApiError(400, f"{field}: {what} cannot be used: {e.reason}", param=field,
                           code="invalid_schema") from None


class State:
    """What every route reads: the config, and the model once the background load has finished."""

    def __init__(self, config: ServeConfig, load: Callable[[], Loaded],
                 on_load_error: Callable[[str], None] | None = None):
        self.config = config
        self.load = load
        self.on_load_error = on_load_error
        self.loaded: Loaded | None = None
        self.load_error: str | None = None
        self.started = time.time()
        self.channels = Channels()

    def run_load(self) -> None:
        try:
            self.loaded = self.load()
            log.info("model %s loaded in %.1fs", self.config.model_name, time.time() - self.started)
        except Exception as e:
            self.load_error = str(e) if isinstance(e, GlmkitError) else f"{type(e).__name__}: {e}"
            log.error("loading failed: %s", self.load_error)
            if self.on_load_error is not None:
                self.on_load_error(self.load_error)

    def ready(self) -> Loaded:
        if self.channels.closing:
            raise shutting_down()
        if self.loaded is not None:
            return self.loaded
        if self.load_error is not None:
            raise ApiError(500, f"the model failed to load: {self.load_error}", "server_error", code="load_failed")
        raise ApiError(503, "the model is still loading; retry shortly", "server_error", code="model_loading")

    def begin_shutdown(self) -> None:
        """From any thread: new requests get 503, and those in flight end with an OpenAI-shaped 503 (a stream
        with an error event, then `[DONE]`) rather than being cut off when the server stops."""
        self.channels.begin_shutdown()

    def max_tokens(self, requested: int | None, prompt_tokens: int) -> int:
        """A request's reply limit: its own, else --default-max-tokens capped by what the context leaves."""
        assert self.loaded is not None
        remaining = self.loaded.engine.config.max_position_embeddings - prompt_tokens
        return requested or min(self.config.default_max_tokens, remaining)

    @property
    def defaults(self) -> SamplingDefaults:
        return (self.loaded.defaults if self.loaded and self.loaded.defaults else None) or self.config.defaults
