"""Per-sequence KV cache for MLA + DSA (DESIGN section 3).

Per token and layer MLA only needs the normed latent `kv_lat [kv_lora_rank]` and the roped shared key
`k_rot [qk_rope_head_dim]`; layers with their own DSA indexer also keep the roped, layer-normed indexer
key `index_k [index_head_dim]`. The MTP layer (index num_hidden_layers) has its own rows; its length may
differ from the main layers' (its position i holds h'_i, which needs token i+1).

Rows are kept at one of four precisions (`KV_DTYPES`, DESIGN section 6): `f32` (exact), `bf16` (the top half of
each float, rounded to nearest even), `f16` (IEEE half codes, rounded to nearest even, times one f32 scale per row
and field: 1, or the power of two that brings a row larger than F16_ROW_MAX within it) or `fp8` (e4m3 codes times
one f32 scale per row and field, the row's largest magnitude over 448). Readers get float32 rows (`rows`); the
device decode step reads and writes the stored codes (`storage`, `scales`).

Beside each stored indexer key a layer keeps its shadow (`encode_index_shadow`, DESIGN section 3, "DSA indexer"):
the key as the kernels read it, in int8 codes with one scale per key, in blocks of SHADOW_BLOCK keys. The device
decode step scores every key from the shadows first and rescores from the stored keys only those that may be among
the top-k.
"""

from __future__ import annotations

from collections.abc import Iterable

import ml_dtypes
import numpy as np

from glmkit.format.config import ModelConfig

