"""`glm-validate` against the transformers oracles of both tiny fixtures (DESIGN section 3)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from glmkit.cli.validate import main as validate_main
from glmkit.format.reader import Container
from tests.runtime_support import FIXTURES, HUGE_INTEGER, VARIANTS, Snapshots, oracle


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory: pytest.TempPathFactory) -> Snapshots:
    return Snapshots(tmp_path_factory)


def run_validate(capsys: pytest.CaptureFixture[str], snapshot: Path, oracle_path: Path, *args: str
                 ) -> tuple[int, dict[str, Any] | None, str]:
    """(exit code, the --json result or None, stderr)."""
    rc = validate_main([str(snapshot), str(oracle_path), "--json", *args])
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if out.strip() else None), err


def write_oracle(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data))
    return path


# ---- exact (f32) ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mtp", [True, False], ids=["mtp", "no-mtp"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_f32_matches_the_oracle_exactly(snapshots, capsys, variant, mtp):
    args = [] if mtp else ["--no-mtp"]
    rc, result, err = run_validate(capsys, snapshots(variant), FIXTURES / variant / "oracle.json", *args)
    assert rc == 0 and err == ""
    ref = oracle(variant)
    tf = result["teacher_forcing"]
    assert tf["match"] == tf["total"] == len(ref["full_ids"])
    assert tf["first_mismatch"] is None
    # DESIGN section 3: the tiny models' logits are ~2 std; wrong eps alone moves them by 7.7e-5
    assert tf["max_abs_logit_diff"] <= 1e-4 * tf["logit_scale"], tf
    assert tf["max_abs_logit_diff"] < 5e-5, tf  # measured ~5e-6
    greedy = result["greedy"]
    assert greedy["match"] == greedy["total"] == len(ref["full_ids"]) - len(ref["prompt_ids"])
    assert greedy["first_mismatch"] is None
    assert greedy["mtp"] is mtp
    if mtp:
        assert 0 <= greedy["mtp_acceptance"] <= 1
        assert greedy["tokens_per_forward"] >= 1
    else:
        assert greedy["mtp_acceptance"] is None
    head = result["mtp"]
    assert head["match"] == head["total"] == len(ref["full_ids"]) - 1
    assert head["max_abs_logit_diff"] <= 1e-4 * head["logit_scale"], head
    assert result["passed"] is True


@pytest.mark.parametrize("variant", VARIANTS)
def test_text_report_says_pass(snapshots, capsys, variant):
    rc = validate_main([str(snapshots(variant)), str(FIXTURES / variant / "oracle.json")])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.splitlines()[-1] == "PASS"
    assert "teacher forcing" in out and "greedy" in out and "MTP head" in out


# ---- quantized: agreement numbers, and exact mode must fail --------------------------------------

@pytest.mark.parametrize("preset", ["q8", "q4", "q2"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_quantized_reports_agreement_and_fails_exact_mode(snapshots, capsys, variant, preset):
    snapshot, oracle_path = snapshots(variant, preset), FIXTURES / variant / "oracle.json"
    rc, result, _ = run_validate(capsys, snapshot, oracle_path)
    # random tiny models sit near router / indexer ties: quantization noise flips them (DESIGN section 3)
    assert rc == 1 and result["passed"] is False
    for part in ("teacher_forcing", "greedy", "mtp"):
        p = result[part]
        assert 0 <= p["match"] <= p["total"] and p["total"] > 0, (part, p)
    tf = result["teacher_forcing"]
    assert tf["match"] < tf["total"]
    assert 0 <= tf["first_mismatch"] < tf["total"]
    assert 0 < tf["max_abs_logit_diff"] and 0 < tf["logit_scale"]
    assert 0 < result["mtp"]["max_abs_logit_diff"]

    rc, result, _ = run_validate(capsys, snapshot, oracle_path, "--min-agreement", "0")
    assert rc == 0 and result["passed"] is True
    rc, result, _ = run_validate(capsys, snapshot, oracle_path, "--min-agreement", "1")
    assert rc == 1 and result["passed"] is False


# ---- the check can fail ---------------------------------------------------------------------------

def _corrupt(variant: str, change) -> dict[str, Any]:
    data = copy.deepcopy(oracle(variant))
    change(data)
    return data


def _other(token: int) -> int:
    return (token + 1) % 384


@pytest.mark.parametrize("variant", VARIANTS)
def test_corrupted_tf_pred_fails(snapshots, capsys, tmp_path, variant):
    position = 30

    def change(d):
        d["tf_pred"][position] = _other(d["tf_pred"][position])

    path = write_oracle(tmp_path / "oracle.json", _corrupt(variant, change))
    rc, result, _ = run_validate(capsys, snapshots(variant), path)
    assert rc == 1 and result["passed"] is False
    tf = result["teacher_forcing"]
    assert (tf["match"], tf["first_mismatch"]) == (tf["total"] - 1, position)
    assert result["greedy"]["match"] == result["greedy"]["total"]  # the other checks still pass


def test_corrupted_continuation_logits_and_mtp_each_fail(snapshots, capsys, tmp_path):
    variant = "tiny-bf16"
    snapshot = snapshots(variant)
    n_prompt = len(oracle(variant)["prompt_ids"])

    def continuation(d):
        d["full_ids"][n_prompt + 3] = _other(d["full_ids"][n_prompt + 3])

    def logit(d):
        d["tf_logits"][5][7] += 0.01

    def mtp_pred(d):
        d["mtp"]["pred"][0] = _other(d["mtp"]["pred"][0])

    for change, part in ((continuation, "greedy"), (logit, "teacher_forcing"), (mtp_pred, "mtp")):
        path = write_oracle(tmp_path / f"{change.__name__}.json", _corrupt(variant, change))
        rc, result, _ = run_validate(capsys, snapshot, path)
        assert rc == 1 and result["passed"] is False, change.__name__
        if part == "greedy":
            assert result["greedy"]["first_mismatch"] == 3
        elif part == "teacher_forcing":
            assert result["teacher_forcing"]["match"] == result["teacher_forcing"]["total"]
            assert result["teacher_forcing"]["max_abs_logit_diff"] > 5e-3
        else:
            assert result["mtp"]["match"] == result["mtp"]["total"] - 1


def test_continuation_through_an_eos_id_is_compared_in_full(snapshots, capsys, tmp_path):
    """An oracle made with EOS disabled (as transformers generates under `min_new_tokens`) continues past an EOS
    id: the greedy check generates as many tokens as the oracle holds, through that id."""
    variant = "tiny-bf16"
    ref = oracle(variant)
    continuation = ref["full_ids"][len(ref["prompt_ids"]):]
    snapshot = shutil.copytree(snapshots(variant), tmp_path / "snapshot")
    # the snapshot now ends generation at the continuation's sixth token
    (snapshot / "generation_config.json").write_text(json.dumps({"eos_token_id": [continuation[5]]}))
    for args in ([], ["--no-mtp"]):
        rc, result, err = run_validate(capsys, snapshot, FIXTURES / variant / "oracle.json", *args)
        greedy = result["greedy"]
        assert (greedy["match"], greedy["total"], greedy["first_mismatch"]) == (len(continuation),) * 2 + (None,)
        assert rc == 0 and result["passed"] is True and err == "", args


def flip_data_byte(snapshot: Path, tensor: str) -> Path:
    """Flip the lowest bit of the first byte of `tensor` in its data file (a float32's last mantissa bit: too
    small to change any prediction); returns that data file."""
    entry = Container(snapshot).manifest.tensors[tensor]
    path = snapshot / entry.file
    data = bytearray(path.read_bytes())
    data[entry.offset] ^= 1
    path.write_bytes(bytes(data))
    return path


def test_flipped_data_byte_is_one_clear_error(snapshots, capsys, tmp_path):
    snapshot = shutil.copytree(snapshots("tiny-bf16"), tmp_path / "snapshot")
    data_file = flip_data_byte(snapshot, "lm_head.weight")
    rc, result, err = run_validate(capsys, snapshot, FIXTURES / "tiny-bf16" / "oracle.json")
    assert rc == 1 and result is None
    assert len(err.splitlines()) == 1 and err.startswith(f"glm-validate: error: {data_file}: "), err
    assert "lm_head.weight" in err


# ---- bad input ------------------------------------------------------------------------------------

def _drop_logits(d):
    del d["tf_logits"]


BAD_ORACLES = {
    "tf_pred out of vocab": lambda d: d["tf_pred"].__setitem__(3, 384),
    "negative prompt id": lambda d: d["prompt_ids"].__setitem__(0, -1),
    "float id": lambda d: d["full_ids"].__setitem__(0, 1.5),
    "bool id": lambda d: d["tf_pred"].__setitem__(0, True),
    "tf_logits infinite": lambda d: d["tf_logits"][0].__setitem__(0, float("inf")),
    "prompt_ids missing": lambda d: d.pop("prompt_ids"),
    "tf_pred too short": lambda d: d["tf_pred"].pop(),
    "full_ids not starting with the prompt": lambda d: d["full_ids"].__setitem__(0, _other(d["full_ids"][0])),
    "tf_logits missing a row": lambda d: d["tf_logits"].pop(),
    "tf_logits missing a column": lambda d: [row.pop() for row in d["tf_logits"]],
    "tf_logits ragged": lambda d: d["tf_logits"][2].pop(),
    "tf_logits not numbers": lambda d: d["tf_logits"][2].__setitem__(0, "x"),
    "mtp pred too short": lambda d: d["mtp"]["pred"].pop(),
    "mtp pred out of vocab": lambda d: d["mtp"]["pred"].__setitem__(0, 999),
    "mtp logits wrong shape": lambda d: d["mtp"]["logits"].pop(),
    "mtp not an object": lambda d: d.__setitem__("mtp", [1, 2]),
}


@pytest.mark.parametrize("case", list(BAD_ORACLES))
def test_bad_oracle_is_one_clear_error(snapshots, capsys, tmp_path, case):
    path = write_oracle(tmp_path / "oracle.json", _corrupt("tiny-bf16", BAD_ORACLES[case]))
    rc, result, err = run_validate(capsys, snapshots("tiny-bf16"), path)
    assert rc == 1 and result is None
    assert len(err.splitlines()) == 1 and err.startswith("glm-validate: error: "), err
    assert str(path) in err


@pytest.mark.parametrize("content", ["", "{not json", "[1, 2, 3]", "\"text\"", "\udcff", "[" * 10_000 + "]" * 10_000,
                                     '{"prompt_ids": [1], "x": ' + HUGE_INTEGER + "}"])
def test_unreadable_oracle_is_one_clear_error(snapshots, capsys, tmp_path, content):
    path = tmp_path / "oracle.json"
    path.write_bytes(content.encode("utf-8", "surrogateescape"))
    rc, result, err = run_validate(capsys, snapshots("tiny-bf16"), path)
    assert rc == 1 and result is None
    assert len(err.splitlines()) == 1 and err.startswith(f"glm-validate: error: {path}"), err


@pytest.mark.parametrize("extra", [1, 10_000])
def test_an_oracle_longer_than_the_context_is_refused_before_any_work(snapshots, capsys, tmp_path, monkeypatch, extra):
    """full_ids past the model's positions (as glm-run and glm-perplexity refuse them): one line, nothing run."""
    snapshot = snapshots("tiny-bf16")
    context = Container(snapshot).config.max_position_embeddings

    def longer(d):
        d["full_ids"] += [d["full_ids"][-1]] * (context + extra - len(d["full_ids"]))
        d["tf_pred"] = list(d["full_ids"])
        del d["tf_logits"], d["mtp"]

    path = write_oracle(tmp_path / "oracle.json", _corrupt("tiny-bf16", longer))
    monkeypatch.setattr("glmkit.cli.validate.validate", lambda *a, **k: pytest.fail("validated past the context"))
    rc, result, err = run_validate(capsys, snapshot, path)
    assert rc == 1 and result is None
    assert err == (f"glm-validate: error: {path}: full_ids has {context + extra} tokens, more than the model's "
                   f"{context} positions\n")


