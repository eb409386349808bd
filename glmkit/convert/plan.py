"""Quantization presets: which bits and group size each tensor role gets, and how scales are chosen.

`bits=None` keeps the tensor in F32. Norms, biases and the router are always F32. Every quantized tensor uses
`group_size` (None = per row, which measurably hurts quality: DESIGN section 4) unless `groups` names another for
its role. int8 with group 64 is 8.5 bits per weight, like llama.cpp's Q8_0; per-row int8 loses top-1 agreement
(docs/QUALITY.md). q8 scales every weight but the routed experts in groups of 32: those weights are ~3% of GLM-5's,
so the finer scales cost 0.01 bits per weight overall (+1.1 GB on 804) and cut q8's KL divergence by a fifth
(docs/QUALITY.md).
`quantizer` picks codes and scales (quantizers.py): `absmax`, `mse` (error-minimising search) or `gptq`.
`grid` picks what a 4-bit code stands for: `nl` (the default) stores every 4-bit weight with scheme nl4, a fixed
non-uniform table of 16 levels (IQ4_NL's; lower error at the same bytes: docs/QUALITY.md), `uniform` with the
evenly spaced codes -8..7 (scheme symmetric). Other bit widths are uniform either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from glmkit.convert.quantizers import QUANTIZERS
from glmkit.errors import GlmkitError
from glmkit.format.packing import SUPPORTED_BITS, packed_row_bytes, scales_shape
from glmkit.format.schema import TensorSpec
from glmkit.format.writer import PlannedTensor

QUANTIZABLE_ROLES = ("embed", "lm_head", "attention", "indexer", "dense_mlp", "shared_expert", "routed_expert",
                     "mtp")
DENSE_ROLES = ("attention", "dense_mlp", "shared_expert")
DEFAULT_GROUP_SIZE = 64
DEFAULT_QUANTIZER = "mse"
FINE_GROUP_SIZE = 32  # q8's group size for every weight but the routed experts
GRIDS = ("nl", "uniform")
DEFAULT_GRID = "nl"

_Q4 = {"routed_expert": 4, "shared_expert": 4, "dense_mlp": 4, "attention": 4,
       "embed": 8, "lm_head": 8, "indexer": 8, "mtp": 8}
# q8 is the quality preset: its embedding stays F32. Decode reads one embedding row per token from the mapping,
# so that costs disk (+2.9 GB at GLM-5 size), not RAM or bandwidth, and lowers q8's KLD (docs/QUALITY.md).
PRESETS: dict[str, dict[str, int]] = {
    "f32": {},
    "q8": dict.fromkeys((r for r in QUANTIZABLE_ROLES if r != "embed"), 8),
    "q4": _Q4,
    "q3": {**_Q4, "routed_expert": 3},
    "q2": {**_Q4, "routed_expert": 2},
}
# Per-role group sizes that differ from DEFAULT_GROUP_SIZE; an explicit --group-size replaces them
PRESET_GROUPS: dict[str, dict[str, int | None]] = {
    "q8": dict.fromkeys((r for r in QUANTIZABLE_ROLES if r != "routed_expert"), FINE_GROUP_SIZE),
}


@dataclass(frozen=True)
class QuantPlan:
    """Bits per role (absent = F32), the scale group size (`groups`: per role where it differs from `group_size`;
    None = per row), the scale quantizer and the 4-bit grid."""

    bits: dict[str, int]
    group_size: int | None
    quantizer: str = DEFAULT_QUANTIZER
    grid: str = DEFAULT_GRID
    groups: dict[str, int | None] = field(default_factory=dict)

    @classmethod
    def from_preset(cls, preset: str, expert_bits: int | None = None, dense_bits: int | None = None,
                    embed_bits: int | None = None, group_size: int | None = None,
                    quantizer: str = DEFAULT_QUANTIZER, grid: str = DEFAULT_GRID) -> QuantPlan:
        """A preset with per-class overrides; bits 32 means keep F32; group_size None: the preset's group sizes,
        else that size for every role (0 = per row)."""
        if preset not in PRESETS:
            raise GlmkitError(f"--preset: unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
        bits = dict(PRESETS[preset])
        for roles, value, flag in ((("routed_expert",), expert_bits, "--expert-bits"),
                                   (DENSE_ROLES, dense_bits, "--dense-bits"),
                                   (("embed", "lm_head"), embed_bits, "--embed-bits")):
            if value is None:
                continue
            if value != 32 and value not in SUPPORTED_BITS:
                raise GlmkitError(f"{flag}: {value} is not one of 2, 3, 4, 8 or 32 (F32)")
            for role in roles:
                if value == 32:
                    bits.pop(role, None)
                else:
                    bits[role] = value
        if group_size is not None and group_size < 0:
            raise GlmkitError(f"--group-size: must be >= 0, got {group_size}")
        if quantizer not in QUANTIZERS:
            raise GlmkitError(f"--quantizer: unknown quantizer {quantizer!r} (choose from {', '.join(QUANTIZERS)})")
        if grid not in GRIDS:
            raise GlmkitError(f"--grid: unknown grid {grid!r} (choose from {', '.join(GRIDS)})")
        if group_size is None:
            return cls(bits, DEFAULT_GROUP_SIZE, quantizer, grid, dict(PRESET_GROUPS.get(preset, {})))
        return cls(bits, group_size or None, quantizer, grid)

    def on_preset(self, preset: str) -> QuantPlan:
        """Another preset with this plan's quantizer, grid and (when it replaced the preset's own) group size."""
        own = self.groups or self.group_size == DEFAULT_GROUP_SIZE
        return QuantPlan.from_preset(preset, group_size=None if own else self.group_size or 0,
                                     quantizer=self.quantizer, grid=self.grid)

    def quant_for(self, spec: TensorSpec) -> tuple[int, int | None] | None:
        """(bits, group_size) for this tensor, or None to store it as F32."""
        bits = self.bits.get(spec.role)
        if bits is None or len(spec.shape) != 2:
            return None
        return bits, self.groups.get(spec.role, self.group_size)

    def scheme_for(self, bits: int) -> str:
        """The manifest's quant scheme of a `bits`-bit weight."""
        return "nl4" if self.grid == "nl" and bits == 4 else "symmetric"

    def stored(self, spec: TensorSpec) -> list[PlannedTensor]:
        """The tensors this logical tensor becomes: one F32 tensor, or packed U8 + F32 `.qs` scales."""
        quant = self.quant_for(spec)
        if quant is None:
            return [PlannedTensor(spec.name, "F32", spec.shape)]
        bits, group = quant
        out_features, in_features = spec.shape
        return [PlannedTensor(spec.name, "U8", (out_features, packed_row_bytes(in_features, bits))),
                PlannedTensor(spec.name + ".qs", "F32", scales_shape((out_features, in_features), group))]

    def to_json(self) -> dict[str, object]:
        # no "group_sizes" key without overrides: such a plan records what it always did (the same model hash)
        groups = {"group_sizes": dict(sorted(self.groups.items()))} if self.groups else {}
        return {"bits": dict(sorted(self.bits.items())), "group_size": self.group_size, **groups,
                "quantizer": self.quantizer, "grid": self.grid}
