"""tools/bench.py's summary: the bandwidth ceiling per row (a GPU row divides by its own memory's bandwidth), and
the per-round fractions shown beside it; tools/bench_stream.py's summary over rounds and its cgroups (v1 and v2, on
a fake tree); tools/bench_constrained.py's synthetic vocabulary."""

from __future__ import annotations

from tokenizers import Tokenizer

from glmkit.generate.constraint import GrammarTokenizer, json_grammar
from tools.bench import markdown, ratios, summarize
from tools.bench_constrained import synthetic_tokenizer
from tools.bench_stream import new_cgroups, summary


def run(decode: float, **extra) -> dict:
    return {"device": "d", "decode_tok_s_mtp_off": decode, **extra}


def test_gpu_rows_use_their_own_bandwidth():
    results = {"auto": [run(200.0), run(220.0)], "opencl:0:0": [run(50.0, device_read_gbs=500.0),
                                                                 run(60.0, device_read_gbs=520.0)]}
    table = summarize(results, bytes_per_token=100_000_000, bandwidth=40.0, container=1)
    assert table["auto"]["bandwidth_gbs"] == 40.0
    assert abs(table["auto"]["ceiling_fraction"] - 210.0 / 400.0) < 1e-12  # 40 GB/s / 100 MB = 400 tok/s
    assert table["opencl:0:0"]["bandwidth_gbs"] == 520.0
    assert abs(table["opencl:0:0"]["ceiling_fraction"] - 55.0 / 5200.0) < 1e-12
    meta = {"preset": "q4", "container_bytes": 1, "cpu": "x", "cores": 2, "load_start": 0.0, "runs": 2,
            "bytes_per_token": 100_000_000, "bandwidth_gbs": 40.0, "ceiling_tok_s": 400.0}
    text = markdown(table, meta)
    assert "opencl:0:0: its ceiling is the device's own read bandwidth, 520.0 GB/s = 5200 tok/s." in text
    assert "auto: its ceiling" not in text


def test_per_round_fractions_beside_the_ceiling_fraction():
    """A host row also gets each round's decode over the bandwidth sampled before that round; the ceiling fraction
    stays the median decode over the best sample."""
    results = {"auto": [run(200.0), run(180.0), run(220.0)]}
    table = summarize(results, bytes_per_token=100_000_000, bandwidth=50.0, container=1,
                      round_bandwidth=[40.0, 30.0, 50.0])
    assert [round(f, 6) for f in table["auto"]["round_ceiling_fractions"]] == [0.5, 0.6, 0.44]
    assert abs(table["auto"]["ceiling_fraction"] - 200.0 / 500.0) < 1e-12
    line = ratios(table)[0]
    assert "40% of the ceiling" in line and "per round against that round's bandwidth sample " \
        "50% / 60% / 44%" in line


def test_quality_grids_reconstructs_values_on_its_grids():
    """tools/quality_grids.py's simulated grids: weights already on a table's levels (one scale per group of 64)
    come back unchanged, and the uniform int3 candidate is the converter's own quantization."""
    import numpy as np

    from glmkit.format.packing import dequantize, pack, quantize
    from tools.quality_grids import NL3_NORMAL, NL4_IQ4, int_dequant, nl_dequant

    rng = np.random.default_rng(0)
    for table in (NL3_NORMAL, NL4_IQ4):
        scales = rng.uniform(0.001, 0.01, (6, 2)).astype(np.float32)
        idx = rng.integers(0, len(table), (6, 128))
        idx[:, 0] = idx[:, 64] = np.argmax(np.abs(table))  # each group reaches the table's largest level
        w = (table[idx] * np.repeat(scales, 64, axis=1)).astype(np.float32)
        np.testing.assert_allclose(nl_dequant(w, table), w, rtol=1e-5, atol=1e-9)
    w = rng.standard_normal((5, 96)).astype(np.float32)
    codes, s = quantize(w, 3, 64)
    np.testing.assert_array_equal(int_dequant(w, 3, 64, "absmax"), dequantize(pack(codes, 3), s, 3, 64, 96))


