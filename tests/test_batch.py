"""JSONL batch runs: every prompt answered once, output written as produced, resumable."""

import json

import pytest

from hx.batch import run_batch
from hx.errors import HxError
from hx.generate import Engine
from hx.sampling import SamplingParams

PROMPTS = [f"Prompt number {i}: " + "word " * (i % 5) for i in range(7)]
SAMPLING = SamplingParams(max_new_tokens=4)
FIELDS = {"id", "prompt", "completion", "prompt_tokens", "completion_tokens", "finish_reason",
          "ttft_s", "decode_tok_s"}


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(tiny_model)


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n"
                            for i, p in enumerate(PROMPTS)))
    return path


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_all_prompts_answered(engine, prompts_file, tmp_path):
    out = tmp_path / "out.jsonl"
    summary = run_batch(engine, str(prompts_file), str(out), SAMPLING, batch_size=3)
    rows = read(out)
    assert summary.generated == 7 and sorted(r["id"] for r in rows) == [f"p{i}" for i in range(7)]
    assert all(set(r) == FIELDS for r in rows)
    alone = engine.generate([PROMPTS[4]], SAMPLING)[0]
    assert next(r for r in rows if r["id"] == "p4")["completion"] == alone.text


def test_resume_after_interrupted_write(engine, prompts_file, tmp_path):
    out = tmp_path / "out.jsonl"
    run_batch(engine, str(prompts_file), str(out), SAMPLING, batch_size=3)
    lines = out.read_text().splitlines(keepends=True)
    kept = "".join(lines[:2])
    out.write_text(kept + lines[2][:15])  # killed in the middle of the third line
    summary = run_batch(engine, str(prompts_file), str(out), SAMPLING, batch_size=3)
    assert summary.skipped == 2 and summary.generated == 5
    assert out.read_text().startswith(kept)
    assert sorted(r["id"] for r in read(out)) == [f"p{i}" for i in range(7)]


def test_results_are_on_disk_before_a_crash(engine, prompts_file, tmp_path, monkeypatch):
    out = tmp_path / "out.jsonl"
    real, calls = engine.generate_ids, []

    def crash_on_second_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "generate_ids", crash_on_second_batch)
    with pytest.raises(KeyboardInterrupt):
        run_batch(engine, str(prompts_file), str(out), SAMPLING, batch_size=3)
    assert len(read(out)) == 3
    monkeypatch.setattr(engine, "generate_ids", real)
    assert run_batch(engine, str(prompts_file), str(out), SAMPLING, batch_size=3).generated == 4
    assert len(read(out)) == 7


@pytest.mark.parametrize("content, match", [
    ('{"id": 1, "prompt": "a"}\nnot json\n', ":2: not valid JSON"),
    ('{"id": 1, "text": "a"}\n', "string 'prompt'"),
    ('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', "duplicate id 1"),
])
def test_bad_input(engine, tmp_path, content, match):
    (tmp_path / "in.jsonl").write_text(content)
    with pytest.raises(HxError, match=match):
        run_batch(engine, str(tmp_path / "in.jsonl"), str(tmp_path / "o.jsonl"), SAMPLING)


def test_too_long_prompt_fails_before_any_output(engine, tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "ok", "prompt": "hi"}) + "\n"
                                       + json.dumps({"id": "long", "prompt": "x " * 400}) + "\n")
    with pytest.raises(HxError, match="prompt 'long' has"):
        run_batch(engine, str(tmp_path / "in.jsonl"), str(tmp_path / "o.jsonl"), SAMPLING)
    assert not (tmp_path / "o.jsonl").exists() or read(tmp_path / "o.jsonl") == []
