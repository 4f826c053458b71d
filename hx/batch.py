"""Scripted batch generation: JSONL prompts in, JSONL completions out, resumable.

Input lines are ``{"id": ..., "prompt": ...}`` (``id``, a string or an integer, defaults to
``"line-N"``, N the line number), with optional per-line ``max_new_tokens``,
``temperature``, ``top_k``, ``top_p``, ``seed`` and ``stop`` (a list of strings) overriding
the run's settings; any other key is refused. Each result line is written,
flushed and fsynced the moment its sequence ends (``Engine.generate_ids``' ``on_finish``),
and records what produced it (model, dtype, chat template, sampling settings, a hash of the
prompt). A rerun skips ids already in the
output (a torn last line from a killed run is cut first) and refuses to resume over a line
that other settings produced. Each prompt samples with a seed derived from the run's seed and
its id (``sampling.row_seed``), so a resumed sampled run equals an uninterrupted one. One run
at a time writes an output file (``output_lock``: a ``flock`` on the file itself that the kernel
drops when the process dies, so a killed run leaves none behind).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fcntl
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from hx.errors import HxError
from hx.generate import Completion, Engine, encode_prompt
from hx.models.loader import Model
from hx.models.spec import ModelSpec
from hx.prefill import check_prompts
from hx.sampling import SamplingParams, row_seed
from hx.workload import Workload


@dataclass
class BatchSummary:
    """Counts of a batch run."""

    total: int
    skipped: int
    generated: int


OPTIONS = {"max_new_tokens": int, "temperature": (int, float), "top_k": int,
           "top_p": (int, float), "seed": int, "stop": list}  # per-line overrides
KEYS = ("id", "prompt", *OPTIONS)  # every key a prompt line may have
EXAMPLE_LINE = '{"id": "q1", "prompt": "What is the capital of France?"}'


def read_prompts(path: str) -> list[dict[str, Any]]:
    """Parse a JSONL prompt file (module doc): one JSON object per non-blank line.

    A line without an ``id`` gets the id ``"line-N"`` (N its line number). Ids are strings or
    integers, and two ids that read the same as text (``1`` and ``"1"``) are one id: they
    would be told apart in the output only by their JSON type.
    Returns:
      rows ``{"id", "prompt", ...}`` in file order.
    Raises:
      HxError: missing file, no prompt lines, a line that is not a JSON object with a string
        ``prompt``, a key outside ``KEYS``, an id that is not a string or an integer, or a
        duplicate id.
    """
    if not os.path.isfile(path):
        raise HxError(f"prompts file not found: {path}")
    rows, seen = [], {}  # id as text -> line number
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                row = _prompt_line(line, f"{path}:{number}")
                row.setdefault("id", f"line-{number}")
                if str(row["id"]) in seen:
                    raise HxError(f"{path}:{number}: duplicate id {row['id']!r} (line "
                                  f"{seen[str(row['id'])]} has it, as text); give each line "
                                  "its own id")
                seen[str(row["id"])] = number
                rows.append(row)
    if not rows:
        raise HxError(f"prompts file {path} has no prompts; write one JSON object per line, "
                      f"e.g. {EXAMPLE_LINE}")
    return rows


def _prompt_line(line: str, where: str) -> dict[str, Any]:
    """One prompt line parsed and its keys and id checked (``read_prompts``); ``where`` is
    ``path:line`` for messages.

    Raises:
      HxError: not a JSON object with a string ``prompt``, an unknown key (the message names
        the close match, if any, and the keys accepted), or an id of another type than a
        string or an integer.
    """
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise HxError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
        raise HxError(f"{where}: expected an object with a string 'prompt', e.g. {EXAMPLE_LINE}")
    for key in row:
        if key not in KEYS:
            close = difflib.get_close_matches(key, KEYS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise HxError(f"{where}: unknown key {key!r}; {hint}a prompt line takes "
                          f"{', '.join(KEYS)}")
    if "id" in row and (isinstance(row["id"], bool) or not isinstance(row["id"], (str, int))):
        raise HxError(f"{where}: 'id' must be a string or an integer, got {row['id']!r}")
    return row


def check_output_path(prompts_path: str | None, output_path: str) -> None:
    """Refuse, before any work, an output that cannot be written or is the input
    (``prompts_path``; None: a run of one prompt, no file in).

    Raises:
      HxError: the output is a folder, its folder is missing or not writable, the output
        exists and is not writable, or it is the prompts file.
    """
    if os.path.isdir(output_path):
        raise HxError(f"--output {output_path} is a folder; name a file in it, e.g. "
                      f"{os.path.join(output_path, 'completions.jsonl')}")
    folder = os.path.dirname(os.path.abspath(output_path))
    if not os.path.isdir(folder):
        raise HxError(f"output folder {folder} does not exist; create it or choose another "
                      "--output")
    if os.path.exists(output_path):
        if not os.access(output_path, os.W_OK):
            raise HxError(f"output file {output_path} is not writable")
        if prompts_path is not None and os.path.exists(prompts_path) and \
                os.path.samefile(prompts_path, output_path):
            raise HxError(f"--output {output_path} is the prompts file; choose another file")
    elif not os.access(folder, os.W_OK):
        raise HxError(f"output folder {folder} is not writable; choose another --output")


@contextlib.contextmanager
def output_lock(output_path: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the output file itself while a run writes it: the
    kernel drops it when the process ends, however it ends (SIGKILL included), so no lock
    outlives its run and no file is left beside the output. The file is opened without
    ``O_TRUNC`` (it holds the results a resume keeps: filelock 3.x truncates the file it
    locks, which erased them), created if missing; a run that leaves it empty removes it (a
    failed first run leaves nothing behind).

    Raises:
      HxError: another live run holds the lock, or the file system cannot lock the file.
    """
    path = os.path.realpath(output_path)
    created = not os.path.exists(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise HxError(f"another hx run is writing {output_path}; wait for it to finish or "
                      "choose another --output") from None
    except OSError as e:
        os.close(fd)
        raise HxError(f"cannot lock {output_path} ({e.strerror}); choose an --output on a "
                      "local file system") from None
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            if created and os.path.getsize(path) == 0:
                os.remove(path)  # still locked: a contender fails or locks a fresh file
        os.close(fd)  # releases the lock


def prompt_hash(prompt: str) -> str:
    """First 16 hex digits of the prompt's SHA-256 (recorded in each result line)."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:16]


def row_sampling(row: dict[str, Any], base: SamplingParams, where: str
                 ) -> tuple[SamplingParams, tuple[str, ...]]:
    """The sampling of one input row: ``base`` with the row's overrides, and its stop strings.

    Raises:
      HxError: an override of the wrong type or out of range (``where`` names the line).
    """
    changes: dict[str, Any] = {}
    for key, kinds in OPTIONS.items():
        if key not in row:
            continue
        value = row[key]
        if isinstance(value, bool) or not isinstance(value, kinds):
            kind = "a list of strings" if key == "stop" else (
                "an integer" if kinds is int else "a number")
            raise HxError(f"{where}: '{key}' must be {kind}, got {value!r}")
        changes[key] = value
    stops = changes.pop("stop", [])
    if not all(isinstance(x, str) and x for x in stops):
        raise HxError(f"{where}: 'stop' must be a list of non-empty strings")
    try:
        return dataclasses.replace(base, **changes), tuple(stops)
    except HxError as e:
        raise HxError(f"{where}: {e}") from None


def produced_by(spec: ModelSpec, sampling: SamplingParams, stops: tuple[str, ...], chat: bool
                ) -> dict[str, Any]:
    """What a result line records of how it was made: a resume must match it (the weights'
    formats, ``matrices/embedding``, and the KV cache's included: they change the tokens)."""
    return {"model": spec.name, "dtype": spec.dtype,
            "weights": f"{spec.weight_format}/{spec.embedding_format}", "kv": spec.kv_format,
            "chat": chat,
            "max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
            "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": sampling.seed,
            "stop": list(stops)}


def completed_rows(path: str) -> dict[Any, tuple[int, dict[str, Any]]]:
    """Result lines already in an output file: id -> (line number, line).

    Every complete result line ends with a newline; bytes after the last newline are an
    interrupted write and are cut from the file.
    Raises:
      HxError: a complete line is not a result (the file is not an hx output).
    """
    if not os.path.exists(path):
        return {}
    with open(path, "rb") as f:
        data = f.read()
    complete = data[:data.rfind(b"\n") + 1]
    if len(complete) < len(data):
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    done = {}
    for number, line in enumerate(complete.splitlines(), 1):
        if not line.strip():
            continue
        try:
            result = json.loads(line)
            done[result["id"]] = (number, result)
        except (json.JSONDecodeError, KeyError, TypeError):
            raise HxError(f"{path}:{number}: existing output line is not a result; move the "
                          "file away or choose another --output") from None
    return done


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str | None:
    """``text`` up to the earliest stop string, or None when none occurs."""
    ends = [text.find(s) for s in stops if s in text]
    return text[:min(ends)] if ends else None


def json_line(result: dict[str, Any]) -> str:
    """A result as its output line: JSON (text as it is, not escaped to ASCII) and a newline."""
    return json.dumps(result, ensure_ascii=False) + "\n"


def write_result(output_path: str, result: dict[str, Any]) -> None:
    """Write ``result`` as the one line of ``output_path`` (replacing what it held), flushed
    and fsynced: the output of a run of one prompt (``hx generate -p TEXT -o FILE``)."""
    with open(output_path, "w", encoding="utf-8") as out:
        out.write(json_line(result))
        out.flush()
        os.fsync(out.fileno())


def result_row(row: dict[str, Any], completion: Completion, provenance: dict[str, Any],
               stops: tuple[str, ...] = ()) -> dict[str, Any]:
    """The output line of one prompt (its text cut at the first stop string)."""
    text, reason = completion.text, completion.finish_reason
    cut = cut_at_stop(text, stops)
    if cut is not None:
        text, reason = cut, "stop"
    return {"id": row["id"], "prompt": row["prompt"], "completion": text,
            "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": len(completion.token_ids),
            "finish_reason": reason,
            "ttft_s": round(completion.ttft_s, 4),
            "decode_tok_s": (round(completion.decode_tok_s, 2)
                             if completion.decode_tok_s is not None else None),
            "prompt_sha256": prompt_hash(row["prompt"]),
            "produced_by": provenance}


@dataclass
class BatchJob:
    """Prompts of a JSONL file that still need an answer, tokenized and checked.

    Attributes:
      output_path: the results file being appended to.
      todo: input rows not yet answered.
      token_ids: their token ids.
      sampling: each row's sampling (the run's, with the row's overrides; stop strings that
        are one token added to ``stop_ids``).
      stops: each row's stop strings.
      provenance: each row's ``produced_by`` record.
      total: rows in the input file.
    """

    output_path: str
    todo: list[dict[str, Any]]
    token_ids: list[list[int]]
    sampling: list[SamplingParams]
    stops: list[tuple[str, ...]]
    provenance: list[dict[str, Any]]
    total: int

    def workload(self, batch_size: int, spec: ModelSpec) -> Workload:
        """Largest shapes a static batch of this job runs at (what a plan must fit)."""
        longest = max((len(t) for t in self.token_ids), default=1)
        most_new = max((p.max_new_tokens for p in self.sampling), default=1)
        return Workload.for_prompts(max(1, min(batch_size, len(self.todo))), longest,
                                    most_new, spec)

    def cache_slots(self, spec: ModelSpec, chunk: int) -> int:
        """KV-cache slots of an iteration-level run of this job (``continuous.run_slots``)."""
        from hx.continuous import run_slots

        return run_slots([len(t) for t in self.token_ids] or [1],
                         [p.max_new_tokens for p in self.sampling] or [1], spec, chunk)

    def run(self, engine: Engine, batch_size: int = 1,
            on_result: Callable[[dict[str, Any]], None] | None = None,
            block: Workload | None = None, join_min: int = 1) -> BatchSummary:
        """Generate the remaining prompts, appending each result the moment its row ends,
        flushed and fsynced.

        Rows with the same sampling (token limits aside) run together, longest prompts first.
        Without ``block``
        they form static batches of ``batch_size`` (latency mode: a row that ends early
        waits, idle, for its batch's last step); with ``block`` -- (B rows, join chunk, S,
        N micro-batches) -- they run with iteration-level scheduling
        (``continuous.ContinuousBatcher``: a row that ends is refilled at the next step, or
        once ``join_min`` rows are free).
        One KV-cache length serves the whole run (each shape compiles once).
        Raises:
          HxError: a batch size below 1, or a plan that does not fit the memory budget.
        """
        from hx.continuous import ContinuousBatcher

        if batch_size < 1:
            raise HxError(f"batch size must be >= 1, got {batch_size}")
        summary = BatchSummary(self.total, self.total - len(self.todo), len(self.todo))
        if not self.todo:
            return summary
        ids = self.token_ids
        groups: dict[tuple, list[int]] = {}  # rows that differ in token limits run together
        for i in sorted(range(len(ids)), key=lambda i: -len(ids[i])):
            key = dataclasses.replace(self.sampling[i], max_new_tokens=1), self.stops[i]
            groups.setdefault(key, []).append(i)
        with open(self.output_path, "a", encoding="utf-8") as out:
            def writer(rows: list[int], stops: tuple[str, ...]):
                def write(r: int, completion: Completion) -> None:
                    i = rows[r]
                    result = result_row(self.todo[i], completion, self.provenance[i], stops)
                    out.write(json_line(result))
                    out.flush()
                    os.fsync(out.fileno())
                    if on_result:
                        on_result(result)
                return write

            for (sampling, stops), rows in groups.items():
                seeds = [row_seed(sampling.seed, self.todo[i]["id"]) for i in rows]
                limits = [self.sampling[i].max_new_tokens for i in rows]
                if block is not None:
                    batcher = ContinuousBatcher.for_block(engine, block, join_min)
                    batcher.run([ids[i] for i in rows], sampling, seeds, writer(rows, stops),
                                block.cache_slots, limits)
                    continue
                slots = self.workload(batch_size, engine.model.spec).cache_slots
                for start in range(0, len(rows), batch_size):
                    part = slice(start, start + batch_size)
                    engine.generate_ids([ids[i] for i in rows[part]], sampling, slots,
                                        seeds[part], writer(rows[part], stops), limits[part])
        return summary


def prepare_batch(model: Model, prompts_path: str, output_path: str,
                  sampling: SamplingParams = SamplingParams(), chat: bool = False) -> BatchJob:
    """Read the prompts, drop those already answered in ``output_path``, tokenize and check
    the rest, so that a bad prompt fails before any work.

    Raises:
      HxError: bad input file or per-line option, a prompt that is empty or longer than the
        context, or an answered id whose line other settings (or another prompt) produced.
    """
    rows = read_prompts(prompts_path)
    done = completed_rows(output_path)
    todo, samplings, stops, records = [], [], [], []
    for row in rows:
        params, row_stops = row_sampling(row, sampling, f"{prompts_path}: id {row['id']!r}")
        record = produced_by(model.spec, params, row_stops, chat)
        if row["id"] in done:
            line, old = done[row["id"]]
            same = (old.get("prompt_sha256") == prompt_hash(row["prompt"])
                    and old.get("produced_by") == record)
            if not same:
                raise HxError(f"{output_path}:{line}: id {row['id']!r} was produced "
                              f"differently ({_differences(old, row, record)}); resume with "
                              "the same prompt, model and settings, or choose another --output")
            continue
        tok = model.tokenizer
        pieces = ([i for i in tok.encode(x) if i != tok.bos_id] for x in row_stops)
        single = tuple(t[0] for t in pieces if len(t) == 1)  # these end generation early
        todo.append(row)
        samplings.append(dataclasses.replace(params, stop_ids=params.stop_ids + single))
        stops.append(row_stops)
        records.append(record)
    ids = [encode_prompt(model.tokenizer, r["prompt"], chat) for r in todo]
    check_prompts([len(t) for t in ids], model.spec, [repr(r["id"]) for r in todo])
    return BatchJob(output_path, todo, ids, samplings, stops, records, total=len(rows))


def _differences(old: dict[str, Any], row: dict[str, Any], record: dict[str, Any]) -> str:
    """``key there -> here`` for each way an existing result line differs from this run's."""
    there = old.get("produced_by")
    if not isinstance(there, dict):
        return "the line records no settings: an older hx wrote it"
    diffs = [f"{key} {there.get(key)!r} there, {value!r} now"
             for key, value in record.items() if there.get(key) != value]
    if old.get("prompt_sha256") != prompt_hash(row["prompt"]):
        diffs.insert(0, "another prompt text")
    return "; ".join(diffs)


def run_batch(engine: Engine, prompts_path: str, output_path: str, sampling: SamplingParams,
              batch_size: int = 1, chat: bool = False,
              on_result: Callable[[dict[str, Any]], None] | None = None,
              block: Workload | None = None, join_min: int = 1) -> BatchSummary:
    """Answer every prompt of ``prompts_path`` not yet in ``output_path`` (``prepare_batch``
    then ``BatchJob.run``: static batches of ``batch_size``, or iteration-level scheduling
    over ``block``, joins waiting for ``join_min`` free rows), holding ``output_lock``."""
    check_output_path(prompts_path, output_path)
    with output_lock(output_path):
        job = prepare_batch(engine.model, prompts_path, output_path, sampling, chat)
        return job.run(engine, batch_size, on_result, block, join_min)
