#!/usr/bin/env python3
"""Train a tiny GLM-5 (``glm_moe_dsa``) model on Python standard-library sources: the quality reference fixture.

Random tiny models cannot measure quantization quality (DESIGN section 3: their router and indexer decisions
sit near ties); this one has real structure. Needs the ``oracle`` extra (torch 2.13.0, transformers 5.23.0);
nothing in ``glmkit`` imports this file.

    python tools/train_tiny.py --out tests/fixtures/tiny-trained     # ~2,040 CPU-seconds: ~17 minutes of 2 cores
    python tools/train_tiny.py --windows-only   # rewrite eval_tokens.json / calib_tokens.json only (seconds)

What it builds (reusing tools/make_oracle.py: tokenizer, config, weight layout, MTP reference, oracle):

- ``GlmMoeDsaForCausalLM`` (transformers' own modules, eager attention, fp32): hidden 128, 4 layers (1 dense,
  3 MoE with 16 routed experts, top-4, 4 groups, 1 shared expert), MLA, DSA with ``index_topk`` 32 on
  128-token windows (sparse for every position past 32), indexer layer types full, full, **shared**, full;
  plus the MTP layer (``make_oracle.MtpLayer``) trained as a next-next-token head (loss weight 0.3).
- DSA indexer: transformers runs it under ``no_grad``, so it is trained the DeepSeek-V3.2 way with a KL loss
  towards the main attention (summed over heads, inputs detached): dense warm-up (``index_topk`` = window)
  for the first 30% of the steps, then sparse with the KL restricted to the selected keys. Indexer heads stay
  in negated pairs (make_oracle's trick: index scores never tie at exactly 0).
- Router: ``e_score_correction_bias`` updated aux-loss-free (DeepSeek-V3: +rate towards underloaded experts).
- Data: the top-level ``*.py`` files of this Python's standard library, each ended by ``<|endoftext|>``;
  ``EVAL_FILES`` are held out (never trained on) and become ``eval_tokens.json``; ``calib_tokens.json``
  holds windows of training text for ``glm-calibrate``.
- Output (``--out``): ``config.json``, ``generation_config.json``, tokenizer files (chat template included),
  ``model.safetensors`` (BF16, per-expert names, MTP layer at index 4), ``oracle.json`` (make_oracle's
  ``run_oracle`` on a held-out code prompt, weights read back from disk), ``eval_tokens.json``,
  ``calib_tokens.json`` and ``training.json`` (hyper-parameters, loss curve, time).

Seeds are fixed, but PyTorch's CPU kernels are not bit-for-bit reproducible from run to run and training
amplifies the differences: two runs on the same machine ended at loss 2.828 and 2.829 with different bytes.
The committed fixture is the reference; its oracle is what transformers computes from its weights.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_oracle as mo  # noqa: E402  (tools/ is not a package on sys.path when run as a script)

EVAL_FILES = ("heapq.py", "calendar.py", "graphlib.py", "sched.py", "netrc.py")
WINDOW = 128
EVAL_WINDOWS = 320  # every 128-token window of the 41,395 held-out tokens: 40,640 scored, top-1 SE ~0.05%
CALIB_WINDOWS = 16
MTP_WEIGHT = 0.3
DENSE_WARMUP = 0.3  # fraction of the steps with dense DSA (indexer warm-up)
BIAS_RATE = 0.01  # e_score_correction_bias update per step (aux-loss-free balancing)
ORACLE_PROMPT_TOKENS = 64  # > index_topk: the oracle exercises sparse attention

VARIANT = mo.Variant(
    name="tiny-trained",
    seed_offset=2000,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    intermediate_size=384,
    moe_intermediate_size=96,  # down_proj rows of 96: a full and a partial group of 64
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    index_topk=32,
    index_n_heads=8,
    index_head_dim=32,
    rope_theta=10_000.0,
    legacy_rope_theta=False,
    schedule={"index_topk_freq": 2, "index_skip_topk_offset": 2},  # full, full, shared, full
    expected_indexer_types=("full", "full", "shared", "full"),
    fp8=False,
    num_shards=1,
    messages=(("user", "Sort a list with heapq."),),
)


# ---------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------


def corpus(tok: mo.TokenizerBundle) -> tuple[list[int], list[int], dict[str, Any]]:
    """(training token stream, held-out token stream, description) from the stdlib's top-level sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    eos = tok.eos_ids[0]
    train: list[int] = []
    held: list[int] = []
    names = sorted(p.name for p in stdlib.glob("*.py"))
    for name in names:
        ids = tok.tokenizer.encode((stdlib / name).read_text(encoding="utf-8"), add_special_tokens=False).ids
        (held if name in EVAL_FILES else train).extend(ids + [eos])
    info = {"stdlib": str(stdlib), "train_files": len(names) - len(EVAL_FILES), "train_tokens": len(train),
            "eval_files": list(EVAL_FILES), "eval_tokens": len(held)}
    return train, held, info


