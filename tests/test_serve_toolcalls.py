"""glm-serve's text handling without a server: GLM tool-call parsing and rendering, template support,
and the streaming split of a chat reply into reasoning, content and tool calls."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest

from glmkit.generate.tokenizer import ChatTokenizer
from glmkit.serve.chat import ChatText, chat_parts
from glmkit.serve.toolcalls import TemplateSupport, parse_tool_calls, prepare_messages, render_tool_call
from tests.runtime_support import FIXTURES

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer"}, "filters": {"type": "object"},
    "zip": {"type": "string"}}}}}]


def calls_of(text: str, tools=TOOLS) -> tuple[str, list[tuple[str, dict]]]:
    rest, calls = parse_tool_calls(text, tools)
    return rest, [(c.name, c.arguments) for c in calls]


def test_parses_glm45_and_compact_formats():
    glm45 = ("Let me search.\n<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>numpy mmap</arg_value>\n"
             "<arg_key>limit</arg_key>\n<arg_value>5</arg_value>\n</tool_call>")
    assert calls_of(glm45) == ("Let me search.", [("search", {"query": "numpy mmap", "limit": 5})])
    compact = ("<tool_call>search<arg_key>query</arg_key><arg_value>a</arg_value></tool_call>"
               "<tool_call>search<arg_key>filters</arg_key><arg_value>{\"lang\": [\"py\"]}</arg_value>"
               "<arg_key>zip</arg_key><arg_value>01234</arg_value></tool_call>")
    assert calls_of(compact) == ("", [("search", {"query": "a"}),
                                      ("search", {"filters": {"lang": ["py"]}, "zip": "01234"})])


def test_values_follow_the_schema_or_json():
    text = ("<tool_call>other<arg_key>n</arg_key><arg_value>42</arg_value><arg_key>s</arg_key>"
            "<arg_value>plain words</arg_value><arg_key>b</arg_key><arg_value>true</arg_value></tool_call>")
    assert calls_of(text) == ("", [("other", {"n": 42, "s": "plain words", "b": True})])
    # a string parameter keeps its text exactly, even when it looks like JSON or has newlines
    text = "<tool_call>search<arg_key>query</arg_key><arg_value>123\n  </arg_value></tool_call>"
    assert calls_of(text)[1] == [("search", {"query": "123\n  "})]
    assert calls_of(text, tools=None)[1] == [("search", {"query": 123})]


def test_incomplete_or_nameless_blocks_stay_text():
    cut = "Sure.<tool_call>search<arg_key>query</arg_key><arg_value>unfinis"
    assert calls_of(cut) == (cut, [])
    nameless = "<tool_call><arg_key>q</arg_key><arg_value>x</arg_value></tool_call>"
    assert calls_of(nameless) == (nameless, [])


def test_render_and_parse_round_trip():
    arguments = {"query": "héllo <b>", "limit": 3, "filters": {"a": [1, 2]}, "zip": "007"}
    text = render_tool_call("search", arguments)
    assert text.startswith("<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>héllo <b></arg_value>")
    assert calls_of(text) == ("", [("search", arguments)])
    call = parse_tool_calls(text, TOOLS)[1][0]
    entry = call.to_openai(index=2)
    assert entry["index"] == 2 and json.loads(entry["function"]["arguments"]) == arguments


NATIVE_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}<|system|>
<tools>
{% for tool in tools %}{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}</tools>{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}<|user|>
{{ m.content }}
{%- elif m.role == 'assistant' -%}<|assistant|>{{ m.content }}
{%- for tc in m.tool_calls or [] -%}{%- if tc.function %}{%- set tc = tc.function %}{%- endif %}
<tool_call>{{ tc.name }}{% for k, v in tc.arguments.items() %}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value>
{%- endfor %}</tool_call>{%- endfor -%}
{%- elif m.role == 'tool' -%}<|observation|><tool_response>{{ m.content }}</tool_response>
{%- endif -%}{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"""

