#!/usr/bin/env python3
"""What GLM-5's *tensor count* costs, on a model with its layout and tiny dimensions.

    PYTHONPATH=. python tools/bench_glm5_shape.py          # ~1 minute; a 156 MB container under --work

78 layers (3 dense) + MTP, 256 routed experts top-8 in 8 groups, 1 shared, every layer's indexer: 119,110
stored tensors at q4, like the real model. The dimensions are tiny (hidden 64), so the times measure the
per-tensor and per-launch overheads, not the arithmetic. Reported:
- opening the container (manifest check, mapping, the weight views): seconds and RSS;
- building the OpenCL device decode step (kernel launches bound for 78 layers, 20,000 expert offsets);
- 10 decoded tokens on the step against the NumPy reference, after a prompt longer than `index_topk`, so the
  indexer's top-k selection is in play: with float inputs (`--float-activations`: the reference's arithmetic,
  max relative logit difference ~1e-5) and with the default int8 inputs (their rounding flips expert choices of
  this random model from about layer 17 on, and 78 random layers amplify that: the logits differ by tens of
  percent, so top-1 agreement is reported; tests/test_decode_step.py and tools/quality_int8_activations.py
  measure int8 inputs on the trained fixture);
- the same with `--max-file-size 24M`, so that layers' experts span several data files.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from glmkit.backends.numpy_backend import NumpyBackend  # noqa: E402
from glmkit.backends.opencl.backend import OpenCLBackend, Placement  # noqa: E402
from glmkit.backends.opencl.device import list_devices  # noqa: E402
from glmkit.backends.opencl.ops import Kernels  # noqa: E402
from glmkit.cli.convert import main as convert_main  # noqa: E402
from glmkit.format.reader import Container  # noqa: E402
from glmkit.model.expert_stream import ExpertStreamer  # noqa: E402
from glmkit.model.glm5 import GlmMoeDsaModel  # noqa: E402
from tools.bench_model import BENCH_CONFIG  # noqa: E402
from tools.synth import write_snapshot_streaming  # noqa: E402

# GLM-5's counts (layers, experts, groups, an indexer in every layer: index_topk_freq 1) at tiny widths
GLM5_SHAPE = {**BENCH_CONFIG, "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 78, "first_k_dense_replace": 3,
              "num_attention_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 16,
              "qk_rope_head_dim": 16, "v_head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 64,
              "n_routed_experts": 256, "n_group": 8, "topk_group": 4, "index_topk": 64, "index_n_heads": 2,
              "index_head_dim": 32, "index_topk_freq": 1, "max_position_embeddings": 4096, "eos_token_id": [511]}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(snapshot: Path, kernels: Kernels) -> None:
    before, start = rss_mb(), time.perf_counter()
    container = Container(snapshot)
    print(f"  open: {time.perf_counter() - start:.2f} s, RSS +{rss_mb() - before:.0f} MB "
          f"({len(container.manifest.tensors)} tensors, {len(container.manifest.files)} data files)")
    experts = ExpertStreamer(container)
    ref = GlmMoeDsaModel(container.config, experts, NumpyBackend())
    for label, int8 in (("float inputs", False), ("int8 inputs", True)):
        dev = GlmMoeDsaModel(container.config, experts, OpenCLBackend(kernels, Placement(), int8_activations=int8))
        before, start = rss_mb(), time.perf_counter()
        supported = dev.decodes_on_device()
        launches = sum(len(layer.head) + len(layer.tail) for layer in dev._step.layers) if supported else 0
        print(f"  decode step build ({label}): {time.perf_counter() - start:.2f} s, RSS +{rss_mb() - before:.0f} MB, "
              f"{launches} launches per token")
        ids = np.random.default_rng(0).integers(0, container.config.vocab_size, 80)
        caches = ref.new_cache(), dev.new_cache()
        ref.forward(ids[:70], caches[0])
        dev.forward(ids[:70], caches[1])
        worst, elapsed, same = 0.0, 0.0, 0
        for token in ids[70:]:
            want = ref.forward(np.array([token]), caches[0])[0]
            start = time.perf_counter()
            got = dev.forward(np.array([token]), caches[1])[0]
            elapsed += time.perf_counter() - start
            worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
            same += int(got.argmax() == want.argmax())
        print(f"  10 decoded tokens ({label}): max relative logit difference to NumPy {worst:.1e}, top-1 agreement "
              f"{same}/10, {elapsed / 10 * 1e3:.1f} ms per token on the step")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/glmkit-glm5-shape"))
    args = ap.parse_args(argv)
    devices = [d for d in list_devices() if d.kind == "cpu"]
    if not devices:
        print("bench_glm5_shape: no OpenCL CPU device", file=sys.stderr)
        return 1
    kernels = Kernels(devices[0])
    source = args.work / "source"
    if not (source / "config.json").is_file():
        write_snapshot_streaming(source, GLM5_SHAPE, shards=8)
    for name, flags in (("q4", []), ("q4-24M-files", ["--max-file-size", "24M"])):
        out = args.work / name
        if not (out / "manifest.json").is_file():
            with contextlib.redirect_stdout(io.StringIO()):
                assert convert_main([str(source), str(out), "--preset", "q4", "--quantizer", "absmax", "--quiet",
                                     *flags]) == 0
        print(f"{name}:")
        measure(out, kernels)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
