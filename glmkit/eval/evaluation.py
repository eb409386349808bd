"""`evaluate`: a model's perplexity over token windows, and its KL divergence from a saved reference (what
`glm-perplexity` reports)."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from tqdm import tqdm

from glmkit.errors import GlmkitError
from glmkit.eval.logits_file import LogitsBase, LogitsWriter
from glmkit.eval.metrics import QualityAccumulator, log_softmax
from glmkit.generate.engine import Engine


def evaluate(engine: Engine, windows: list[list[int]], base: LogitsBase | None = None,
             save: LogitsWriter | None = None, progress: bool = False) -> dict[str, Any]:
    """Run every window (one forward from an empty cache each, scoring positions 0..n-2); returns the metrics of
    `QualityAccumulator.summary`. `save` receives this model's log-probabilities, `base` is compared against."""
    model = engine.model
    limit = engine.config.max_position_embeddings
    for i, w in enumerate(windows):
        if len(w) > limit:
            raise GlmkitError(f"window {i} has {len(w)} tokens, more than the model's {limit} positions")
    acc = QualityAccumulator()
    bar = tqdm(total=sum(len(w) - 1 for w in windows), unit="tok", desc="perplexity", file=sys.stderr,
               disable=not progress)
    try:
        for i, w in enumerate(windows):
            ids = np.asarray(w, dtype=np.int64)
            logits, _ = model.forward(ids, model.new_cache())
            # rounded to float32 as a saved base is, so a model compared with its own base gives exactly 0
            logprobs = log_softmax(logits[:-1]).astype(np.float32)
            if save is not None:
                save.append(logprobs)
            acc.add(logprobs, ids[1:], None if base is None else base.rows(i))
            bar.update(len(w) - 1)
    finally:
        bar.close()
    return acc.summary()