def spread_windows(stream: list[int], count: int, length: int) -> list[list[int]]:
    """`count` non-overlapping windows of `length` tokens spread evenly over the stream."""
    step = (len(stream) - length) // max(count - 1, 1)
    if step < length:
        raise RuntimeError(f"stream of {len(stream)} tokens is too short for {count} windows of {length}")
    return [stream[i * step: i * step + length] for i in range(count)]


def write_windows(out: Path, train_stream: list[int], held: list[int]) -> None:
    """eval_tokens.json (held-out windows) and calib_tokens.json (training-text windows) in `out`."""
    for name, stream, count in (("eval_tokens.json", held, EVAL_WINDOWS), ("calib_tokens.json", train_stream,
                                                                            CALIB_WINDOWS)):
        windows = spread_windows(stream, count, WINDOW)
        (out / name).write_text(json.dumps(windows, separators=(",", ":")) + "\n")


# ---------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------


class Hooks:
    """Router loads (for the bias update) and the DSA indexer KL loss, collected during a forward."""

    def __init__(self, model: Any, mtp: mo.MtpLayer) -> None:
        self.loads: dict[Any, torch.Tensor] = {}
        self.index_losses: list[torch.Tensor] = []
        self.sparse = False
        self.handles = []
        layers = list(model.model.layers) + [mtp]
        for layer in layers:
            gate = getattr(layer.mlp, "gate", None)
            if isinstance(gate, mo.GlmMoeDsaTopkRouter):
                self.handles.append(gate.register_forward_hook(self._router))
            if layer.self_attn.indexer is not None:
                self.handles.append(layer.self_attn.register_forward_hook(self._attention, with_kwargs=True))

    def _router(self, mod: Any, _args: Any, output: tuple[torch.Tensor, ...]) -> None:
        idx = output[2]
        counts = torch.bincount(idx.reshape(-1), minlength=mod.num_experts).float()
        self.loads[mod] = self.loads.get(mod, 0) + counts

    def _attention(self, mod: Any, _args: Any, kwargs: dict[str, Any], output: tuple[Any, ...]) -> None:
        _, attn_weights, topk = output
        hidden = kwargs["hidden_states"].detach()
        with torch.no_grad():
            q_resid = mod.q_a_layernorm(mod.q_a_proj(hidden))
        scores = batched_index_scores(mod.indexer, hidden, q_resid, kwargs["position_embeddings"])
        seq = scores.shape[-1]
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        allowed = causal.expand_as(scores)
        if self.sparse:
            selected = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, topk.long(), True)
            allowed = allowed & selected
        target = attn_weights.detach().float().sum(dim=1)  # [B, S, T]
        target = (target * allowed) / (target * allowed).sum(-1, keepdim=True).clamp_min(1e-12)
        logp = F.log_softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        kl = torch.where(target > 0, target * (target.clamp_min(1e-12).log() - logp), torch.zeros_like(target))
        self.index_losses.append(kl.sum(-1).mean())

    def reset(self) -> None:
        self.loads = {}
        self.index_losses = []


