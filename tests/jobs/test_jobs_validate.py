"""jobs.validate: line-level errors, job-level failures, prompt lengths with the real tokenizer."""

from __future__ import annotations

import json

import pytest

from laneserve.contracts.openai import Prompt, ServedModel
from laneserve.jobs.tokens import load_served_model
from laneserve.jobs.validate import JobValidationError, Validator
from tests.harness import chat_line, write_jsonl


@pytest.fixture(scope="module")
def counter(smollm2_dir) -> ServedModel:
    return load_served_model(str(smollm2_dir), "smollm2-135m", max_model_len=64)


def _validate(tmp_path, lines, **kw):
    v = Validator(
        endpoint=kw.pop("endpoint", "/v1/chat/completions"), counter=kw.pop("counter", None), **kw
    )
    return v, list(v.lines(write_jsonl(tmp_path / "in.jsonl", lines)))


def test_line_errors_are_named_and_the_rest_is_kept(tmp_path):
    lines = [
        chat_line("ok", "hi"),
        "not json",
        "42",
        {"method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}},
        {**chat_line("wrong-url", "hi"), "url": "/v1/moderations"},
        {
            **chat_line("tools", "hi"),
            "body": {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]},
        },
        {"custom_id": "missing-body", "method": "POST", "url": "/v1/chat/completions"},
        "",
        chat_line(None, "no id"),
    ]
    v, results = _validate(tmp_path, lines)
    by_id = {r.custom_id: r for r in results}
    assert list(by_id) == [
        "ok",
        "line-2",
        "line-3",
        "line-4",
        "wrong-url",
        "tools",
        "missing-body",
        "line-9",
    ]
    assert (
        by_id["ok"].error is None and by_id["ok"].request["body"]["messages"][0]["content"] == "hi"
    )
    assert by_id["line-2"].error["code"] == "invalid_json"
    assert "not an object" in by_id["line-3"].error["message"]
    assert "custom_id" in by_id["line-4"].error["message"]  # missing field
    assert by_id["line-4"].error["param"] == "custom_id"
    assert "endpoint" in by_id["wrong-url"].error["message"]
    assert "tools" in by_id["tools"].error["message"]
    assert "body" in by_id["missing-body"].error["message"]
    assert by_id["line-9"].error is not None  # custom_id is required in OpenAI format
    # the field at fault, where there is one, as OpenAI's error objects name it
    assert by_id["wrong-url"].error["param"] == "url"
    assert by_id["tools"].error.get("param") == "body.tools"
    assert "param" not in by_id["line-2"].error and "param" not in by_id["line-3"].error
    assert (v.num_lines, v.num_bad) == (8, 7) and v.too_many_bad()  # blank line not counted


def test_duplicate_custom_id_names_both_lines(tmp_path):
    lines = [chat_line("a", "1"), chat_line("b", "2"), chat_line("c", "3"), chat_line("b", "4")]
    with pytest.raises(JobValidationError) as err:
        _validate(tmp_path, lines)
    assert err.value.errors[0]["code"] == "duplicate_custom_id"
    assert "lines 2 and 4" in err.value.errors[0]["message"]


def test_duplicates_do_not_hide_the_other_errors(tmp_path):
    """The file is read to its end: every duplicate custom_id (each naming both lines) and the
    other lines' errors come back together, so one upload shows everything to fix."""
    lines = [
        chat_line("a", "1"),
        "not json",
        chat_line("a", "2"),
        chat_line("b", "3"),
        chat_line("b", "4"),
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions"},
    ]
    with pytest.raises(JobValidationError) as err:
        _validate(tmp_path, lines)
    errors = err.value.errors
    assert [(e["code"], e["line"]) for e in errors] == [  # in the file's order
        ("invalid_json", 2),
        ("duplicate_custom_id", 3),
        ("duplicate_custom_id", 5),
        ("invalid_request", 6),
    ]
    dups = [e for e in errors if e["code"] == "duplicate_custom_id"]
    assert [e["param"] for e in dups] == ["custom_id", "custom_id"]
    assert "lines 1 and 3" in dups[0]["message"] and "lines 4 and 5" in dups[1]["message"]
    bad_json = next(e for e in errors if e["code"] == "invalid_json")
    assert bad_json["message"] == "not JSON: Expecting value at column 1"  # not "line 1 ..."
    # a line without a usable custom_id is named line-N; a real custom_id "line-N" then
    # repeats it (each custom_id once across the result files): the error says why
    with pytest.raises(JobValidationError) as err:
        _validate(tmp_path, [{**chat_line("x", "a"), "custom_id": 5}, chat_line("line-1", "b")])
    dup = next(e for e in err.value.errors if e["code"] == "duplicate_custom_id")
    assert (
        "'line-1' on lines 1 and 2 (line 1 has no usable custom_id and is named after its"
        in (dup["message"])
    )
    # a line cut short: the column where it ends, not the decoder's "line 2 column 1" after
    # the line break
    cut = '{"id": "d4", "text": '
    with pytest.raises(JobValidationError) as err:
        _validate(
            tmp_path, [{"id": "x", "text": "a"}, cut, {"id": "x", "text": "b"}], task="summarize"
        )
    bad_json = next(e for e in err.value.errors if e["code"] == "invalid_json")
    assert bad_json["message"] == f"not JSON: Expecting value at column {len(cut) + 1}"
    # a task job's lines are named by their own field, `id`
    tasks = [{"id": "x", "text": "a"}, {"id": "x", "text": "b"}]
    with pytest.raises(JobValidationError, match="duplicate id 'x' on lines 1 and 2"):
        _validate(tmp_path, tasks, task="summarize")


