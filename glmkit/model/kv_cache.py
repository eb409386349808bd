"""Per-sequence KV cache for MLA + DSA (DESIGN section 3).

Per token and layer MLA only needs the normed latent `kv_lat [kv_lora_rank]` and the roped shared key
`k_rot [qk_rope_head_dim]`; layers with their own DSA indexer also keep the roped, layer-normed indexer
key `index_k [index_head_dim]`. The MTP layer (index num_hidden_layers) has its own rows; its length may
differ from the main layers' (its position i holds h'_i, which needs token i+1).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from glmkit.format.config import ModelConfig


class LayerKV:
    """Growable row arrays of one layer: `kv_lat [T, kv_lora_rank]`, `k_rot [T, rope]`, `index_k [T, ihd]`."""

    def __init__(self, kv_lora_rank: int, rope_dim: int, index_dim: int | None, capacity: int = 256) -> None:
        self.length = 0
        # the first row `append` or `truncate` changed since the device decode step last had the rows (a discrete
        # device's copy of them, decode_step._CacheMirror, re-sends the rows from here on)
        self.edited_from = 0
        widths = {"kv_lat": kv_lora_rank, "k_rot": rope_dim, "index_k": index_dim}
        self._data = {name: np.empty((capacity, width), np.float32)
                      for name, width in widths.items() if width is not None}

    @property
    def has_index(self) -> bool:
        return "index_k" in self._data

    def rows(self, name: str) -> np.ndarray:
        """The first `length` rows of field `name` (a view, valid until the next append)."""
        return self._data[name][: self.length]

    @property
    def kv_lat(self) -> np.ndarray:
        return self.rows("kv_lat")

    @property
    def k_rot(self) -> np.ndarray:
        return self.rows("k_rot")

    @property
    def index_k(self) -> np.ndarray:
        return self.rows("index_k")

    def append(self, **rows: np.ndarray) -> None:
        """Append `n` rows to every field this layer stores (`kv_lat=`, `k_rot=`, `index_k=` `[n, width]`)."""
        if set(rows) != set(self._data):
            raise ValueError(f"expected rows for {sorted(self._data)}, got {sorted(rows)}")
        counts = {len(r) for r in rows.values()}
        if len(counts) != 1:
            raise ValueError("all fields must get the same number of rows")
        start = self.length
        self.edited_from = min(self.edited_from, start)
        self.claim(counts.pop())
        for name, data in self._data.items():
            data[start: self.length] = rows[name]

    def overwrite(self, positions: np.ndarray, **rows: np.ndarray) -> None:
        """Replace the rows at `positions [n]` (each below `length`) of every field this layer stores
        (`kv_lat=`, `k_rot=`, `index_k=` `[n, width]`)."""
        if set(rows) != set(self._data):
            raise ValueError(f"expected rows for {sorted(self._data)}, got {sorted(rows)}")
        if len(positions) == 0:
            return
        if positions.min() < 0 or positions.max() >= self.length:
            raise ValueError(f"positions must lie in [0, {self.length}) to be overwritten")
        self.edited_from = min(self.edited_from, int(positions.min()))
        for name, data in self._data.items():
            data[positions] = rows[name]

    def claim(self, n: int) -> None:
        """Extend by `n` rows that the caller fills in place, through `storage` (the device decode step's
        kernels write them)."""
        needed = self.length + n
        for name, data in self._data.items():
            if needed > len(data):
                self._grow(name, max(needed, 2 * len(data)))  # amortized doubling: decode appends one row at a time
        self.length = needed

    def reserve(self, rows: int) -> None:
        """Make room for `rows` rows in all, so that appending up to them copies nothing (a long prompt's rows
        would otherwise be copied, twice their bytes held, each time the arrays double). Rows never written take
        no memory: the arrays' pages are touched only as rows land."""
        for name, data in self._data.items():
            if rows > len(data):
                self._grow(name, rows)

    def _grow(self, name: str, rows: int) -> None:
        data = self._data[name]
        grown = np.empty((rows, data.shape[1]), np.float32)
        grown[: self.length] = data[: self.length]
        self._data[name] = grown

    def storage(self, name: str) -> np.ndarray:
        """The whole row array of field `name` `[capacity, width]` (rows past `length` are unused), valid until
        the next append or claim grows it."""
        return self._data[name]

    def truncate(self, n: int) -> None:
        self.length = min(self.length, max(n, 0))
        self.edited_from = min(self.edited_from, self.length)


def kv_bytes_per_token(config: ModelConfig) -> int:
    """Bytes of KV rows one token adds to a `KVCache` (f32): every layer's latent and roped key, the MTP layer's
    included, and the indexer key of every 'full' layer."""
    layers = range(config.num_layers_with_mtp)
    widths = sum(config.kv_lora_rank + config.qk_rope_head_dim for _ in layers)
    widths += sum(config.index_head_dim for i in layers if config.indexer_type(i) == "full")
    return 4 * widths


class KVCache:
    """The KV rows of one sequence for every layer, the MTP layer included."""

    def __init__(self, config: ModelConfig, index_layers: Iterable[int] | None = None) -> None:
        """index_layers: layers that keep indexer keys; default: every layer whose type is 'full'."""
        n_layers = config.num_layers_with_mtp
        if index_layers is None:
            index_layers = [i for i in range(n_layers) if config.indexer_type(i) == "full"]
        index_set = set(index_layers)
        self.layers = [
            LayerKV(config.kv_lora_rank, config.qk_rope_head_dim,
                    config.index_head_dim if i in index_set else None)
            for i in range(n_layers)
        ]
        self.num_main_layers = config.num_hidden_layers

    @property
    def length(self) -> int:
        """Tokens cached by the main model (the next forward starts at this position)."""
        return self.layers[0].length

    def layer(self, index: int) -> LayerKV:
        return self.layers[index]

    def reserve(self, rows: int) -> None:
        """`LayerKV.reserve` on every layer."""
        for layer in self.layers:
            layer.reserve(rows)

    def truncate(self, n: int) -> None:
        """Keep the first `n` positions of every layer (rolls back rejected MTP drafts)."""
        for layer in self.layers:
            layer.truncate(n)