def batched_index_scores(mod: Any, hidden: torch.Tensor, q_resid: torch.Tensor, cos_sin: Any) -> torch.Tensor:
    """The indexer's scores `I[b, t, j]` with autograd (transformers' indexer runs under no_grad); as
    ``make_oracle.index_scores`` but for a whole batch."""
    bsz, seq, _ = hidden.shape
    q = mod.wq_b(q_resid).view(bsz, seq, mod.n_heads, mod.head_dim)
    q_rot, q_pass = torch.split(q, [mod.qk_rope_head_dim, mod.head_dim - mod.qk_rope_head_dim], dim=-1)
    k = mod.k_norm(mod.wk(hidden)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [mod.qk_rope_head_dim, mod.head_dim - mod.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = mo.apply_rotary_pos_emb_interleave(q_rot, k_rot, *cos_sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)  # [B, S, H, D]
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)  # [B, S, D]
    s = torch.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)) * mod.softmax_scale)  # [B, S, H, T]
    wts = mod.weights_proj(hidden) * (mod.n_heads ** -0.5)  # [B, S, H]
    return torch.matmul(wts.unsqueeze(-2), s).squeeze(-2)  # [B, S, T]


def indexers(model: Any, mtp: mo.MtpLayer) -> list[Any]:
    return [layer.self_attn.indexer for layer in list(model.model.layers) + [mtp]
            if layer.self_attn.indexer is not None]


@torch.no_grad()
def keep_negated_pairs(model: Any, mtp: mo.MtpLayer) -> None:
    """Indexer head 2j+1's wq_b rows = minus head 2j's (index scores then never tie at exactly 0)."""
    for ix in indexers(model, mtp):
        wq = ix.wq_b.weight.view(ix.n_heads, ix.head_dim, -1)
        even = (wq[0::2] - wq[1::2]) / 2
        wq[0::2] = even
        wq[1::2] = -even


@torch.no_grad()
def update_router_bias(hooks: Hooks) -> None:
    for router, load in hooks.loads.items():
        router.e_score_correction_bias += BIAS_RATE * torch.sign(load.mean() - load)


def train(config: Any, train_stream: list[int], steps: int, batch: int, lr: float, seed: int
          ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Train from make_oracle's random init; returns (fp32 weights under per-expert HF names, log)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    init = mo.draw_weights(VARIANT, config, seed)
    model, mtp = mo.build_models(config, mo.decode_checkpoint(mo.encode_checkpoint(VARIANT, init)))
    model.train()
    mtp.train()
    params = [p for p in list(model.parameters()) + list(mtp.parameters()) if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    hooks = Hooks(model, mtp)
    data = torch.tensor(train_stream, dtype=torch.long)
    vocab = config.vocab_size
    log: list[dict[str, float]] = []
    dense_steps = int(steps * DENSE_WARMUP)
    t0, cpu0 = time.time(), time.process_time()
    for step in range(steps):
        sparse = step >= dense_steps
        for ix in indexers(model, mtp):
            ix.index_topk = VARIANT.index_topk if sparse else WINDOW
        hooks.sparse = sparse
        hooks.reset()
        starts = torch.randint(0, len(data) - WINDOW, (batch,), generator=gen)
        ids = torch.stack([data[s: s + WINDOW] for s in starts.tolist()])
        hidden = model.model(ids, use_cache=False).last_hidden_state
        logits = model.lm_head(hidden)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
        mtp_logits = mtp.forward_logits(model, ids, hidden)  # row i predicts ids[i+2]
        mtp_loss = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, vocab), ids[:, 2:].reshape(-1))
        index_loss = torch.stack(hooks.index_losses).mean()
        (loss + MTP_WEIGHT * mtp_loss + index_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        keep_negated_pairs(model, mtp)
        update_router_bias(hooks)
        entry = {"step": step + 1, "loss": loss.item(), "mtp_loss": mtp_loss.item(), "index_kl": index_loss.item(),
                 "sparse": sparse, "seconds": round(time.time() - t0, 1)}
        log.append(entry)
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step + 1}/{steps} loss {entry['loss']:.3f} mtp {entry['mtp_loss']:.3f} "
                  f"index_kl {entry['index_kl']:.3f} {'sparse' if sparse else 'dense'} {entry['seconds']:.0f}s",
                  flush=True)
    for ix in indexers(model, mtp):
        ix.index_topk = VARIANT.index_topk
    for h in hooks.handles:
        h.remove()
    return hf_weights(model, mtp, config), {"steps": log, "seconds": round(time.time() - t0, 1),
                                            "cpu_seconds": round(time.process_time() - cpu0, 1)}