def test_job_limits_and_one_model(tmp_path):
    with pytest.raises(JobValidationError, match="more than 2 lines"):
        _validate(tmp_path, [chat_line(str(i), "x") for i in range(3)], max_lines=2)
    with pytest.raises(JobValidationError, match="limit is 10"):
        _validate(tmp_path, [chat_line("a", "x")], max_bytes=10)
    lines = [chat_line("a", "x", model="m1"), chat_line("b", "x", model="m2")]
    with pytest.raises(JobValidationError) as err:
        _validate(tmp_path, lines)
    assert err.value.errors[0]["code"] == "multiple_models"


def test_completions_prompt_forms(tmp_path):
    def line(cid, prompt):
        return {
            "custom_id": cid,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "m", "prompt": prompt},
        }

    lines = [line("s", "Once"), line("ids", [1, 2, 3]), line("one", ["x"]), line("two", ["x", "y"])]
    lines.append(line("bad", [["x"]]))
    v, results = _validate(tmp_path, lines, endpoint="/v1/completions")
    by_id = {r.custom_id: r for r in results}
    assert [by_id[k].error for k in ("s", "ids", "one", "two")] == [None] * 4
    assert by_id["one"].request["body"]["prompt"] == "x"  # one prompt, stored as itself
    assert by_id["two"].request["body"]["prompt"] == ["x", "y"]  # two choices (the API's fan-out)
    assert by_id["bad"].error == {
        "code": "invalid_request",
        "message": "token-id prompts must hold non-negative integers",
        "param": "body.prompt",
    }


def test_task_lines(tmp_path):
    lines = [
        {"id": 7, "text": "Bonjour"}, {"id": "b", "text": ""}, {"text": "Hallo"},
        {"id": "n", "text": 7}, {"id": "m"}, '{"id": "s", "text": "bad \\ud800"}',
        '{"id": "x\\udfff", "text": "fine"}',
    ]  # fmt: skip
    v, results = _validate(
        tmp_path,
        lines,
        task="translate",
        task_options={"target_lang": "fr", "source_lang": "de", "max_tokens": "16"},
        default_model="smollm2-135m",
    )
    assert [r.custom_id for r in results] == ["7", "b", "line-3", "n", "m", "s", "line-7"]
    body = results[0].request["body"]
    assert body["max_tokens"] == 16 and body["model"] == "smollm2-135m"
    assert "to French" in body["messages"][-1]["content"]
    assert results[1].error is not None and results[2].error is None
    # each says what is wrong with the field
    assert "'text' is empty" in results[1].error["message"]
    assert "'text' is a JSON int, not a string" in results[3].error["message"]
    assert "'text' is missing" in results[4].error["message"]
    assert "text holds an unpaired UTF-16 surrogate" in results[5].error["message"]
    assert "id holds an unpaired" in results[6].error["message"]  # named by its line instead
    assert [results[i].error["param"] for i in (1, 3, 4, 5, 6)] == ["text"] * 4 + ["id"]


def test_prompt_length_with_the_model_tokenizer(tmp_path, counter, smollm2_dir):
    from transformers import AutoTokenizer  # the engine's tokenizer, as a reference

    hello = [{"role": "user", "content": "Hello there"}]
    reference = AutoTokenizer.from_pretrained(str(smollm2_dir))
    expected = len(
        reference.apply_chat_template(
            hello, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    assert counter.count(Prompt(messages=hello)) == expected
    lines = [chat_line("short", "Hello there", max_tokens=8), chat_line("long", "word " * 100)]
    v, results = _validate(tmp_path, lines, counter=counter)
    assert results[0].error is None and results[0].prompt_tokens == expected
    assert results[1].error["code"] == "prompt_too_long"
    assert "maximum context length is 64 tokens" in results[1].error["message"]
    # summarize: a long document is not an error but a map-reduce line
    docs = [{"id": "doc", "text": "word " * 300}]
    v, (r,) = _validate(
        tmp_path, docs, counter=counter, task="summarize", task_options={"max_tokens": "8"}
    )
    assert r.error is None and r.request["map_reduce"]["text"].startswith("word")
    v, (r,) = _validate(
        tmp_path, docs, counter=counter, task="translate", task_options={"target_lang": "fr"}
    )
    assert r.error["code"] == "prompt_too_long"
    assert r.error["param"] == "text"  # the task line's field, not the body built from it
    assert json.dumps(r.error)
    _, (r,) = _validate(tmp_path, lines[1:], counter=counter)
    assert r.error["param"] == "body.messages"


def test_byte_order_mark_and_crlf_are_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(
        b"\xef\xbb\xbf"
        + json.dumps(chat_line("a", "x")).encode()
        + b"\r\n"
        + json.dumps(chat_line("b", "y")).encode()
        + b"\r\n"
    )
    v = Validator(endpoint="/v1/chat/completions", counter=None)
    assert [(r.custom_id, r.error) for r in v.lines(path)] == [("a", None), ("b", None)]
