"""JSONL batch runs: every prompt answered once, output written as produced, resumable."""

import dataclasses
import json
import os
import signal
import subprocess
import sys

import pytest

from hx.batch import output_lock, prepare_batch, run_batch
from hx.errors import HxError
from hx.generate import Engine
from hx.sampling import SamplingParams

PROMPTS = [f"Prompt number {i}: " + "word " * (i % 5) for i in range(7)]
SAMPLING = SamplingParams(max_new_tokens=4)
FIELDS = {"id", "prompt", "completion", "prompt_tokens", "completion_tokens", "finish_reason",
          "ttft_s", "decode_tok_s", "prompt_sha256", "produced_by"}
SAMPLED = SamplingParams(max_new_tokens=6, temperature=0.8, seed=3)


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


def interrupted_at_second_batch(generate_ids):
    """``generate_ids`` that raises KeyboardInterrupt on its second call (a run killed after
    one batch)."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return generate_ids(*args, **kwargs)

    return wrapped


def test_results_are_on_disk_before_a_crash(engine, prompts_file, tmp_path, monkeypatch):
    out = tmp_path / "out.jsonl"
    real = engine.generate_ids
    monkeypatch.setattr(engine, "generate_ids", interrupted_at_second_batch(real))
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
    ("\n  \n", "in.jsonl has no prompts; write one JSON object per line"),
    ('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y", "max_tokens": 3}\n',
     r"in.jsonl:2: unknown key 'max_tokens'; did you mean 'max_new_tokens'\? a prompt line "
     "takes id, prompt, max_new_tokens, temperature, top_k, top_p, seed, stop$"),
    ('{"id": "a", "prompt": "x", "colour": 3}\n', r":1: unknown key 'colour'; a prompt line"),
    # ids are one id when they read the same as text: 1 and "1", a missing id and "line-N"
    ('{"id": 1, "prompt": "a"}\n{"id": "1", "prompt": "b"}\n',
     r":2: duplicate id '1' \(line 1 has it, as text\)"),
    ('{"prompt": "a"}\n{"id": "line-1", "prompt": "b"}\n', ":2: duplicate id 'line-1'"),
    ('{"id": 1.5, "prompt": "a"}\n', ":1: 'id' must be a string or an integer, got 1.5"),
    ('{"id": true, "prompt": "a"}\n', "'id' must be a string or an integer"),
])
def test_bad_input(engine, tmp_path, content, match):
    """Refused with the line and what to do, and nothing written beside the input."""
    (tmp_path / "in.jsonl").write_text(content)
    with pytest.raises(HxError, match=match):
        run_batch(engine, str(tmp_path / "in.jsonl"), str(tmp_path / "o.jsonl"), SAMPLING)
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_lines_without_an_id_are_named_by_their_line(engine, tmp_path):
    """A line without an id is ``line-N``: never the same id as another line's ``"1"`` or
    ``1``; a rerun resumes them all."""
    write_rows(tmp_path / "in.jsonl", [{"prompt": "alpha"}, {"id": "1", "prompt": "beta"},
                                       {"id": 2, "prompt": "gamma"}, {"prompt": "delta"}])
    out = tmp_path / "o.jsonl"
    run_batch(engine, str(tmp_path / "in.jsonl"), str(out), SAMPLING)
    assert {r["id"]: r["prompt"] for r in read(out)} == {
        "line-1": "alpha", "1": "beta", 2: "gamma", "line-4": "delta"}
    again = run_batch(engine, str(tmp_path / "in.jsonl"), str(out), SAMPLING)
    assert (again.generated, again.skipped) == (0, 4)


def test_too_long_prompt_fails_before_any_output(engine, tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "ok", "prompt": "hi"}) + "\n"
                                       + json.dumps({"id": "long", "prompt": "x " * 400}) + "\n")
    with pytest.raises(HxError, match="prompt 'long' has"):
        run_batch(engine, str(tmp_path / "in.jsonl"), str(tmp_path / "o.jsonl"), SAMPLING)
    assert os.listdir(tmp_path) == ["in.jsonl"]  # no output, no lock file


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_per_line_options_override_the_run(engine, tmp_path):
    free = engine.generate(["alpha beta"], SamplingParams(max_new_tokens=6))[0].text
    stop = free[len(free) // 2]  # a character the free completion contains
    write_rows(tmp_path / "in.jsonl", [
        {"id": "short", "prompt": "alpha beta", "max_new_tokens": 2},
        {"id": "stop", "prompt": "alpha beta", "max_new_tokens": 6, "stop": [stop]},
        {"id": "free", "prompt": "alpha beta", "max_new_tokens": 6}])
    run_batch(engine, str(tmp_path / "in.jsonl"), str(tmp_path / "o.jsonl"), SAMPLING)
    rows = {r["id"]: r for r in read(tmp_path / "o.jsonl")}
    assert rows["short"]["completion_tokens"] == 2
    assert rows["short"]["produced_by"]["max_new_tokens"] == 2
    assert rows["free"]["completion"] == free
    assert rows["stop"]["completion"] == free[:free.index(stop)]
    assert rows["stop"]["finish_reason"] == "stop"


@pytest.mark.parametrize("row, match", [
    ({"max_new_tokens": "3"}, "'max_new_tokens' must be an integer"),
    ({"temperature": -1}, "temperature must be >= 0"),
    ({"stop": "."}, "'stop' must be a list of strings"),
    ({"stop": [""]}, "non-empty strings"),
])
def test_bad_per_line_option(engine, tmp_path, row, match):
    write_rows(tmp_path / "in.jsonl", [{"id": "x", "prompt": "hi"} | row])
    with pytest.raises(HxError, match=match):
        run_batch(engine, str(tmp_path / "in.jsonl"), str(tmp_path / "o.jsonl"), SAMPLING)


def test_resume_is_refused_over_lines_other_settings_made(engine, prompts_file, tmp_path):
    out = tmp_path / "out.jsonl"
    run_batch(engine, str(prompts_file), str(out), SAMPLING, batch_size=3)
    with pytest.raises(HxError, match=r"out.jsonl:\d+: id 'p\d' was produced differently "
                                      r"\(max_new_tokens 4 there, 5 now\)"):
        run_batch(engine, str(prompts_file), str(out), SamplingParams(max_new_tokens=5))
    rows = read(prompts_file)
    rows[0]["prompt"] += "!"
    write_rows(prompts_file, rows)
    with pytest.raises(HxError, match="another prompt text"):
        run_batch(engine, str(prompts_file), str(out), SAMPLING, batch_size=3)


@pytest.mark.parametrize("change, match", [
    ({"kv_format": "int8"}, "kv 'dense' there, 'int8' now"),
    ({"weight_format": "int4", "embedding_format": "int4"},
     "weights 'dense/dense' there, 'int4/int4' now")])
def test_resume_is_refused_over_lines_other_formats_made(engine, prompts_file, tmp_path,
                                                          change, match):
    """The weights' and the KV cache's formats change the tokens, so a line records them and
    a resume with others is refused (preparing the run is enough: nothing is generated)."""
    out = tmp_path / "out.jsonl"
    run_batch(engine, str(prompts_file), str(out), SAMPLING, batch_size=3)
    other = dataclasses.replace(engine.model, spec=engine.model.spec.replace(**change))
    with pytest.raises(HxError, match=match):
        prepare_batch(other, str(prompts_file), str(out), SAMPLING, False)


def test_a_resumed_sampled_run_equals_an_uninterrupted_one(engine, prompts_file, tmp_path,
                                                           monkeypatch):
    whole = tmp_path / "whole.jsonl"
    run_batch(engine, str(prompts_file), str(whole), SAMPLED, batch_size=3)
    real = engine.generate_ids
    resumed = tmp_path / "resumed.jsonl"
    monkeypatch.setattr(engine, "generate_ids", interrupted_at_second_batch(real))
    with pytest.raises(KeyboardInterrupt):
        run_batch(engine, str(prompts_file), str(resumed), SAMPLED, batch_size=2)
    monkeypatch.setattr(engine, "generate_ids", real)
    run_batch(engine, str(prompts_file), str(resumed), SAMPLED, batch_size=3)
    completions = {r["id"]: r["completion"] for r in read(whole)}
    assert {r["id"]: r["completion"] for r in read(resumed)} == completions
    assert len(set(completions.values())) > 1  # sampled, and not all alike


def test_the_lock_keeps_the_results_it_guards(tmp_path):
    """Taking the lock, and being refused it, leave the output's bytes alone (filelock 3.x
    opened the file it locked with O_TRUNC: on a machine with it, every resume started over)."""
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "p0"}\n{"id": "p1"}\n')
    with output_lock(str(out)):
        assert out.read_text() == '{"id": "p0"}\n{"id": "p1"}\n'
        with pytest.raises(HxError, match="another hx run is writing"):
            with output_lock(str(out)):
                pass
        assert out.read_text() == '{"id": "p0"}\n{"id": "p1"}\n'
    assert out.read_text() == '{"id": "p0"}\n{"id": "p1"}\n'


def test_one_run_at_a_time_and_no_stale_lock(engine, prompts_file, tmp_path):
    """A second writer is refused while a run (or a process) holds the output; a holder
    killed with SIGKILL leaves no lock; no lock file is ever written beside the output."""
    out = tmp_path / "out.jsonl"
    with output_lock(str(out)):
        with pytest.raises(HxError, match="another hx run is writing"):
            run_batch(engine, str(prompts_file), str(out), SAMPLING)
    # a run killed with SIGKILL while it holds the lock leaves none behind
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from hx.batch import output_lock\n"
        f"with output_lock({str(out)!r}):\n    print('locked', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(HxError, match="another hx run is writing"):
        run_batch(engine, str(prompts_file), str(out), SAMPLING)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert run_batch(engine, str(prompts_file), str(out), SAMPLING).generated == len(PROMPTS)
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl", "prompts.jsonl"]
