"""Output constrained by a grammar: a JSON schema (or any JSON object) compiled by llguidance into a token mask
applied to each token's logits before sampling.

`GrammarTokenizer` wraps the model's tokenizer once (llguidance's view of the vocabulary: building it takes about
a second for a large one); `json_grammar` turns a schema into a grammar; `TokenConstraint` is one generation's
matcher, built by `GrammarTokenizer.constraint` (a grammar the library cannot compile is a `GrammarError` then, before
generation): `mask(logits)` leaves the tokens the grammar allows next (end of sequence only once it is complete),
`accept(token)` advances it. A constraint starts from the first generated token. `ThinkingBudget` holds a reply
that starts inside a thinking block to a number of tokens before the block's closing token, without a grammar.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np
from tokenizers import Tokenizer

from glmkit.errors import GlmkitError
from glmkit.generate.tokenizer import THINK_CLOSE


def json_grammar(schema: dict[str, Any] | None) -> str:
    """The grammar of JSON text matching `schema` (None: any JSON object), compact whitespace allowed."""
    schema = {"type": "object"} if schema is None else schema
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                         defaults={"whitespace_flexible": False})


class GrammarTokenizer:
    """llguidance's view of a model's vocabulary: `vocab_size` ids (the model's, at least the tokenizer's), the
    end-of-sequence ids the grammar ends on."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        if not eos_ids:
            raise GlmkitError("constrained output needs an end-of-sequence token id (generation_config.json)")
        outside = [i for i in eos_ids if not 0 <= i < tokenizer.get_vocab_size()]
        if outside:  # the grammar library ends a grammar on tokens the tokenizer knows
            raise GlmkitError(f"constrained output: end-of-sequence id {outside[0]} (generation_config.json) is not a "
                              f"token of the tokenizer ({tokenizer.get_vocab_size()} tokens)")
        self.ll = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=max(vocab_size, tokenizer.get_vocab_size()),
                                         eos_token=list(eos_ids))
        # llguidance matches an added token only as itself (a grammar names it `<[id]>`), never by its text
        self.added = {token.content: i for i, token in tokenizer.get_added_tokens_decoder().items()}

    def added_token_ids(self, texts: tuple[str, ...]) -> dict[str, int]:
        """{text: id} for each of `texts` that is one added token of the vocabulary."""
        return {text: self.added[text] for text in texts if text in self.added}

    def constraint(self, grammar: str) -> TokenConstraint:
        """A generation's matcher of `grammar`; `GrammarError` where the library cannot use it (compiled once)."""
        return TokenConstraint(self, grammar)


class GrammarError(GlmkitError):
    """A grammar the library cannot use; `reason`: its message on one line."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"constrained output: {reason}")
        self.reason = reason


class TokenConstraint:
    """One generation's position in a grammar: masks logits `[V]` to the allowed tokens, advances on each token."""

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str) -> None:
        self.matcher = llguidance.LLMatcher(tokenizer.ll, grammar)
        if self.matcher.is_error():
            lines = [line.strip() for line in self.matcher.get_error().splitlines() if line.strip()]
            raise GrammarError(" ".join(lines) or "the grammar does not compile")
        self.bitmask = llguidance.numpy.allocate_token_bitmask(1, tokenizer.ll.vocab_size)  # [1, ceil(V / 32)]

    def allowed_bits(self) -> np.ndarray:
        """The tokens the grammar allows next: bit t % 32 of word t // 32, int32 `[ceil(V / 32)]` (llguidance's)."""
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        if not self.bitmask.any():
            raise GlmkitError(f"constrained output: no token may follow ({self.matcher.get_error() or 'dead end'})")
        return self.bitmask[0]

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """`logits [V]` with every token the grammar does not allow next at -inf (a new array)."""
        bits = np.unpackbits(self.allowed_bits().view(np.uint8), bitorder="little")[:len(logits)].astype(bool)  # [V]
        return np.where(bits, logits, np.float32(-np.inf)).astype(logits.dtype)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GlmkitError(f"constrained output: token {token} breaks the grammar ({self.matcher.get_error()})")

    def rollback(self, tokens: int) -> None:
        """Take back the last `tokens` accepted."""
        self.matcher.rollback(tokens)


def thinking_budget(tokenizer: Tokenizer, vocab_size: int, budget: int) -> ThinkingBudget | None:
    """The `ThinkingBudget` of `budget` tokens for a model of `vocab_size` token ids with this tokenizer; None where
    `</think>` is not one added token of it (a text marker cannot be cut in)."""
    added = {token.content: i for i, token in tokenizer.get_added_tokens_decoder().items()}
    close = added.get(THINK_CLOSE)
    return None if close is None or close >= vocab_size else ThinkingBudget(close, budget, vocab_size)


class ThinkingBudget:
    """A reply that starts inside a thinking block: at most `budget` tokens before the block's closing token
    `close_id`, then that token (the only one allowed); every token of the `vocab_size` before and after. A constraint
    as `TokenConstraint` is (`mask`, `allowed_bits`, `accept`, `rollback`)."""

    def __init__(self, close_id: int, budget: int, vocab_size: int) -> None:
        if budget < 1 or not 0 <= close_id < vocab_size:
            raise ValueError(f"thinking budget {budget} before token {close_id} of {vocab_size}")
        self.close_id, self.budget = close_id, budget
        words = -(-vocab_size // 32)
        every = np.ones(words * 32, np.uint8)
        every[vocab_size:] = 0
        self._every = np.packbits(every, bitorder="little").view(np.int32)  # [ceil(V / 32)]
        self._close = np.zeros(words, np.int32)
        self._close[close_id // 32] = np.int32(np.uint32(1 << (close_id % 32)).view(np.int32))
        self._tokens: list[int] = []  # accepted, in order
        self._closed_at: int | None = None  # where in them the block closed

    @property
    def forcing(self) -> bool:
        """Whether the budget is spent and the block still open: the closing token comes next."""
        return self._closed_at is None and len(self._tokens) >= self.budget

    def allowed_bits(self) -> np.ndarray:
        return self._close if self.forcing else self._every

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """`logits [V]` (the same array where every token is allowed), or only the closing token's kept."""
        if not self.forcing:
            return logits
        out = np.full_like(logits, -np.inf)  # [V]
        out[self.close_id] = logits[self.close_id]
        return out

    def accept(self, token: int) -> None:
        if self.forcing and token != self.close_id:
            raise GlmkitError(f"thinking budget: token {token} after {self.budget} thinking tokens, not the closing "
                              f"token {self.close_id}")
        if self._closed_at is None and token == self.close_id:
            self._closed_at = len(self._tokens)
        self._tokens.append(token)

    def rollback(self, tokens: int) -> None:
        """Take back the last `tokens` accepted."""
        del self._tokens[len(self._tokens) - tokens:]
        if self._closed_at is not None and self._closed_at >= len(self._tokens):
            self._closed_at = None
