"""The ``hx`` command: bad input gives one line on stderr and exit status 2, no traceback."""

import json
import os
import re
import subprocess
import sys

import pytest

from hx.models.loader import default_model_path

from gguf_files import write_gguf


def hx(*args, cwd=None, home=None):
    """``hx ARGS`` piped (stdout and stderr captured), with no width given by the environment:
    what a script or CI log gets; ``home``: its $HOME (where profiles are kept)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH")}
    if home is not None:
        env["HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "hx", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300, env=env)


def assert_clean_error(result, *phrases):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hx: error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for phrase in phrases:
        assert phrase in lines[0]


def test_missing_model_file(tmp_path):
    assert_clean_error(hx("generate", "-m", str(tmp_path / "nope.gguf"), "-p", "hi"),
                       "model file not found", "nope.gguf")


def test_truncated_gguf(tmp_path):
    with open(default_model_path(), "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(5_000_000))
    assert_clean_error(hx("generate", "-m", str(tmp_path / "cut.gguf"), "-p", "hi"),
                       "cut.gguf", "truncated")


def test_unsupported_architecture(tmp_path, tiny_model, smollm_metadata):
    write_gguf(tmp_path / "gpt2.gguf", tiny_model.spec.replace(n_layers=1), tiny_model.params,
               smollm_metadata, arch="gpt2")
    assert_clean_error(hx("generate", "-m", str(tmp_path / "gpt2.gguf"), "-p", "hi"),
                       "unsupported architecture 'gpt2'")


def test_prompt_longer_than_context():
    result = hx("generate", "-p", "hello " * 9000)  # default model, 8192-token context
    assert_clean_error(result, "has 9001 tokens", "context is 8192 tokens")


def test_usage_errors(tmp_path):
    assert_clean_error(hx("generate"), "exactly one of --prompt")
    assert_clean_error(hx("generate", "--prompts", str(tmp_path / "p.jsonl")), "needs --output")


@pytest.mark.parametrize("content, phrases", [
    ("", ("has no prompts", "write one JSON object per line")),
    ('{"id": "a", "prompt": "hi", "max_tokens": 3}\n',
     ("p.jsonl:1: unknown key 'max_tokens'", "did you mean 'max_new_tokens'?")),
    ('{"prompt": "hi"}\n{"id": "line-1", "prompt": "yo"}\n', ("p.jsonl:2: duplicate id",)),
])
def test_bad_prompts_file_is_refused_before_the_model_loads(tmp_path, content, phrases):
    """The model named does not exist: a run that loaded it first would say so instead."""
    (tmp_path / "p.jsonl").write_text(content)
    result = hx("generate", "-m", str(tmp_path / "nope.gguf"), "--prompts",
                str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "o.jsonl"))
    assert_clean_error(result, *phrases)
    assert os.listdir(tmp_path) == ["p.jsonl"]


def test_output_folder_is_refused_and_nothing_is_left(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    (tmp_path / "out").mkdir()
    result = hx("generate", "--prompts", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "out"))
    assert_clean_error(result, f"--output {tmp_path / 'out'} is a folder",
                       str(tmp_path / "out" / "completions.jsonl"))
    assert sorted(os.listdir(tmp_path)) == ["out", "p.jsonl"]
    assert os.listdir(tmp_path / "out") == []


def test_piped_help_and_tables_are_not_cut():
    """Piped, rich would squeeze help and tables to 80 columns, cutting words with "…"."""
    result = hx("bench", "--help")
    assert result.returncode == 0, result.stderr
    assert "[default: all-accelerator,all-host,stream-all,host:SCORE+MLP1]" in result.stdout
    assert "…" not in result.stdout
    code = ("from rich.table import Table\n"
            "from hx.cli.console import print_table\n"
            "t = Table(title='t')\n"
            "for i in range(8):\n"
            "    t.add_column(f'column {i}')\n"
            "t.add_row(*['SmolLM2-135M-Instruct'] * 8)\n"
            "print_table(t)\nprint_table(t, stderr=True)\n")
    table = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items() if k != "COLUMNS"})
    for text in (table.stdout, table.stderr):
        assert text.count("SmolLM2-135M-Instruct") == 8 and "…" not in text, text


TRICKY = ["a b c", "[INST] hello [/INST]", "[b]bold?[/b] [a-z]+ 😀", "[red]x"]


def test_batch_run_on_tiny_gguf(tmp_path, tiny_model, smollm_metadata, devices):
    """Ids and prompts that look like rich markup are written and echoed verbatim; piped
    stdout is exactly the lines appended to the output; a second run resumes; a run while
    another holds the output, or with a bad output path, is refused before the model loads."""
    from hx.batch import output_lock

    write_gguf(tmp_path / "tiny.gguf", tiny_model.spec, tiny_model.params, smollm_metadata)
    (tmp_path / "p.jsonl").write_text("".join(
        json.dumps({"id": f"[i]{i}", "prompt": p}, ensure_ascii=False) + "\n"
        for i, p in enumerate(TRICKY)))
    out = tmp_path / "o.jsonl"
    from profiles import gpu_like

    gpu_like().save(str(tmp_path / "gpu.json"))
    args = ("generate", "-m", str(tmp_path / "tiny.gguf"), "--prompts", str(tmp_path / "p.jsonl"),
            "-o", str(out), "--max-new-tokens", "3", "--host-ops", "score,mlp2",
            "--profile", str(tmp_path / "gpu.json"))
    result = hx(*args)
    assert result.returncode == 0, result.stderr
    # a prompts file runs in throughput mode, its block planned on the profile given
    assert re.search(r"throughput mode: \d micro-batch(es)? x \d rows, joins of \d+, plan "
                     r"host:SCORE,MLP2",
                     result.stderr)
    assert result.stdout == out.read_text(encoding="utf-8")  # byte for byte
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(f"[i]{i}" for i in range(len(TRICKY)))
    assert {r["prompt"] for r in rows} == set(TRICKY)
    assert all(r["completion_tokens"] <= 3 for r in rows)
    assert "host:SCORE,MLP2" in result.stderr
    # the header says EMULATED exactly when the accelerator is a CPU device standing in for one
    assert ("EMULATED" in result.stderr) == devices.emulated
    again = hx(*args)
    assert again.returncode == 0 and f"0 generated, {len(TRICKY)} already" in again.stderr
    assert again.stdout == "" and "choosing a block" not in again.stderr  # nothing to plan
    assert "tokens/s (generated / wall)" in result.stderr  # the summary table, on stderr
    assert "…" not in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["gpu.json", "o.jsonl", "p.jsonl", "tiny.gguf"]
    with output_lock(str(out)):
        assert_clean_error(hx(*args), "another hx run is writing", str(out))
    assert_clean_error(hx(*args[:5], "-o", str(tmp_path / "missing" / "o.jsonl")),
                       "does not exist")
    assert_clean_error(hx(*args[:5], "-o", str(tmp_path / "p.jsonl")), "is the prompts file")


def test_one_prompt_with_output_writes_the_line_a_prompts_file_gets(tmp_path, tiny_model,
                                                                    smollm_metadata):
    """``-p TEXT -o FILE`` replaces FILE with the prompt's result line: the keys and values a
    --prompts run writes for the same prompt (id "prompt"), timings aside; an output that
    cannot be written is refused before the model loads."""
    write_gguf(tmp_path / "tiny.gguf", tiny_model.spec, tiny_model.params, smollm_metadata)
    out, batch = tmp_path / "one.jsonl", tmp_path / "batch.jsonl"
    out.write_text("an older run's line\n")
    common = ("generate", "-m", str(tmp_path / "tiny.gguf"), "--max-new-tokens", "3")
    result = hx(*common, "-p", "[b]Hi", "-o", str(out))
    assert result.returncode == 0, result.stderr
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1
    row = json.loads(lines[0])
    assert row["completion"] + "\n" == result.stdout
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "prompt", "prompt": "[b]Hi"}) + "\n")
    assert hx(*common, "--prompts", str(tmp_path / "p.jsonl"), "-o", str(batch),
              "--mode", "latency").returncode == 0
    expected = json.loads(batch.read_text(encoding="utf-8"))
    timings = ("ttft_s", "decode_tok_s")
    assert {k: v for k, v in row.items() if k not in timings} == {
        k: v for k, v in expected.items() if k not in timings}
    assert_clean_error(hx("generate", "-m", str(tmp_path / "nope.gguf"), "-p", "hi", "-o",
                          str(tmp_path / "missing" / "o.jsonl")), "does not exist")


@pytest.mark.slow
def test_host_memory_below_the_weights_plans_on_a_quick_profile(tmp_path, smollm_metadata):
    """Host memory of 40 % of the weights, accelerator 50 %: no layer split fits, so the
    default policy plans with a profile, and a quick one with its disk read rate suffices
    (a command measures one in <= 20 s when none is saved; one is kept here beforehand to
    keep the test short): a CP-SAT plan, which can keep weights on disk, no full profile."""
    import dataclasses

    import jax
    import numpy as np

    from conftest import TINY
    from hx.models.decoder import init_params
    from hx.planner.profile import QUICK_PATH
    from profiles import gpu_like

    spec = TINY.replace(name="wide", tie_embeddings=False, d_ff=16384)  # 63 MB, layers 60 %
    write_gguf(tmp_path / "wide.gguf", spec,
               jax.tree.map(np.asarray, init_params(spec, seed=1)), smollm_metadata)
    quick = tmp_path / os.path.relpath(QUICK_PATH, os.path.expanduser("~"))
    quick.parent.mkdir(parents=True)
    dataclasses.replace(gpu_like(), quick=True, disk_read_bandwidth=2e9).save(str(quick))
    result = hx("generate", "-m", str(tmp_path / "wide.gguf"), "-p", "Hi", "--max-new-tokens",
                "3", "--accelerator-memory", str(spec.weight_bytes // 2), "--host-memory",
                str(spec.weight_bytes * 2 // 5), home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "using the quick one" in result.stderr and "plan cpsat" in result.stderr


def test_bench_compares_weight_formats_on_the_link(tmp_path):
    """``hx bench --weights dense,int8`` benches each format under one plan: int8's matrices
    stream about a quarter of float32's bytes per decode step (a byte and a 32nd of a float16
    scale per weight, against four)."""
    result = hx("bench", "-m", "smollm2-135m:1L", "--dtype", "float32", "--weights",
                "dense,int8", "--plans", "stream-all", "--batches", "1", "--steps", "2",
                "--context", "16", "--json", str(tmp_path / "bench.json"))
    assert result.returncode == 0, result.stderr
    dense, int8 = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert dense["weights"].startswith("dense/") and int8["weights"].startswith("int8/")
    assert 0 < int8["h2d_weight_bytes"] < 0.3 * dense["h2d_weight_bytes"]
    assert "H2D MB" in result.stdout


def test_ablate_predicts_and_measures_batches_and_blocks(tmp_path):
    """``hx ablate --batches 1,2x2``: a batch of one and a block of two micro-batches of two
    (throughput mode's schedule), each predicted (here on a GPU-like profile) and measured on
    this machine; the table, the count within tolerance and the JSON agree. A bad batch is
    refused before the model loads."""
    from profiles import gpu_like

    gpu_like().save(str(tmp_path / "gpu.json"))
    result = hx("ablate", "-m", "smollm2-135m:1L", "--profile", str(tmp_path / "gpu.json"),
                "--budgets", "2", "--batches", "1,2x2", "--policies", "all-accelerator",
                "--runs", "1", "--steps", "2", "--json", str(tmp_path / "ablate.json"))
    assert result.returncode == 0, result.stderr
    written = json.loads((tmp_path / "ablate.json").read_text())
    one, block = written["rows"]
    assert [(r["batch"], r["micro_batches"]) for r in (one, block)] == [(1, 1), (2, 2)]
    for r in (one, block):
        assert r["predicted_s"] > 0 and r["measured_s"] > 0 and r["error"] is None
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["micro_batches"]
                                                  / r["measured_s"])
        assert r["within"] == (abs(r["predicted_s"] / r["measured_s"] - 1)
                               <= written["tolerance"])
    assert block["predicted_s"] > one["predicted_s"]  # four rows in two passes, against one
    assert re.search(r"│\s+200% │\s+2x2 │ all-accelerator", result.stdout)
    within = sum(r["within"] for r in (one, block))
    assert f"{within} of 2 predictions within 15% of the measured step" in result.stdout
    assert_clean_error(hx("ablate", "--batches", "1,2x"), "bad batch '2x'", "NxB")


def test_simulate_prices_an_allreduce_what_if_and_ablate_expands_every_layout():
    """``hx simulate --tp 2 --allreduce-bandwidth``: the same plan's run with faster
    all-reduces is shorter, and the run's seconds are its tokens over tokens/s;
    ``MACHINE:all`` (``hx ablate --hardware 4xa10g:all``) is every tp x pp layout of 1 to all
    its GPUs: the layouts of the survey's table (issue 28)."""
    from typer.testing import CliRunner

    from hx.cli import bench, generate, planning, simulate  # noqa: F401  (the commands)
    from hx.cli.common import app
    from hx.cli.simulate import every_layout
    from hx.errors import HxError

    args = ["simulate", "-m", "llama2-7b:1L", "--hardware", "4xa10g", "--tp", "2",
            "--policy", "all-accelerator", "--workload", "4:128+8"]
    runs = []
    for extra in ([], ["--allreduce-bandwidth", "1e12"]):
        result = CliRunner().invoke(app, args + extra)
        assert result.exit_code == 0, result.output
        rate, seconds = (float(re.search(rf"│ {name}\s+│\s+([\d.]+) │", result.output)[1])
                         for name in ("tokens/s", "run s"))
        assert seconds == pytest.approx(4 * 8 / rate, rel=1e-2)
        runs.append(seconds)
    assert "all-reduce at 1000 GB/s" in result.output and 0 < runs[1] < runs[0]
    refused = CliRunner().invoke(app, args[:5] + ["--allreduce-bandwidth", "1e12"])
    assert isinstance(refused.exception, HxError) and "--tp 2 or more" in str(refused.exception)
    assert every_layout(("t4", "4xa10g:all")) == (
        "t4", "4xa10g", "4xa10g:pp2", "4xa10g:tp2", "4xa10g:pp3", "4xa10g:tp3", "4xa10g:pp4",
        "4xa10g:tp2xpp2", "4xa10g:tp4")
    with pytest.raises(HxError, match="several-GPU machine"):
        every_layout(("t4:all",))


QUARTER = str(538_060_032 // 4)  # 25 % of SmolLM2's float32 weight bytes (--weights dense)


def test_quarter_budget_stream_all_with_trace(tmp_path):
    result = hx("generate", "-p", "The capital of France is", "--max-new-tokens", "4",
                "--accelerator-memory", QUARTER, "--policy", "stream-all",
                "--trace", str(tmp_path / "run.json"))
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "plan stream-all" in result.stderr and "overlap fraction" in result.stderr
    moved = re.search(r"a decode step moved H2D ([\d.]+) MiB", result.stderr)
    assert moved and float(moved[1]) > 0  # stream-all copies the weights every step
    trace = json.loads((tmp_path / "run.json").read_text())["traceEvents"]
    assert {e["args"]["name"] for e in trace if e["name"] == "thread_name"} == {
        "accelerator compute", "host compute", "H2D", "D2H"}


def test_generate_over_a_mesh_of_two_stages_of_two():
    """SmolLM2 (its 3 KV heads padded to 4) in 2 pipeline stages of 2 tensor-parallel
    emulated accelerators, weights streamed at an eighth of its weights per accelerator: the
    same answer, each stage's peak reported against its budget."""
    result = hx("generate", "-p", "The capital of France is", "--max-new-tokens", "4",
                "--mesh", "tp=2,pp=2", "--weights", "dense", "--policy", "stream-all",
                "--accelerator-memory", str(538_060_032 // 8))
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "4 x cpu (1, 2, 3, 4), tensor parallel" in result.stderr
    assert "2 pipeline stages" in result.stderr
    peaks = re.search(r"peak by stage: ([\d.]+) MiB of ([\d.]+) MiB, ([\d.]+) MiB of", result.stderr)
    assert peaks and 0 < float(peaks[1]) <= float(peaks[2]) and float(peaks[3]) > 0
    assert_clean_error(hx("generate", "-p", "hi", "--mesh", "tp=2", "--devices", "2"),
                       "not both")
    assert_clean_error(hx("generate", "-p", "hi", "--mesh", "dp=2"), "write tp=A,pp=B")
    assert_clean_error(hx("generate", "-p", "hi", "--mesh", "tp=2", "--coordinator",
                          "localhost:1"), "one per process")


def test_plan_over_budget_is_rejected():
    result = hx("generate", "-p", "hi", "--accelerator-memory", QUARTER, "--weights", "dense",
                "--policy", "all-accelerator")
    assert_clean_error(result, "does not fit the accelerator memory budget", "over by")


@pytest.mark.slow
def test_plan_command_and_cpsat_by_default(tmp_path):
    from profiles import gpu_like

    gpu_like().save(str(tmp_path / "gpu.json"))
    # the host of this machine cannot hold what 24 GB of accelerator leaves of a 70B model
    result = hx("plan", "-m", "llama2-70b", "--accelerator-memory", "24GB", "--batch", "16",
                "--profile", str(tmp_path / "gpu.json"))
    assert_clean_error(result, "beside the host memory budget of")
    result = hx("plan", "-m", "llama2-70b", "--accelerator-memory", "24GB", "--batch", "16",
                "--host-memory", "400GB", "--profile", str(tmp_path / "gpu.json"),
                "-o", str(tmp_path / "plan.json"))
    assert result.returncode == 0, result.stderr
    assert "CP-SAT OPTIMAL" in result.stdout
    # the objective says what it measures, beside the simulator's step and run per decode step
    assert re.search(r"objective [\d.]+ ms = the planner's own price of the run per decode step",
                     result.stdout)
    assert re.search(r"predicted \(the simulator, whole plan\): decode step [\d.]+ ms .*; run "
                     r"\(prefill, then \d+ decode steps\) [\d.]+ s = [\d.]+ ms per decode step",
                     result.stdout)
    assert "[gpu-like test profile]" in result.stdout  # bracketed names are text, not markup
    assert json.loads((tmp_path / "plan.json").read_text())["name"] == "cpsat"
    result = hx("plan", "-m", "llama2-70b", "--accelerator-memory", "1GB",
                "--policy", "all-accelerator", "--profile", str(tmp_path / "gpu.json"))
    assert_clean_error(result, "minimum feasible budget for it is")
    # generate picks the CP-SAT plan when the model does not fit and a profile is given
    result = hx("generate", "-p", "Hi", "--max-new-tokens", "2", "--accelerator-memory", QUARTER,
                "--weights", "dense", "--profile", str(tmp_path / "gpu.json"))
    assert result.returncode == 0, result.stderr
    assert "plan cpsat" in result.stderr


# Runs ``hx`` and SIGKILLs itself right after its LINES-th output line is fsynced: a kill at
# a fixed point of the run, whatever the machine's speed.
KILLED_AFTER = """
import os, signal, sys
fsync, lines = os.fsync, [0]
def fsync_then_die(fd):
    fsync(fd)
    lines[0] += 1
    if lines[0] == {lines}:
        os.kill(os.getpid(), signal.SIGKILL)
os.fsync = fsync_then_die
sys.argv = ["hx", *{args!r}]
from hx.cli import main
main()
"""


def killed_twice_then_finished(args, out, kills=(3, 4)):
    """Run ``hx *args`` writing ``out`` and SIGKILL it after each of ``kills`` new lines,
    then run it to the end. Returns how many runs were killed (and left those lines)."""
    import signal

    killed, written = 0, 0
    for lines in kills:
        run = subprocess.run([sys.executable, "-c", KILLED_AFTER.format(lines=lines, args=args)],
                             capture_output=True, text=True)
        written += lines
        killed += run.returncode == -signal.SIGKILL and \
            out.read_bytes().count(b"\n") == written
    result = hx(*args)
    assert result.returncode == 0, result.stderr
    return killed


@pytest.mark.slow
def test_runs_killed_twice_resume_to_the_uninterrupted_output(tmp_path, tiny_model,
                                                               smollm_metadata):
    """Acceptance A at CI scale: 12 prompts, half greedy and half sampled (temperature 0.8
    per line, seeded), killed with SIGKILL twice: every id exactly once, completions equal to
    an uninterrupted run's."""
    write_gguf(tmp_path / "tiny.gguf", tiny_model.spec, tiny_model.params, smollm_metadata)
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    (tmp_path / "p.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "prompt": " ".join(words[:1 + i % 8]),
                    **({"temperature": 0.8} if i % 2 else {})}) + "\n"
        for i in range(12)))

    def args(name):
        return ("generate", "-m", str(tmp_path / "tiny.gguf"), "--prompts",
                str(tmp_path / "p.jsonl"), "-o", str(tmp_path / name), "--max-new-tokens", "6",
                "--micro-batch", "2", "--micro-batches", "2", "--temperature", "0",
                "--seed", "5")

    whole = hx(*args("whole.jsonl"))
    assert whole.returncode == 0, whole.stderr
    assert killed_twice_then_finished(args("killed.jsonl"), tmp_path / "killed.jsonl") == 2
    rows = [json.loads(line) for line in (tmp_path / "killed.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(f"q{i}" for i in range(12))
    expected = {json.loads(line)["id"]: json.loads(line)["completion"] for line in
                (tmp_path / "whole.jsonl").read_text().splitlines()}
    assert {r["id"]: r["completion"] for r in rows} == expected
    assert {r["id"]: r["produced_by"]["temperature"] for r in rows} == {
        f"q{i}": 0.8 if i % 2 else 0 for i in range(12)}