def hf_weights(model: Any, mtp: mo.MtpLayer, config: Any) -> dict[str, torch.Tensor]:
    """fp32 tensors under the checkpoint's names: per-expert experts, MTP layer at index num_hidden_layers."""
    n = config.num_hidden_layers
    out: dict[str, torch.Tensor] = {}
    state = {k: t.detach().clone() for k, t in model.state_dict().items()}
    state.update({f"model.layers.{n}.{k}": t.detach().clone() for k, t in mtp.state_dict().items()})
    inter = config.moe_intermediate_size
    for name, t in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t.float()
    return out


# ---------------------------------------------------------------------------------------------------------
# Fixture
# ---------------------------------------------------------------------------------------------------------


def build_oracle(config: Any, stored: dict[str, torch.Tensor], held: list[int], tok: mo.TokenizerBundle
                 ) -> tuple[dict[str, Any], int]:
    """make_oracle's oracle on the first held-out code prompt that has no near-ties (weights as stored)."""
    model, mtp = mo.build_models(config, mo.decode_checkpoint(stored))
    torch.set_grad_enabled(False)
    for attempt in range(mo.MAX_SEED_TRIES):
        start = 5000 + attempt * 97
        prompt_ids = held[start: start + ORACLE_PROMPT_TOKENS]
        try:
            return mo.run_oracle(VARIANT, config, model, mtp, prompt_ids, tok), start
        except mo.Rejected as exc:
            print(f"oracle prompt at held-out token {start} rejected: {exc}")
    raise RuntimeError("no held-out prompt without near-ties")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures/tiny-trained"))
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--windows-only", action="store_true",
                    help="only rewrite eval_tokens.json and calib_tokens.json (the corpus is deterministic)")
    args = ap.parse_args(argv)
    if mo.transformers.__version__ != mo.PINNED_TRANSFORMERS:
        print(f"warning: transformers {mo.transformers.__version__}, oracles are pinned to {mo.PINNED_TRANSFORMERS}")
    torch.set_num_threads(args.threads)
    t0 = time.time()
    tok = mo.build_tokenizer()
    train_stream, held, data_info = corpus(tok)
    if args.windows_only:
        write_windows(args.out, train_stream, held)
        return 0
    cfg = mo.make_config_dict(VARIANT, tok)
    config = mo.hf_config(cfg)
    if tuple(config.indexer_types) != VARIANT.expected_indexer_types:
        raise RuntimeError(f"indexer_types {config.indexer_types} != {VARIANT.expected_indexer_types}")
    print(f"train {data_info['train_tokens']} tokens, held out {data_info['eval_tokens']} "
          f"({', '.join(EVAL_FILES)}); {args.steps} steps x {args.batch} x {WINDOW} tokens")

    w32, log = train(config, train_stream, args.steps, args.batch, args.lr, args.seed)
    stored = mo.encode_checkpoint(VARIANT, w32)

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors*"):
        old.unlink()
    mo.write_json(out / "config.json", cfg)
    mo.write_json(out / "generation_config.json", mo.make_generation_config(tok))
    mo.write_tokenizer(tok, out)
    files = mo.write_weights(VARIANT, stored, out)
    stored = mo.read_weights(out, files)  # the oracle uses exactly what is on disk

    oracle, prompt_start = build_oracle(config, stored, held, tok)
    model, _ = mo.build_models(config, mo.decode_checkpoint(stored))
    messages = [{"role": role, "content": content} for role, content in VARIANT.messages]
    prompt_text = mo.tok_render(messages)
    mo.verify_with_transformers(VARIANT, out, model, messages, prompt_text,
                                tok.tokenizer.encode(prompt_text, add_special_tokens=False).ids, tok)

    tail = log["steps"][-10:]
    summary = {
        "final_loss": round(sum(e["loss"] for e in tail) / len(tail), 4),
        "final_mtp_loss": round(sum(e["mtp_loss"] for e in tail) / len(tail), 4),
        "final_index_kl": round(sum(e["index_kl"] for e in tail) / len(tail), 4),
        "train_seconds": log["seconds"],
        "train_cpu_seconds": log["cpu_seconds"],  # all threads; wall time depends on what else runs
    }
    oracle["meta"] = {
        "variant": VARIANT.name,
        "trained": True,
        "seed": args.seed,
        "transformers": mo.transformers.__version__,
        "torch": torch.__version__,
        "tokenizers": mo.tokenizers.__version__,
        "python": sys.version.split()[0],
        "tokenizer_corpus": {"stdlib_files": mo.CORPUS_FILES, "sha256": tok.corpus_sha256},
        "dtype": "float32",
        "attn_implementation": "eager",
        "weights": "bf16 upcast to fp32",
        "indexer_types": list(config.indexer_types),
        "mtp_indexer_type": "full",
        "mlp_layer_types": list(config.mlp_layer_types),
        "prompt": f"held-out stdlib code, tokens {prompt_start}..{prompt_start + ORACLE_PROMPT_TOKENS} of the "
                  "held-out stream (no chat template: the model only saw code)",
        "prompt_text": tok.tokenizer.decode(oracle["prompt_ids"]),
        "continuation_text": tok.tokenizer.decode(oracle["full_ids"][len(oracle["prompt_ids"]):]),
        "n_prompt": len(oracle["prompt_ids"]),
        "n_full": len(oracle["full_ids"]),
        **summary,
    }
    oracle = {"meta": oracle.pop("meta"), **oracle}
    mo.write_oracle(out / "oracle.json", oracle)
    write_windows(out, train_stream, held)
    training = {
        "variant": VARIANT.name,
        "hyperparameters": {"steps": args.steps, "batch": args.batch, "window": WINDOW, "lr": args.lr,
                            "optimizer": "AdamW(0.9, 0.95), wd 0.01 on matrices, warmup 5%, cosine to 10%",
                            "mtp_weight": MTP_WEIGHT, "dense_warmup_fraction": DENSE_WARMUP,
                            "router_bias_rate": BIAS_RATE, "threads": args.threads, "seed": args.seed},
        "data": data_info,
        **summary,
        "total_seconds": round(time.time() - t0, 1),
        "loss_every_10_steps": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in e.items()}
                                for e in log["steps"][::10] + log["steps"][-1:]],
    }
    mo.write_json(out / "training.json", training)
    dbg = oracle["debug"]
    print(f"[{VARIANT.name}] final loss {summary['final_loss']} (mtp {summary['final_mtp_loss']}) in "
          f"{summary['train_seconds']:.0f}s train / {training['total_seconds']:.0f}s total; oracle P="
          f"{len(oracle['prompt_ids'])} N={len(oracle['full_ids'])} tf_margin={dbg['tf_margin_min']:.2e} "
          f"router_gap={dbg['router_gap_min']:.2e} index_gap_rel={dbg['indexer_gap_min_rel']:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