def test_missing_inputs_are_one_clear_error(snapshots, capsys, tmp_path):
    oracle_path = FIXTURES / "tiny-bf16" / "oracle.json"
    for args in ([str(snapshots("tiny-bf16")), str(tmp_path / "missing.json")],
                 [str(snapshots("tiny-bf16")), str(tmp_path)],  # a directory, not a file
                 [str(tmp_path / "no-snapshot"), str(oracle_path)],
                 [str(FIXTURES / "tiny-bf16"), str(oracle_path)],  # the HF snapshot, not converted
                 [str(snapshots("tiny-bf16")), str(oracle_path), "--min-agreement", "1.5"]):
        rc = validate_main([*args, "--json"])
        out, err = capsys.readouterr()
        assert rc == 1 and out == "", args
        assert len(err.splitlines()) == 1 and err.startswith("glm-validate: error: "), (args, err)



@pytest.mark.parametrize("tolerance", ["nan", "-1", "inf"])
def test_a_logit_tolerance_no_difference_can_meet_is_refused_before_the_work(snapshots, capsys, monkeypatch,
                                                                            tolerance):
    """`--logit-tol` NaN or negative fails every snapshot, infinite passes any: one line before the model opens."""
    import glmkit.cli.validate as validate_cli

    monkeypatch.setattr(validate_cli, "engine_from_arguments", lambda *a, **k: pytest.fail("opened the model"))
    rc = validate_main([str(snapshots("tiny-bf16")), str(FIXTURES / "tiny-bf16" / "oracle.json"), "--logit-tol",
                        tolerance])
    out, err = capsys.readouterr()
    assert rc == 1 and out == "" and err == f"glm-validate: error: --logit-tol: must be a finite number >= 0, got " \
        f"{float(tolerance)}\n"

def test_oracle_without_logits_or_mtp_checks_predictions_only(snapshots, capsys, tmp_path):
    def strip(d):
        del d["tf_logits"], d["mtp"]

    path = write_oracle(tmp_path / "oracle.json", _corrupt("tiny-fp8", strip))
    rc, result, _ = run_validate(capsys, snapshots("tiny-fp8"), path)
    assert rc == 0 and result["passed"] is True
    assert "max_abs_logit_diff" not in result["teacher_forcing"] and "mtp" not in result
