"""Tool calling without a stack: the prompt a chat template renders with ``tools`` (the edge's
renderer against transformers' ``apply_chat_template``), the parsers (hermes, llama3_json,
mistral) on assistant turns the templates render, streamed deltas, and bad tool input."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from laneserve.contracts.openai import Limits, OpenAIError, ServedModel, parse
from laneserve.contracts.openai.tool_parsers import (
    ToolStream,
    parse_reply,
    parser_for_template,
    reply_message,
)
from tests.api.test_api_structured import TIME, WEATHER

# Templates written for these tests in the three families' formats (Hermes/Qwen <tool_call>
# blocks, Llama 3.1's JSON with "parameters", Mistral's [TOOL_CALLS] array).
HERMES = """\
{%- if tools %}<|im_start|>system
Functions: <tools>
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{% if m.content %}{{ m.content }}
{% endif %}
{%- for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif m.role == "tool" %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
LLAMA3 = """\
{{- bos_token }}<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
Respond as {"name": function name, "parameters": dictionary of argument name and its value}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif %}<|eot_id|>
{%- for m in messages %}
{%- if m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": \
{{ c.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif m.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ {"output": m.content} | tojson }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""
MISTRAL = """\
{{- bos_token }}
{%- for m in messages %}
{%- if m.role == "user" %}{% if tools and loop.first %}[AVAILABLE_TOOLS]{{ tools | tojson }}\
[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]
{%- elif m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", \
"arguments": {{ c.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]\
{{ eos_token }}
{%- elif m.role == "tool" %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]
{%- else %}{{ m.content }}{{ eos_token }}
{%- endif %}
{%- endfor %}"""
TEMPLATES = {
    "hermes": (HERMES, "<|im_end|>"),
    "llama3_json": (LLAMA3, "<|eot_id|>"),
    "mistral": (MISTRAL, "<|im_end|>"),
}  # fmt: skip  (SmolLM2's eos is <|im_end|>)

TIME_NOW = {"type": "function", "function": {"name": "get_now"}}  # no parameters
TOOLS = [WEATHER, TIME, TIME_NOW]
ASK = [{"role": "user", "content": "Weather in Oslo and Rome, and the time?"}]
CALLS = [
    ("get_weather", {"city": "Oslo", "unit": "celsius"}),
    ("get_time", {"zone": 1}),
    ("get_now", {}),
]


def _calls(calls=CALLS) -> list[dict]:
    return [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": name, "arguments": json.dumps(args)}}
        for i, (name, args) in enumerate(calls)
    ]  # fmt: skip


def _body(messages, **kw) -> dict:
    return {"model": "m", "messages": messages, "tools": TOOLS, **kw}


@pytest.fixture(scope="module")
def model_dirs(smollm2_dir, tmp_path_factory) -> dict[str, Path]:
    """SmolLM2's tokenizer with each test template as its chat template."""
    out = {}
    for name, (template, _) in TEMPLATES.items():
        d = tmp_path_factory.mktemp(name)
        for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
            shutil.copy(smollm2_dir / f, d / f)
        (d / "chat_template.jinja").write_text(template)
        out[name] = d
    return out


@pytest.fixture(scope="module")
def hf_tokenizers(model_dirs):
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(d) for name, d in model_dirs.items()}


def _hf_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as transformers documents them: arguments as objects."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]  # fmt: skip
        out.append(m)
    return out


@pytest.mark.parametrize("parser", list(TEMPLATES))
def test_tool_prompts_are_the_templates_own(parser, model_dirs, hf_tokenizers) -> None:
    served = ServedModel.load(model_dirs[parser], "m")
    assert served.tool_parser == parser  # implied by the template
    calls = _calls(CALLS[:1])
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_0", "content": "rain, 9 C"},
    ]
    req = parse("/v1/chat/completions", _body(messages), Limits())
    served.check(req, Limits())
    tok = hf_tokenizers[parser]
    hf_messages = [{**m, "content": m.get("content") or ""} for m in _hf_messages(messages)]
    expected = tok.apply_chat_template(
        hf_messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert tok.decode(req.prompts[0].encoded, skip_special_tokens=False) == expected
    assert "rain, 9 C" in expected and "get_time" in expected
    assert req.prompts[0].num_tokens == len(req.prompts[0].encoded)
    none = parse("/v1/chat/completions", _body(ASK, tool_choice="none"), Limits())
    served.check(none, Limits())
    assert "get_time" not in tok.decode(none.prompts[0].encoded)  # "none": no tools shown


def _rendered_reply(tok, end: str, calls: list[dict], content: str | None = None) -> str:
    """The assistant turn a template renders for `calls`, as the model would write it."""
    turn = {"role": "assistant", "content": content or "", "tool_calls": calls}
    kw = {"tools": TOOLS, "tokenize": False}
    prefix = tok.apply_chat_template(ASK, add_generation_prompt=True, **kw)
    full = tok.apply_chat_template([*ASK, *_hf_messages([turn])], **kw)
    assert full.startswith(prefix)
    return full[len(prefix) :].split(end)[0]


@pytest.mark.parametrize(
    ("parser", "n", "content"),
    [("hermes", 3, "Let me look."), ("hermes", 1, None), ("llama3_json", 1, None),
     ("mistral", 3, None)],
)  # fmt: skip
def test_parsers_read_what_the_templates_render(parser, n, content, hf_tokenizers) -> None:
    req = parse("/v1/chat/completions", _body(ASK), Limits())
    text = _rendered_reply(hf_tokenizers[parser], TEMPLATES[parser][1], _calls(CALLS[:n]), content)
    message, finish = reply_message(text, req.tools, parser, "stop")
    assert finish == "tool_calls" and message["content"] == content
    got = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ]
    assert got == CALLS[:n]
    # streamed in small pieces: the content first, then one delta per call
    stream = ToolStream(req.tools, parser)
    deltas = [d for i in range(0, len(text), 3) for d in stream.feed(text[i : i + 3])]
    end, reason = stream.close("stop")
    streamed = "".join(d.get("content", "") for d in deltas + end)
    assert streamed.strip() == (content or "") and reason == "tool_calls"
    calls = [d["tool_calls"][0] for d in deltas + end if "tool_calls" in d]
    assert [c["index"] for c in calls] == list(range(n))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == got
    # a call to a function that is not offered, or plain text: content, as written
    wrong = re.sub("get_(weather|time|now)", "get_news", text)
    assert reply_message(wrong, req.tools, parser, "stop") == (
        {"role": "assistant", "content": wrong}, "stop"
    )  # fmt: skip
    plain = ToolStream(req.tools, parser)
    said = [plain.feed(p) for p in ("It is", " sunny.")]
    assert plain.close("stop") == ([], "stop") and said[0] + said[1]


