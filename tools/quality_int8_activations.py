#!/usr/bin/env python3
"""What int8 activations cost in quality: the device decode step with int8-quantized inputs against the same step
with float inputs (`--float-activations`) and against the f32 reference, on the trained fixture.

    PYTHONPATH=. python tools/quality_int8_activations.py [--windows 24] [--presets q4 q8 q2]   # ~40 s
    PYTHONPATH=. python tools/quality_int8_activations.py --presets q4 --grids nl uniform     # both 4-bit grids

The trained fixture's routed and shared experts have 96 intermediate rows, not a whole number of 64-column
blocks, so the step would run them with float inputs. This tool pads them with zero rows (gate, up) and zero
columns (down) to 128: the model computes exactly the same function (silu(0) * 0 = 0 feeds zero columns), and
now every int4/int8 product of the step takes int8 inputs, experts included, as GLM-5's (2,048 rows) do.
The padded f32 model is checked against the original before anything is measured.

Per preset, teacher-forced over held-out windows (eval_tokens.json): prefill the first PREFIX tokens, then
decode the rest one token at a time through the step, and compare the logits of every decoded position:
KL(float inputs || int8 inputs), top-1 agreement between them, and KL(f32 || each) for scale.
Then the prompt's arithmetic (`--prompt`, the same table): each window prefilled whole with the placement a CPU
device measures for prompts (products on the host), where the routed experts with int8 inputs run as the fused
kernels (`OpenCLBackend`); every position's logits, float against int8 inputs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from glmkit.backends.devices import list_devices, pick  # noqa: E402
from glmkit.backends.opencl.backend import OpenCLBackend, Placement  # noqa: E402
from glmkit.backends.opencl.ops import Kernels  # noqa: E402
from glmkit.eval.metrics import kl_divergence, log_softmax  # noqa: E402
from glmkit.format.safetensors_file import read_header, read_tensor  # noqa: E402
from glmkit.generate.engine import Engine  # noqa: E402
from glmkit.model.glm5 import GlmMoeDsaModel  # noqa: E402
from tests.runtime_support import convert  # noqa: E402
from tools.synth import write_safetensors  # noqa: E402

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tiny-trained"
PREFIX = 16
PADDED = 128


def pad_experts(src: Path, dest: Path) -> Path:
    """A copy of the fixture whose expert MLPs have PADDED intermediate rows (zeros): the same function."""
    shutil.copytree(src, dest)
    path = dest / "model.safetensors"
    tensors = {name: read_tensor(path, info) for name, info in read_header(path).items()}
    for name, w in tensors.items():
        if ".experts." in name or ".shared_experts." in name:
            if name.endswith(("gate_proj.weight", "up_proj.weight")):
                tensors[name] = np.concatenate([w, np.zeros((PADDED - w.shape[0], w.shape[1]), w.dtype)])
            elif name.endswith("down_proj.weight"):
                tensors[name] = np.concatenate([w, np.zeros((w.shape[0], PADDED - w.shape[1]), w.dtype)], axis=1)
    write_safetensors(path, tensors)
    config = json.loads((dest / "config.json").read_text())
    config["moe_intermediate_size"] = PADDED
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Mean KL(P || Q) over rows of logits."""
    return float(kl_divergence(log_softmax(p_logits), log_softmax(q_logits)).mean())


def decoded_logits(engine: Engine, windows: list[list[int]]) -> np.ndarray:
    """Logits `[positions, V]` of every window position after PREFIX, each from a one-token forward."""
    model, out = engine.model, []
    for w in windows:
        cache = model.new_cache()
        model.forward(np.array(w[:PREFIX]), cache)
        out += [model.forward(np.array([t]), cache)[0][-1] for t in w[PREFIX:-1]]
    return np.stack(out)


def prompt_logits(engine: Engine, kernels: Kernels | None, float_activations: bool, windows: list[list[int]]
                  ) -> np.ndarray:
    """Logits `[positions, V]` of every window position, each window prefilled in one forward: on the NumPy reference
    (kernels None), else with a CPU device's prompt placement (products on the host, routed experts on the kernels)."""
    model = engine.model
    if kernels is not None:
        backend = OpenCLBackend(kernels, Placement(matmul="host", vector_prefill="host"),
                                int8_activations=not float_activations, model_bytes=engine.container.nbytes)
        model = GlmMoeDsaModel(engine.config, engine.experts, backend)
    return np.concatenate([model.forward(np.array(w), model.new_cache())[0] for w in windows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=24, help="held-out windows (default %(default)s)")
    ap.add_argument("--presets", nargs="+", default=["q4", "q8", "q2"])
    ap.add_argument("--grids", nargs="+", default=["nl"], choices=["nl", "uniform"],
                    help="4-bit grids to convert each preset with (glm-convert --grid; default nl)")
    ap.add_argument("--prompt", action="store_true", help="the prompt's arithmetic instead (windows prefilled whole)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/glmkit-x8-quality"))
    args = ap.parse_args(argv)
    shutil.rmtree(args.work, ignore_errors=True)
    padded = pad_experts(FIXTURE, args.work / "padded")
    windows = json.loads((FIXTURE / "eval_tokens.json").read_text())[:args.windows]
    reference = Engine(convert(padded, args.work / "f32", "f32"), "numpy", load_tokenizer=False)
    original = Engine(convert(FIXTURE, args.work / "f32-original", "f32"), "numpy", load_tokenizer=False)
    ids = np.array(windows[0])
    a, b = reference.model.forward(ids, reference.model.new_cache())[0], original.model.forward(
        ids, original.model.new_cache())[0]
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), "padding changed the model"
    kernels = Kernels(pick(list_devices())) if args.prompt else None
    want = prompt_logits(reference, None, True, windows) if args.prompt else decoded_logits(reference, windows)
    print(f"{len(want)} {'prefilled' if args.prompt else 'decoded'} positions over {len(windows)} windows; padded "
          f"model = original (max logit difference {np.abs(a - b).max():.1e})")
    print("| preset | KL(float || int8 inputs) | top-1 agreement | KL(f32 || float inputs) | KL(f32 || int8 inputs) |")
    print("|---|---|---|---|---|")
    for preset in args.presets:
        for grid in args.grids:
            snap = convert(padded, args.work / f"{preset}-{grid}", preset, "--grid", grid)
            if args.prompt:
                engine = Engine(snap, "numpy", load_tokenizer=False)
                got = {f: prompt_logits(engine, kernels, f, windows) for f in (True, False)}
            else:
                got = {f: decoded_logits(Engine(snap, "opencl", load_tokenizer=False, float_activations=f), windows)
                       for f in (True, False)}
            agree = float((got[True].argmax(-1) == got[False].argmax(-1)).mean())
            label = preset if len(args.grids) == 1 else f"{preset}, {grid} grid"
            print(f"| {label} | {kl(got[True], got[False]):.6f} | {agree:.2%} | {kl(want, got[True]):.5f} | "
                  f"{kl(want, got[False]):.5f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
