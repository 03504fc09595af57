"""One prompt-counting rule (contracts.tokens) equal to what the engine feeds the model, and an
API process that never imports torch.

The reference is the `transformers` tokenizer the engine holds: `tokenizer(text)["input_ids"]`
for text, `apply_chat_template(messages, add_generation_prompt=True, tokenize=True)` for chat
(DESIGN.md "Offline engine"). The torch-free loader reads only `tokenizer.json` and
`tokenizer_config.json`, so it is checked on the bundled model and on a BOS-adding variant.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from laneserve.contracts.tokens import PromptTokenizer, TokenizerError, prompt_ids, tokenizer_dir

ROOT = Path(__file__).resolve().parents[2]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief. <|im_end|> is text here"},
     {"role": "user", "content": "héllo 😀\n\ttabs"},
     {"role": "assistant", "content": "ok"},
     {"role": "user", "content": "and again"}],
]  # fmt: skip
TEXTS = ["hello world", "  leading spaces", "<|im_start|>user\nx<|im_end|>", "naïve café 😀", "1"]


def _bos_variant(src: Path, dst: Path) -> None:
    """A copy of the tokenizer files of ``src`` whose post-processor adds a BOS to every text
    (as Llama's ``tokenizer.json`` does); SmolLM2's adds none."""
    dst.mkdir()
    for name in ("tokenizer_config.json", "chat_template.jinja", "config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    tok = json.loads((src / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    seq = {"Sequence": {"id": "A", "type_id": 0}}
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, seq],
        "pair": [bos, seq, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}
        },
    }
    (dst / "tokenizer.json").write_text(json.dumps(tok))


@pytest.mark.parametrize("bos", [False, True], ids=["bundled", "bos-adding"])
def test_prompt_ids_equal_the_engine_tokenizer(smollm2_dir, tmp_path, bos) -> None:
    from transformers import AutoTokenizer

    directory = smollm2_dir
    if bos:
        directory = tmp_path / "bos"
        _bos_variant(smollm2_dir, directory)
    engine_tok = AutoTokenizer.from_pretrained(str(directory))
    edge = PromptTokenizer.load(directory)
    engine = PromptTokenizer.from_hf(engine_tok)  # what the engine's PromptEncoder calls with
    bos_id = engine_tok.convert_tokens_to_ids("<|im_start|>")
    for text in TEXTS:
        expected = engine_tok(text)["input_ids"]
        assert (expected[0] == bos_id) == (bos or text.startswith("<|im_start|>")), expected
        assert prompt_ids(edge, prompt=text) == expected == prompt_ids(engine, prompt=text)
    for chat in CHATS:
        expected = engine_tok.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert prompt_ids(edge, messages=chat) == expected == prompt_ids(engine, messages=chat)
        assert expected.count(bos_id) == sum(1 for _ in chat) + (chat[0]["role"] != "system") + 1
    assert prompt_ids(edge, token_ids=[1, 2]) == [1, 2]
    for token_id in (0, 2, 504, 28120):
        assert edge.token_text(token_id) == engine_tok.decode([token_id])


def test_a_gguf_without_its_converted_cache_says_what_to_run(tmp_path, smollm2_dir) -> None:
    gguf = tmp_path / "Model.Q4_0.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    assert tokenizer_dir(gguf) == tmp_path / "Model.Q4_0.hf"
    with pytest.raises(TokenizerError, match="laneserve model pull") as err:
        PromptTokenizer.load(gguf)
    assert str(tmp_path / "Model.Q4_0.hf") in str(err.value)
    # with the cache next to it, the .gguf path loads its tokenizer
    shutil.copytree(smollm2_dir, tmp_path / "Model.Q4_0.hf")
    assert PromptTokenizer.load(gguf).max_model_len == 8192


TORCH_FREE = """
import json, resource, sys
from laneserve.contracts.openai import Prompt
from laneserve.api.app import create_app
from laneserve.api.config import ApiConfig
from laneserve.api.model_info import load_served_model

config = ApiConfig(broker="ipc:///nowhere", model=sys.argv[1], served_model_name="smollm2")
app = create_app(config)
served = load_served_model(config)  # what the app's start-up does
chat = served.count(Prompt(messages=[{"role": "user", "content": "hi"}]))
text = served.count(Prompt(text="hello world"))
import laneserve.jobs.runner
from laneserve.jobs.tokens import load_served_model as load_for_jobs
jobs_chat = load_for_jobs(sys.argv[1], "smollm2").count(
    Prompt(messages=[{"role": "user", "content": "hi"}]))
print(json.dumps({
    "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
    "transformers": "transformers" in sys.modules,
    "chat": chat, "text": text, "jobs_chat": jobs_chat,
    "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}))
"""


def test_api_and_jobs_runner_count_prompts_without_torch(smollm2_gguf, smollm2_dir) -> None:
    from transformers import AutoTokenizer

    out = subprocess.run(
        [sys.executable, "-c", TORCH_FREE, str(smollm2_gguf)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch"] == [] and got["transformers"] is False, got
    reference = AutoTokenizer.from_pretrained(str(smollm2_dir))
    chat = reference.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )  # fmt: skip
    assert got["chat"] == got["jobs_chat"] == len(chat)
    assert got["text"] == len(reference("hello world")["input_ids"])
