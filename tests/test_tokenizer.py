"""Tokenizer, chat template and streaming detokenization (glmkit.generate.tokenizer)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from glmkit.errors import GlmkitError
from glmkit.format.files import MAX_SIDE_FILE_BYTES
from glmkit.generate.tokenizer import ChatTokenizer, StreamDecoder
from tests.runtime_support import FIXTURES, VARIANTS, oracle

TEXTS = ["def main():\n    return 42\n", "héllo wörld ✓ 日本", "emoji 🙂🚀 and ñ, ß, Ω, 中文字符, ✓✓", "€", "🙂"]


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer(FIXTURES / "tiny-bf16")


# ---- chat template -------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_template_reproduces_the_oracle_prompt(variant):
    meta, ref = oracle(variant)["meta"], oracle(variant)
    tok = ChatTokenizer(FIXTURES / variant)
    kwargs = meta["prompt_template_kwargs"]
    text = tok.render_chat(meta["prompt_messages"], kwargs["enable_thinking"], kwargs["add_generation_prompt"])
    assert text == meta["prompt_text"]
    assert tok.encode_chat(meta["prompt_messages"], kwargs["enable_thinking"]) == ref["prompt_ids"]


def test_template_renders_roles_and_thinking(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "<think>plan</think>\nHello!"}, {"role": "user", "content": "Bye"}]
    history = "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|><think>plan</think>Hello!<|user|>\nBye"
    assert tok.render_chat(messages) == history + "<|assistant|><think>"
    assert tok.render_chat(messages, enable_thinking=False) == history + "<|assistant|><think></think>"
    assert tok.render_chat(messages, add_generation_prompt=False) == history
    ids = tok.encode_chat(messages, enable_thinking=True)
    assert ids != tok.encode_chat(messages, enable_thinking=False)
    assert ids[:2] == [tok.token_id("[gMASK]"), tok.token_id("<sop>")]
    assert tok.token_id("<|user|>") == 379 and tok.token_id("<|assistant|>") == 380


def test_special_tokens_encode_to_single_ids(tok):
    assert tok.encode("<|user|>") == [379]
    assert tok.encode("<|endoftext|>") == [372]
    assert tok.decode([379, 380]) == "<|user|><|assistant|>"


def test_missing_and_alternative_templates(tmp_path):
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    shutil.copy(FIXTURES / "tiny-bf16" / "tokenizer.json", snapshot)
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(GlmkitError, match="no chat template"):
        ChatTokenizer(snapshot).render_chat(messages)

    (snapshot / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ 1 + 1 }}"}]}))
    assert ChatTokenizer(snapshot).render_chat(messages) == "D2"
    (snapshot / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}")  # wins over the config's
    assert ChatTokenizer(snapshot).render_chat(messages) == "Jx"

    (snapshot / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(GlmkitError, match="roles must alternate"):
        ChatTokenizer(snapshot).render_chat(messages)
    (snapshot / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(GlmkitError, match="chat template"):
        ChatTokenizer(snapshot).render_chat(messages)


def test_template_is_sandboxed(tmp_path):
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    shutil.copy(FIXTURES / "tiny-bf16" / "tokenizer.json", snapshot)
    (snapshot / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(GlmkitError):
        ChatTokenizer(snapshot).render_chat([])


def test_bad_tokenizer_files(tmp_path):
    with pytest.raises(GlmkitError, match="tokenizer missing"):
        ChatTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(GlmkitError, match="cannot load tokenizer"):
        ChatTokenizer(tmp_path)
    shutil.copy(FIXTURES / "tiny-bf16" / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(GlmkitError, match="tokenizer_config.json"):
        ChatTokenizer(tmp_path)


def tokenizer_dir(tmp_path, edit=None, config: bool = True):
    """A directory holding tiny-bf16's tokenizer.json (after `edit` of its JSON) and, with `config`, config.json."""
    shutil.copy(FIXTURES / "tiny-bf16" / "tokenizer_config.json", tmp_path)
    if config:
        shutil.copy(FIXTURES / "tiny-bf16" / "config.json", tmp_path)
    data = json.loads((FIXTURES / "tiny-bf16" / "tokenizer.json").read_text())
    if edit is not None:
        edit(data)
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    return tmp_path


PAST_THE_VOCABULARY = {  # tiny-bf16 has 384 ids; the tokenizers library numbers added tokens after the vocabulary
    "an added token": lambda d: d["added_tokens"].append({**d["added_tokens"][0], "id": 5000, "content": "ZZZ",
                                                          "special": False}),
    "a vocabulary entry": lambda d: d["model"]["vocab"].__setitem__("ZZZ", 384),
}


