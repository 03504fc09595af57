"""`scripts/bench_spec.py --paths stack`: speculation off / adaptive / forced through real stacks
(`laneserve up` each, the bundled model), the cells' figures read back from the streams and from
the `requests` table (slow)."""

from __future__ import annotations

import json

import pytest

from tests.harness import run_script


@pytest.mark.slow
def test_stack_cells_report_each_mode_from_the_streams_and_the_table(smollm2_gguf, tmp_path):
    proc = run_script(
        "bench_spec",
        smollm2_gguf.parent.parent,
        "--paths", "stack", "--tasks", "summarize", "--batches", "1,2",
        "--batch1-prompts", "1", "--max-tokens", "16", "--forced",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    cells = report["cells"]
    assert [(c["path"], c["task"], c["batch"], c["prompts"]) for c in cells] == [
        ("stack", "summarize", 1, 1),
        ("stack", "summarize", 2, 2),
    ]
    forced_drafts = 0
    for cell in cells:
        for mode in ("off", "adaptive", "forced"):
            fig = cell[mode]
            # every request's row was recorded, every stream produced tokens
            assert fig["server_rows"] == cell["prompts"], (mode, fig)
            assert 0 < fig["tokens"] <= 16 * cell["prompts"], (mode, fig)
            assert fig["tok_s"] == pytest.approx(fig["tokens"] / fig["seconds"], rel=0.01)
            assert fig["tpot_ms"] > 0 and fig["server_tpot_ms"] > 0, (mode, fig)
            assert 0 <= fig["accepted_tokens"] <= fig["draft_tokens"], (mode, fig)
        assert cell["off"]["draft_tokens"] == 0
        forced_drafts += cell["forced"]["draft_tokens"]
        for mode in ("adaptive", "forced"):
            fig = cell[mode]
            assert fig["speedup_tok_s"] == pytest.approx(
                fig["tok_s"] / cell["off"]["tok_s"], abs=2e-3
            )
            assert isinstance(fig["identical_to_off"], bool)
    # a summary copies its document: drafting every step finds something to verify
    assert forced_drafts > 0, cells
    assert report["cpu"]["simd_flags"] is not None