MESSAGES = [{"role": "user", "content": "Find ü"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "search", "arguments": {"query": "ü"}}}]},
            {"role": "tool", "content": "found"}]


def test_template_with_native_tool_support_gets_them_as_variables(tmp_path):
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    shutil.copy(FIXTURES / "tiny-bf16" / "tokenizer.json", snapshot)
    (snapshot / "chat_template.jinja").write_text(NATIVE_TEMPLATE)
    tok = ChatTokenizer(snapshot)
    support = TemplateSupport.of(tok.chat_template)
    assert support == TemplateSupport(tools=True, tool_calls=True)
    messages, tools = prepare_messages(MESSAGES, TOOLS, support)
    assert messages == MESSAGES and tools == TOOLS  # nothing folded
    text = tok.render_chat(messages, tools=tools)
    assert '{"type": "function", "function": {"name": "search"' in text  # transformers-style tojson
    assert "<tool_call>search<arg_key>query</arg_key><arg_value>ü</arg_value></tool_call>" in text
    assert text.endswith("<|observation|><tool_response>found</tool_response><|assistant|>")


def test_template_without_tool_support_gets_them_folded_into_text():
    tok = ChatTokenizer(FIXTURES / "tiny-bf16")
    support = TemplateSupport.of(tok.chat_template)
    assert support == TemplateSupport(tools=False, tool_calls=False)
    messages, tools = prepare_messages([{"role": "system", "content": "Be brief."}] + MESSAGES, TOOLS, support)
    assert tools is None
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "search"' in messages[0]["content"]
    assert messages[2]["content"] == ("<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>ü</arg_value>\n"
                                      "</tool_call>")
    assert "tool_calls" not in messages[2]
    assert messages[3]["content"] == "<tool_response>\nfound\n</tool_response>"
    text = tok.render_chat(messages)
    assert "<|observation|>\n<tool_response>\nfound\n</tool_response><|assistant|><think>" in text


REPLY = "plan: call it</think>\nAnswer first.\n\n<tool_call>search<arg_key>query</arg_key><arg_value>x</arg_value>" \
        "</tool_call> trailing"


@pytest.mark.parametrize("seed", range(5))
def test_chat_text_split_does_not_depend_on_chunking(seed):
    rng = random.Random(seed)
    router = ChatText(reasoning=True, tools=True)
    pieces, pos = [], 0
    while pos < len(REPLY):
        step = rng.randint(1, 6)
        pieces += router.push(REPLY[pos:pos + step])
        pos += step
    rest, tool_text = router.finish()
    pieces += rest
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    streamed_content = "".join(t for kind, t in pieces if kind == "content")
    assert reasoning == "plan: call it" and streamed_content == "Answer first."
    content, calls = chat_parts(pieces, tool_text, TOOLS)
    assert [(c.name, c.arguments) for c in calls] == [("search", {"query": "x"})]
    assert content == "Answer first.\ntrailing"


def test_chat_text_without_tools_or_reasoning_passes_everything():
    router = ChatText(reasoning=False, tools=False)
    assert router.push("a</think><tool_call>b") == [("content", "a</think><tool_call>b")]
    assert router.finish() == ([], "")


def test_reading_a_templates_tool_support_builds_none_of_its_constants():
    """Analysing a template must not fold its constants (jinja's plain sandbox intercepts no operator, so
    `{{ 'x' * 10 ** 10 }}` became a 10 GB string): a 200 MB one here, whose folding would show in the child's peak
    memory (an address-space limit keeps a regression from exhausting the machine)."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); "
            "from glmkit.serve.toolcalls import TemplateSupport; "
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
            "print(TemplateSupport.of(\"{{ 'x' * 2 * 10 ** 8 }}{{ tools }}\")); "
            "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-500:]
    support, grown_mb = proc.stdout.split("\n")[:2]
    assert "tools=True" in support and int(grown_mb) < 50
