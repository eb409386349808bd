"""OpenCL C 1.2 kernels (`*.cl`) of the OpenCL backend; `glmkit.backends.opencl.program` builds them.

`source()` is the program text: the files concatenated in a fixed order (common helpers first).
`KERNEL_VERSION` is a digest of that text, so it changes whenever any kernel changes: it is part of the
OpenCL backend's `numerics` (prefill-cache entries are only reused under the same kernels).
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

FILES = ("common.cl", "norm.cl", "quant.cl", "rope.cl", "mlp.cl", "attention.cl", "indexer.cl", "kv.cl", "decode.cl",
         "sample.cl")


@cache
def source() -> str:
    here = Path(__file__).parent
    return "\n".join(f"/* ---- {name} ---- */\n" + (here / name).read_text() for name in FILES)


def kernel_version() -> str:
    return "k" + hashlib.sha256(source().encode()).hexdigest()[:10]