@pytest.mark.parametrize("config", [True, False], ids=["config.json's vocab_size", "vocab_size given"])
@pytest.mark.parametrize("case", list(PAST_THE_VOCABULARY))
def test_a_token_id_past_the_models_vocabulary_is_refused_at_load(tmp_path, case, config):
    """Its embedding row does not exist: one line naming tokenizer.json, before any text is encoded."""
    directory = tokenizer_dir(tmp_path, PAST_THE_VOCABULARY[case], config)
    with pytest.raises(GlmkitError) as info:
        ChatTokenizer(directory) if config else ChatTokenizer(directory, 384)
    message = str(info.value)
    assert message.startswith(f"{directory / 'tokenizer.json'}: token id 384 (") and "\n" not in message
    assert "is outside the model's vocabulary (vocab_size 384" in message
    assert ChatTokenizer(directory, 385).encode("ZZZ")  # a model with that many ids takes it


def test_the_files_padding_never_adds_ids(tmp_path):
    """A padding pad_id (or truncation) in tokenizer.json is not glmkit's: a prompt is encoded whole, as it is."""
    def pad_and_truncate(d):
        d["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 5000,
                        "pad_type_id": 0, "pad_token": "ZZZ"}
        d["truncation"] = {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0}

    tok = ChatTokenizer(tokenizer_dir(tmp_path, pad_and_truncate))
    assert tok.encode(TEXTS[0]) == ChatTokenizer(FIXTURES / "tiny-bf16").encode(TEXTS[0])


def test_tokenizer_json_is_read_with_a_bound(tmp_path):
    directory = tokenizer_dir(tmp_path)
    with open(directory / "tokenizer.json", "r+b") as f:  # sparse: refused by its size, not read
        f.truncate(MAX_SIDE_FILE_BYTES + 1)
    with pytest.raises(GlmkitError, match=f"tokenizer.json: {MAX_SIDE_FILE_BYTES + 1} bytes, more than the"):
        ChatTokenizer(directory)


# ---- encode / decode -----------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids and all(0 <= i < 384 for i in ids)
    assert tok.decode(ids) == text


def test_multibyte_characters_split_across_tokens(tok):
    """The fixture's 384-token BPE has no merges for these: each character spans several byte tokens."""
    ids = tok.encode("日本")
    assert len(ids) >= 4
    assert "\ufffd" in tok.decode(ids[:1])


# ---- streaming -----------------------------------------------------------------------------------

def stream(tok: ChatTokenizer, ids: list[int]) -> tuple[list[str], str]:
    decoder = StreamDecoder(tok)
    pieces = [decoder.push(i) for i in ids]
    return pieces, decoder.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_never_emits_broken_characters(tok, text):
    ids = tok.encode(text)
    pieces, tail = stream(tok, ids)
    assert not any("\ufffd" in p for p in pieces), pieces
    assert "".join(pieces) + tail == tok.decode(ids) == text
    assert tail == ""  # valid text: nothing is held back at the end


def test_stream_decoder_emits_as_soon_as_a_character_completes(tok):
    ids = tok.encode("a日b")
    pieces, _ = stream(tok, ids)
    assert pieces[0] == "a" and pieces[-1] == "b"
    assert "".join(pieces) == "a日b"
    first_cjk = next(i for i, p in enumerate(pieces) if "日" in p)
    assert all(p == "" for p in pieces[1:first_cjk])  # held back, not emitted as replacement characters


def test_stream_decoder_with_special_tokens(tok):
    ids = tok.encode("<|user|>\nHi 日本<|assistant|>")
    pieces, tail = stream(tok, ids)
    assert "".join(pieces) + tail == "<|user|>\nHi 日本<|assistant|>"
    assert not any("\ufffd" in p for p in pieces)


def test_stream_decoder_on_random_tokens_matches_the_full_decode(tok):
    """Model output need not be valid UTF-8: pieces + flush still equal the full decode."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        ids = rng.integers(0, 384, size=int(rng.integers(1, 16))).tolist()
        pieces, tail = stream(tok, ids)
        assert "".join(pieces) + tail == tok.decode(ids), ids


def test_stream_decoder_flushes_an_incomplete_tail(tok):
    ids = tok.encode("ok 日")[:-1]  # the last byte of 日 missing
    pieces, tail = stream(tok, ids)
    assert "".join(pieces) == "ok " and tail == "\ufffd"