def test_forced_replies_and_the_parser_a_template_implies() -> None:
    required = parse("/v1/chat/completions", _body(ASK, tool_choice="required"), Limits()).tools
    text = '[{"name":"get_time","arguments":{}},{"name":"get_weather","arguments":{"city":"Oslo"}}]'
    assert [c["name"] for c in parse_reply(text, required, "mistral").calls] == [
        "get_time",
        "get_weather",
    ]
    named = {"type": "function", "function": {"name": "get_weather"}}
    forced = parse("/v1/chat/completions", _body(ASK, tool_choice=named), Limits()).tools
    stream = ToolStream(forced, "hermes")
    first, second = stream.feed('{"city":'), stream.feed('"Oslo"}')
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":'}
    assert second == [{"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}]
    assert stream.close("length") == ([], "length")  # cut short: the engine's reason
    assert parser_for_template(None) == parser_for_template("{{ messages }}") == "hermes"
    single = parse("/v1/chat/completions", _body(ASK, parallel_tool_calls=False), Limits()).tools
    two = '<tool_call>{"name": "get_now", "arguments": {}}</tool_call>' * 2
    assert len(parse_reply(two, single, "hermes").calls) == 1  # parallel_tool_calls=false
    auto = parse("/v1/chat/completions", _body(ASK), Limits()).tools
    assert len(parse_reply(two, auto, "hermes").calls) == 2


def test_a_template_without_tools_gets_the_generic_prompt(smollm2_dir) -> None:
    served = ServedModel.load(smollm2_dir, "m")
    req = parse("/v1/chat/completions", _body(ASK), Limits())
    served.check(req, Limits())
    prompt = served.tokenizer.decode(req.prompts[0].encoded, skip_special_tokens=False)
    assert "<tools>" in prompt and '"get_weather"' in prompt and "<tool_call>" in prompt
    assert served.tool_parser == "hermes"
    served.tool_call_parser = "mistral"  # --tool-call-parser wins
    assert served.tool_parser == "mistral"
    assert served.check(parse("/v1/chat/completions", _body(ASK), Limits()), Limits()) is None
    with pytest.raises(OpenAIError, match="tokenizer"):  # no tokenizer: cannot render tools
        ServedModel(served_name="m").check(
            parse("/v1/chat/completions", _body(ASK), Limits()), Limits()
        )


TOOL = WEATHER["function"]
BAD = [
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools", "name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "name"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "type"),
    ({"tools": [{"type": "function", "function": {**TOOL, "parameters": [1]}}]}, "tools", "object"),
    ({"tools": [{"type": "function", "function": {**TOOL, "parameters": {"type": "string"}}}]}, "tools", "object"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
    ({"tools": {"a": 1}}, "tools", "array"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "only allowed"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "response_format"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {**TOOL, "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}]}, "tools", "nope"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "c1", "content": "x"}]}, "messages", "c1"),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}]}, "messages", "arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": _calls()}]}, "messages", "assistant"),
    ({"messages": [{"role": "function", "name": "f", "content": "x"}]}, "messages", "tool"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param", "needle"), BAD)
def test_bad_tool_input_is_a_400_naming_the_field(extra, param, needle) -> None:
    with pytest.raises(OpenAIError) as info:
        parse("/v1/chat/completions", {**_body(ASK), **extra}, Limits())
    assert info.value.status == 400 and info.value.param == param
    assert needle in info.value.message


def test_a_round_trip_of_the_sdks_own_message_is_accepted() -> None:
    returned = {"role": "assistant", "content": None, "tool_calls": _calls(), "refusal": None,
                "audio": None, "function_call": None, "annotations": None}  # fmt: skip
    results = [{"role": "tool", "tool_call_id": f"call_{i}", "content": "ok"} for i in range(3)]
    req = parse("/v1/chat/completions", _body([*ASK, returned, *results]), Limits())
    assert [m["role"] for m in req.prompts[0].messages] == [
        "user",
        "assistant",
        "tool",
        "tool",
        "tool",
    ]


def test_a_batch_line_with_tools_is_rendered_sent_and_answered_as_the_api(
    smollm2_dir, tmp_path
) -> None:
    from laneserve.broker.protocol import Final
    from laneserve.contracts.engine_io import EngineRequest
    from laneserve.jobs.results import choice_requests, success_response
    from laneserve.jobs.validate import Validator
    from tests.harness import write_jsonl

    served = ServedModel.load(smollm2_dir, "m")
    body = _body(ASK, max_tokens=32)
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    validator = Validator(endpoint="/v1/chat/completions", counter=served)
    (result,) = validator.lines(write_jsonl(tmp_path / "in.jsonl", [line]))
    _, (submit,) = choice_requests("r", result.request)
    req = parse("/v1/chat/completions", body, Limits())
    served.check(req, Limits())
    assert isinstance(submit, EngineRequest)  # ids, not text: tokenized once, at the edge
    assert submit.prompt_token_ids == req.prompts[0].encoded
    text = 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 3}}\n</tool_call>'
    final = Final(request_id="r", finish_reason="stop", text=text, usage={"prompt_tokens": 9})
    out = success_response("r", "/v1/chat/completions", "m", final, body=body, served=served)
    (choice,) = out["body"]["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": '{"zone":3}'}