def test_stream_summary_pairs_each_run_with_the_base_run_of_its_round():
    """bench_stream --rounds: a cache run's ratio is taken against the base run of the same round and fraction (never
    another round's), failed runs are left out, and the I/O-bound shares are the cache runs' medians."""
    rows = [
        {"round": 0, "fraction": "0.7", "mode": "base", "mtp": False, "decode_tok_s": 50.0, "ttft_s": 2.0},
        {"round": 0, "fraction": "0.7", "mode": "cache", "mtp": False, "decode_tok_s": 100.0, "ttft_s": 1.0,
         "io_bound_tok_s": 200.0, "ttft_io_bound_s": 0.5},
        {"round": 1, "fraction": "0.7", "mode": "base", "mtp": False, "decode_tok_s": 40.0, "ttft_s": 2.2},
        {"round": 1, "fraction": "0.7", "mode": "cache", "mtp": False, "decode_tok_s": 60.0, "ttft_s": 1.2,
         "io_bound_tok_s": 200.0, "ttft_io_bound_s": 0.5},
        {"round": 2, "fraction": "0.7", "mode": "base", "mtp": False, "decode_tok_s": 10.0, "ttft_s": 2.2},
        {"round": 2, "fraction": "0.7", "mode": "cache", "mtp": False, "error": "timed out after 300 s"},
    ]
    lines = summary(rows)
    assert lines[0].startswith("summary over the rounds (5 of 6 runs finished)")
    cache = next(line for line in lines if line.startswith("0.7 cache"))
    assert "decode 80.00 (60.00-100.00) tok/s" in cache
    assert "1.75 (1.50-2.00)x base in its round" in cache  # 100 / 50 and 60 / 40; round 2's base has no partner
    assert "0.40 (0.30-0.50) of the decode I/O bound" in cache
    assert "TTFT 2.20 (2.00-2.40)x its I/O bound" in cache
    base = next(line for line in lines if line.startswith("0.7 base"))
    assert "x base" not in base and "decode 40.00 (10.00-50.00) tok/s" in base


def test_stream_cgroups_v1_and_v2(tmp_path):
    """bench_stream's child groups: under cgroup v2 one group below the process's with `memory.max` and `io.max`;
    under v1 a memory group and a blkio group, each below the process's group of that controller."""
    v2 = tmp_path / "v2"
    (v2 / "user.slice" / "me").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("memory io\n")
    proc = tmp_path / "proc-v2"
    proc.write_text("0::/user.slice/me\n")
    (group,) = new_cgroups(1 << 30, 5 * 10**8, "254:0", "run", proc_cgroup=proc, sysfs=v2)
    assert group == v2 / "user.slice" / "me" / "run"
    assert (group / "memory.max").read_text() == str(1 << 30)
    assert (group / "io.max").read_text() == "254:0 rbps=500000000"
    v1 = tmp_path / "v1"
    for controller in ("memory", "blkio"):
        (v1 / controller / "jobs").mkdir(parents=True)
    proc = tmp_path / "proc-v1"
    proc.write_text("9:blkio:/jobs\n4:memory:/jobs\n1:name=systemd:/x\n")
    memory, blkio = new_cgroups(1 << 30, 5 * 10**8, "254:0", "run", proc_cgroup=proc, sysfs=v1)
    assert (memory / "memory.limit_in_bytes").read_text() == str(1 << 30) and memory.parent == v1 / "memory" / "jobs"
    assert (blkio / "blkio.throttle.read_bps_device").read_text() == "254:0 500000000"
    assert new_cgroups(None, None, proc_cgroup=proc, sysfs=v1) == []
    (only,) = new_cgroups(1 << 20, None, name="m", proc_cgroup=proc, sysfs=v1)  # no throttle: no blkio group
    assert only == v1 / "memory" / "jobs" / "m"


def test_the_synthetic_vocabulary_is_byte_level_text_the_grammar_library_reads(tmp_path):
    tok = Tokenizer.from_file(str(synthetic_tokenizer(2000, tmp_path / "tokenizer.json")))
    assert tok.get_vocab_size() == 2000
    spaced = next(t for t in tok.get_vocab() if t.startswith("\u0120") and len(t) > 2)  # a leading space
    assert tok.decode([tok.token_to_id(spaced)]) == " " + spaced[1:]
    gt = GrammarTokenizer(tok, 2000, (1999,))
    assert gt.constraint(json_grammar({"type": "integer"})).allowed_bits().any() and gt.ll.vocab_size == 2000
