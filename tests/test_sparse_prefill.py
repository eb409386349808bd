"""DSA's sparse prefill: each query attends only to the keys its indexer chose (gathered per query), the indexer
scored a block of queries at a time. Checked against a dense reference written here (the `[S, T]` index scores,
`topk_mask`, masked attention over every key by reconstruction), on prompts many times `index_topk`: the same
selections and the same logits, whole and in chunks, on NumPy and on the OpenCL backend."""

from __future__ import annotations

import numpy as np
import pytest

from glmkit.backends.numpy_backend import NumpyBackend
from glmkit.backends.opencl.backend import OpenCLBackend, Placement
from glmkit.backends.opencl.ops import Kernels
from glmkit.model.glm5 import AttentionInputs, GlmMoeDsaModel, mla_attend_full
from glmkit.model.kv_cache import LayerKV
from glmkit.model.ops import chosen_keys, position_mask, rope_cos_sin, topk_mask
from tests.runtime_support import opencl_test_device
from tests.test_model_math import DictWeights, random_weights, tiny_config

TOPK, PROMPT = 16, 300


class DenseReference(GlmMoeDsaModel):
    """Today's math the plain way: every query scores every causal key, `[S, T]` masks, keys reconstructed."""

    def attention(self, layer: int, u: np.ndarray, positions: np.ndarray, kv: LayerKV,
                  prev_chosen: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        spec = self.layers[layer].attention
        cos, sin = rope_cos_sin(positions, spec.rope, spec.rope_theta)
        scored = spec.indexer is not None and kv.length + len(u) > spec.indexer.topk
        a = self.attention_inputs(layer, u, cos, sin, scored)
        kv.append(kv_lat=a.kv_lat, k_rot=a.k_rot, **({} if a.index_k is None else {"index_k": a.index_k}))
        mask = position_mask(positions, kv.length)  # [S, T]
        if scored:
            assert spec.indexer is not None and a.index_q is not None and a.index_weights is not None
            scores = np.einsum("sh,sht->st", a.index_weights, np.maximum(
                np.einsum("shd,td->sht", a.index_q, kv.index_k) * spec.indexer.score_scale, 0))
            mask = topk_mask(scores.astype(np.float32), mask, spec.indexer.topk)
        elif spec.selection == "previous" and prev_chosen is not None:
            mask = prev_chosen
        out = mla_attend_full(self.backend, a.q_nope, a.q_rot, kv.kv_lat, kv.k_rot, self._w(spec.kv_b), mask,
                              spec.scale)
        return self.backend.linear(out.reshape(len(u), -1), self._w(spec.o_proj)), mask


class Recording(GlmMoeDsaModel):
    """The model as shipped, keeping each layer's selection."""

    chosen: dict[int, list[np.ndarray]]

    def select_keys(self, layer: int, inputs: AttentionInputs, kv: LayerKV, positions: np.ndarray,
                    prev_chosen: np.ndarray | None) -> np.ndarray | None:
        chosen = super().select_keys(layer, inputs, kv, positions, prev_chosen)
        if inputs.index_q is not None:
            self.chosen.setdefault(layer, []).append(chosen)
        return chosen


@pytest.fixture(scope="module")
def model_parts():
    config = tiny_config(index_topk=TOPK, max_position_embeddings=4096)
    return config, DictWeights(random_weights(config, np.random.default_rng(31)))


def run(model: GlmMoeDsaModel, ids: np.ndarray, chunk: int) -> np.ndarray:
    cache = model.new_cache()
    return np.concatenate([model.forward(ids[s:s + chunk], cache)[0] for s in range(0, len(ids), chunk)])


def backends():
    yield "numpy", NumpyBackend(query_block=1 << 12)  # blocks of a few queries: the blockwise paths are exercised
    yield "numpy-pool", NumpyBackend(query_block=1 << 12, workers=2)
    yield "opencl", OpenCLBackend(Kernels(opencl_test_device()), Placement())  # the indexer's kernels


@pytest.mark.parametrize("chunk", [PROMPT, 7, 1])
def test_sparse_prefill_equals_the_dense_masked_reference(model_parts, chunk: int) -> None:
    """Whole prompt, chunks of 7 (queries with fewer than index_topk keys and with many times more) and one token
    at a time: the chosen keys of every scoring layer are the reference's, the logits agree to f32 rounding."""
    config, weights = model_parts
    ids = np.random.default_rng(32).integers(0, config.vocab_size, PROMPT)
    reference = DenseReference(config, weights, NumpyBackend())
    expected = run(reference, ids, PROMPT)
    masks: dict[int, list[np.ndarray]] = {}
    cache = reference.new_cache()
    for s in range(0, PROMPT, chunk):  # the reference's selections, in the same chunks
        x = reference.embed(ids[s:s + chunk])
        positions = np.arange(s, s + len(x))
        mask = None
        for layer in range(config.num_hidden_layers):
            x, mask = reference.decoder_layer(layer, x, positions, cache.layer(layer), mask)
            if reference.layers[layer].attention.selection != "previous" and cache.length > TOPK:
                masks.setdefault(layer, []).append(mask)
    for name, backend in backends():
        if name == "opencl" and chunk == 1:
            continue  # one token at a time is the decode step's case, tested with the step
        model = Recording(config, weights, backend)
        model.chosen = {}
        got = run(model, ids, chunk)
        scale = np.abs(expected).max()
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * scale, err_msg=name)
        assert set(model.chosen) == set(masks), name
        for layer, parts in masks.items():
            want = np.concatenate([chosen_keys(m, TOPK) for m in parts])
            assert np.array_equal(np.concatenate(model.chosen[layer]), want), (name, layer)