KV_DTYPES = ("f32", "bf16", "f16", "fp8")
SCALED_KV_DTYPES = frozenset({"f16", "fp8"})  # rows stored with one f32 scale per row and field
FP8_MAX = 448.0  # the largest finite e4m3 magnitude
F16_ROW_MAX = 32768.0  # an f16 row whose largest magnitude exceeds this is scaled down by a power of two (exact)
INITIAL_ROWS = 256  # rows a new cache's arrays hold room for
SHADOW_BLOCK = 8  # indexer-key shadows are stored in blocks of this many keys, `[d, SHADOW_BLOCK]` codes each
_STORED = {"f32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16), "f16": np.dtype(np.float16),
           "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}


def kv_storage_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype rows of KV dtype `dtype` are stored as."""
    return _STORED[dtype]


def encode_kv_rows(dtype: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """`rows [n, w]` f32 as stored at `dtype`: (codes `[n, w]`, per-row scales `[n]` f32 for f16 and fp8, else
    None)."""
    rows = np.asarray(rows, dtype=np.float32)
    if dtype not in SCALED_KV_DTYPES:
        return rows.astype(_STORED[dtype]), None
    amax = np.abs(rows).max(axis=-1) if rows.shape[-1] else np.zeros(len(rows), np.float32)
    if dtype == "f16":
        # the least power of two p with amax / p <= F16_ROW_MAX (frexp is exact: m in [0.5, 1))
        m, e = np.frexp(amax / np.float32(F16_ROW_MAX))
        power = np.where(amax > F16_ROW_MAX, np.where(m == 0.5, e - 1, e), 0)  # [n]
        scale = np.ldexp(np.float32(1), power).astype(np.float32)  # [n]
        inverse = np.ldexp(np.float32(1), -power).astype(np.float32)  # [n], exact
        return (rows * inverse[:, None]).astype(_STORED["f16"]), scale
    scale = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1)).astype(np.float32)  # [n]
    inverse = (np.float32(FP8_MAX) / np.where(amax > 0, amax, np.float32(FP8_MAX))).astype(np.float32)  # [n]
    return (rows * inverse[:, None]).astype(_STORED["fp8"]), scale


def decode_kv_rows(codes: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
    """float32 rows `[n, w]` from `encode_kv_rows`' codes and scales."""
    rows = codes.astype(np.float32)
    return rows if scales is None else rows * scales[:, None]


def encode_index_shadow(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The shadows of indexer keys `keys [n, d]` f32 (the values the kernels read): (int8 codes `[n, d]`, scales `[n]`
    f32) with `|keys - scale * codes| <= scale * (1/2 + 2^-12)` per value: scale = the row's largest magnitude / 127,
    codes = rint(key * (127 / largest)); 0 and 0 for an all-zero row. kv.cl's `index_shadow_rows` is the same."""
    keys = np.asarray(keys, np.float32)
    amax = np.abs(keys).max(axis=-1) if keys.shape[-1] else np.zeros(len(keys), np.float32)  # [n]
    live = amax > 0
    scale = np.where(live, amax / np.float32(127), np.float32(0)).astype(np.float32)
    inverse = (np.float32(127) / np.where(live, amax, np.float32(1))).astype(np.float32)
    codes = np.clip(np.rint(keys * np.where(live, inverse, np.float32(0))[:, None]), -127, 127).astype(np.int8)
    return codes, scale


def shadow_bound(d: int, nh: int) -> float:
    """The factor F of the shadow bound (DESIGN section 3, "DSA indexer"): with index-score scale `scale`, head weights
    `W_h` and queries `q_h [d]` of `nh` heads, the float index score of a key and its stage-1 score from its shadow
    (scale_t) differ by at most `scale_t * F * |scale| * sum_h |W_h| |q_h|_1`. 1/2 is the codes' rounding; the rest
    covers float32 rounding in both sums, in the codes and in the comparisons made with the bound."""
    return (0.5 + 300 * (d + nh + 16) * 2.0 ** -24) * (1 + 2.0 ** -8)


class LayerKV:
    """Growable row arrays of one layer: `kv_lat [T, kv_lora_rank]`, `k_rot [T, rope]`, `index_k [T, ihd]`,
    stored at `dtype` (`KV_DTYPES`)."""

    def __init__(self, kv_lora_rank: int, rope_dim: int, index_dim: int | None, capacity: int = INITIAL_ROWS,
                 dtype: str = "f32") -> None:
        if dtype not in KV_DTYPES:
            raise ValueError(f"kv dtype {dtype!r}: not one of {', '.join(KV_DTYPES)}")
        self.dtype = dtype
        self.length = 0
        # the first row `append` or `truncate` changed since the device decode step last had the rows (a discrete
        # device's copy of them, kv_mirrors.CacheCopy, re-sends the rows from here on)
        self.edited_from = 0
        widths = {"kv_lat": kv_lora_rank, "k_rot": rope_dim, "index_k": index_dim}
        self._data = {name: np.empty((capacity, width), _STORED[dtype])
                      for name, width in widths.items() if width is not None}
        # f16, fp8: one scale per row and field
        self._scales = {name: np.empty(capacity, np.float32) for name in self._data} \
            if dtype in SCALED_KV_DTYPES else {}
        # the indexer keys' shadows (`encode_index_shadow`): codes in blocks
        # `[capacity / SHADOW_BLOCK, d, SHADOW_BLOCK]`, one scale per key
        self._shadow: tuple[np.ndarray, np.ndarray] | None = None
        if index_dim is not None:
            self._shadow = self._new_shadow(capacity, index_dim)

    @property
    def has_index(self) -> bool:
        return "index_k" in self._data

    def width(self, name: str) -> int:
        return self._data[name].shape[1]

    def rows(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) (default: all `length`) of field `name` as float32 `[n, width]`: a view at f32
        (valid until the next append), a new array at lower precisions."""
        stop = self.length if stop is None else min(stop, self.length)
        codes = self._data[name][start:stop]
        if self.dtype == "f32":
            return codes
        return decode_kv_rows(codes, self._scales[name][start:stop] if self._scales else None)

    def gather(self, name: str, index: np.ndarray) -> np.ndarray:
        """Rows `index [...]` (each below `length`) of field `name` as float32 `[..., width]`."""
        codes = self._data[name][index]
        if self.dtype == "f32":
            return codes
        rows = codes.astype(np.float32)
        return rows if not self._scales else rows * self._scales[name][index][..., None]

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
        """Append `n` rows to every field this layer stores (`kv_lat=`, `k_rot=`, `index_k=` `[n, width]` f32)."""
        self.append_encoded({name: encode_kv_rows(self.dtype, r) for name, r in rows.items()})

    def append_encoded(self, fields: dict[str, tuple[np.ndarray, np.ndarray | None]]) -> None:
        """Append rows already stored at this layer's dtype (`field -> (codes [n, width], scales [n] or None)`, as
        `encoded` returns them): a restored prefix is copied, not rounded again."""
        self._checked({name: codes for name, (codes, _) in fields.items()})
        start = self.length
        self.edited_from = min(self.edited_from, start)
        self.claim(len(next(iter(fields.values()))[0]))
        for name, (codes, scales) in fields.items():
            self._data[name][start: self.length] = codes
            if self._scales:
                self._scales[name][start: self.length] = scales
        self._shade(np.arange(start, self.length))

    def encoded(self, name: str, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Copies of the stored codes `[n, width]` and (f16, fp8) scales `[n]` of rows [start, stop) of field `name`."""
        return (self._data[name][start:stop].copy(),
                self._scales[name][start:stop].copy() if self._scales else None)

    def put_row(self, pos: int, name: str, row: np.ndarray) -> None:
        """Row `pos` (below `length`) of field `name` from f32 `row [width]`, not counted as edited: a discrete
        device's decode step computed it, and its own copy already holds it."""
        codes, scales = encode_kv_rows(self.dtype, row[None])
        self._data[name][pos] = codes[0]
        if self._scales:
            self._scales[name][pos] = scales[0]
        if name == "index_k":
            self._shade(np.array([pos]))

    def _checked(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if set(rows) != set(self._data):
            raise ValueError(f"expected rows for {sorted(self._data)}, got {sorted(rows)}")
        if len({len(r) for r in rows.values()}) != 1:
            raise ValueError("all fields must get the same number of rows")
        return rows

    def overwrite(self, positions: np.ndarray, **rows: np.ndarray) -> None:
        """Replace the rows at `positions [n]` (each below `length`) of every field this layer stores
        (`kv_lat=`, `k_rot=`, `index_k=` `[n, width]` f32)."""
        self._checked(rows)
        if len(positions) == 0:
            return
        if positions.min() < 0 or positions.max() >= self.length:
            raise ValueError(f"positions must lie in [0, {self.length}) to be overwritten")
        self.edited_from = min(self.edited_from, int(positions.min()))
        for name, data in self._data.items():
            codes, scales = encode_kv_rows(self.dtype, rows[name])
            data[positions] = codes
            if self._scales:
                self._scales[name][positions] = scales
        self._shade(np.asarray(positions))

    def claim(self, n: int) -> None:
        """Extend by `n` rows that the caller fills in place, through `storage` (the device decode step's
        kernels write them)."""
        needed = self.length + n
        for name, data in self._data.items():
            if needed > len(data):
                self._resize(name, max(needed, 2 * len(data)))  # amortized doubling: decode appends a row at a time
        self.length = needed

    def reserve(self, rows: int) -> None:
        """Make room for `rows` rows in all, so that appending up to them copies nothing (a long prompt's rows
        would otherwise be copied, twice their bytes held, each time the arrays double). Rows never written take
        no memory: the arrays' pages are touched only as rows land."""
        for name, data in self._data.items():
            if rows > len(data):
                self._resize(name, rows)

    def fit(self, rows: int) -> None:
        """Let the arrays hold room for `rows` rows (at least `length` and INITIAL_ROWS) where they hold more than
        twice that: a sequence reused for a much shorter one lets go of the pages its longest rows touched and (on a
        discrete device, which copies whole arrays) of their copies."""
        rows = max(rows, self.length, INITIAL_ROWS)
        for name, data in self._data.items():
            if len(data) > 2 * rows:
                self._resize(name, rows)

    def _shade(self, positions: np.ndarray) -> None:
        """The shadows of the indexer keys at `positions [n]` from the stored keys (none without an indexer)."""
        if self._shadow is None or len(positions) == 0:
            return
        codes, scales = encode_index_shadow(self.gather("index_k", positions))
        blocks, scale = self._shadow
        blocks[positions // SHADOW_BLOCK, :, positions % SHADOW_BLOCK] = codes
        scale[positions] = scales

    @staticmethod
    def _new_shadow(capacity: int, index_dim: int) -> tuple[np.ndarray, np.ndarray]:
        blocks = -(-capacity // SHADOW_BLOCK)
        return np.zeros((blocks, index_dim, SHADOW_BLOCK), np.int8), np.zeros(blocks * SHADOW_BLOCK, np.float32)

    def shadow(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The whole shadow arrays of the indexer keys (codes `[capacity / SHADOW_BLOCK, d, SHADOW_BLOCK]` int8,
        scales `[capacity]` f32; as `storage`, valid until the next append or claim grows them; rows past `length`
        unused), None without an indexer. The device decode step writes the shadows of the rows it writes."""
        return self._shadow

    def _resize(self, name: str, rows: int) -> None:
        """Field `name`'s arrays (its scales and shadows with it) remade for `rows` rows, the first `length` kept."""
        if name == "index_k" and self._shadow is not None:
            grown_shadow = self._new_shadow(rows, self._shadow[0].shape[1])
            used = -(-self.length // SHADOW_BLOCK)
            grown_shadow[0][:used] = self._shadow[0][:used]
            grown_shadow[1][: self.length] = self._shadow[1][: self.length]
            self._shadow = grown_shadow
        data = self._data[name]
        grown = np.empty((rows, data.shape[1]), data.dtype)
        grown[: self.length] = data[: self.length]
        self._data[name] = grown
        if self._scales:
            scales = np.empty(rows, np.float32)
            scales[: self.length] = self._scales[name][: self.length]
            self._scales[name] = scales

    def storage(self, name: str) -> np.ndarray:
        """The whole code array of field `name` `[capacity, width]` at the stored dtype (rows past `length` are
        unused), valid until the next append or claim grows it."""
        return self._data[name]

    def scales(self, name: str) -> np.ndarray | None:
        """f16, fp8: the whole per-row scale array of field `name` `[capacity]` (as `storage`); else None."""
        return self._scales.get(name)

    def truncate(self, n: int) -> None:
        self.length = min(self.length, max(n, 0))
        self.edited_from = min(self.edited_from, self.length)


def kv_bytes_per_token(config: ModelConfig, dtype: str = "f32", layers: range | None = None) -> int:
    """Bytes of KV rows one token adds to a `KVCache` at `dtype`: every layer's latent and roped key, the MTP
    layer's included, and the indexer key of every 'full' layer (f16, fp8: and a 4-byte scale per field); with
    `layers`, those layers' only (a pipeline stage's)."""
    layers = range(config.num_layers_with_mtp) if layers is None else layers
    fields = [config.kv_lora_rank, config.qk_rope_head_dim] * len(layers)
    fields += [config.index_head_dim for i in layers if config.indexer_type(i) == "full"]
    return sum(fields) * _STORED[dtype].itemsize + (4 * len(fields) if dtype in SCALED_KV_DTYPES else 0)


class KVCache:
    """The KV rows of one sequence for every layer, the MTP layer included."""

    def __init__(self, config: ModelConfig, index_layers: Iterable[int] | None = None, dtype: str = "f32") -> None:
        """index_layers: layers that keep indexer keys; default: every layer whose type is 'full'. dtype: the rows'
        precision (`KV_DTYPES`)."""
        n_layers = config.num_layers_with_mtp
        if index_layers is None:
            index_layers = [i for i in range(n_layers) if config.indexer_type(i) == "full"]
        index_set = set(index_layers)
        self.layers = [
            LayerKV(config.kv_lora_rank, config.qk_rope_head_dim,
                    config.index_head_dim if i in index_set else None, dtype=dtype)
            for i in range(n_layers)
        ]
        self.dtype = dtype
        self.num_main_layers = config.num_hidden_layers

    @property
    def length(self) -> int:
        """Tokens cached by the main model (the next forward starts at this position)."""
        return self.layers[0].length

    @property
    def capacity(self) -> int:
        """Rows the arrays hold room for (the first layer's; every layer reserves alike): what a device's copy of
        them takes, where the rows are copied whole."""
        return len(self.layers[0].storage("kv_lat"))

    @property
    def lost(self) -> bool:
        """Rows held elsewhere that are gone (a restarted pipeline stage's): never computed with again."""
        return False

    def layer(self, index: int) -> LayerKV:
        return self.layers[index]

    def reserve(self, rows: int) -> None:
        """`LayerKV.reserve` on every layer."""
        for layer in self.layers:
            layer.reserve(rows)

    def fit(self, rows: int) -> None:
        """`LayerKV.fit` on every layer."""
        for layer in self.layers:
            layer.fit(rows)

    def truncate(self, n: int) -> None:
        """Keep the first `n` positions of every layer (rolls back rejected MTP drafts)."""
        for layer in self.layers:
            layer.truncate(n)