def test_prefill_of_a_long_prompt_holds_no_square_matrix(model_parts, monkeypatch) -> None:
    """No `[S, T]` array is made when a long prompt runs in one call: the largest array any attention or indexer
    step allocates stays far below S x T elements (blocks of queries against T keys, or S x index_topk)."""
    config, weights = model_parts
    ids = np.random.default_rng(33).integers(0, config.vocab_size, 1200)
    largest = [0]
    real_mask, real_topk = position_mask, topk_mask

    def watched_mask(positions, total):
        largest[0] = max(largest[0], len(positions) * total)
        return real_mask(positions, total)

    def watched_topk(scores, causal, k):
        largest[0] = max(largest[0], scores.size)
        return real_topk(scores, causal, k)

    import glmkit.backends.numpy_backend as numpy_backend
    import glmkit.model.glm5 as glm5
    for module in (numpy_backend, glm5):
        monkeypatch.setattr(module, "position_mask", watched_mask)
    monkeypatch.setattr(numpy_backend, "topk_mask", watched_topk)
    model = GlmMoeDsaModel(config, weights, NumpyBackend(query_block=1 << 16))
    model.forward(ids, model.new_cache())
    assert 0 < largest[0] <= 64 * len(ids)  # a block of rows against every key: ~55 rows here


def test_dense_mlp_of_a_long_prompt_runs_in_row_blocks(model_parts) -> None:
    """A long prompt's dense MLP runs DENSE_MLP_ROWS rows at a time (its `[rows, I]` intermediates bounded) and
    gives the rows one whole-prompt pass gives."""
    import glmkit.model.glm5 as glm5

    config, weights = model_parts
    model = GlmMoeDsaModel(config, weights, NumpyBackend())
    dense = next(i for i, spec in enumerate(model.layers) if not isinstance(spec.ffn, glm5.MoESpec))
    u = np.random.default_rng(35).standard_normal((2 * glm5.DENSE_MLP_ROWS + 77, config.hidden_size),
                                                  dtype=np.float32)
    seen: list[int] = []
    whole = model.backend.expert_mlp(u, *model._mlp(model.layers[dense].ffn))

    class Watched(NumpyBackend):
        def expert_mlp(self, x, gate, up, down):
            seen.append(x.shape[0])
            return super().expert_mlp(x, gate, up, down)

    model.backend = Watched()
    got = model.feed_forward(dense, u)
    assert seen == [glm5.DENSE_MLP_ROWS, glm5.DENSE_MLP_ROWS, 77]
    np.testing.assert_allclose(got, whole, rtol=0, atol=1e-6 * np.abs(whole).max())
