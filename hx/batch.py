"""Scripted batch generation: JSONL prompts in, JSONL completions out, resumable.

Input lines are ``{"id": ..., "prompt": ...}`` (``id`` defaults to the line number). Each result
line is written and flushed as soon as its batch finishes; a rerun skips ids already in the
output (a half-written last line from an interrupted run is dropped first), so nothing is lost
or duplicated.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from hx.errors import HxError
from hx.generate import Completion, Engine, check_prompts, encode_prompt
from hx.models.loader import Model
from hx.models.spec import ModelSpec
from hx.sampling import SamplingParams
from hx.workload import Workload


@dataclass
class BatchSummary:
    """Counts of a batch run."""

    total: int
    skipped: int
    generated: int


def read_prompts(path: str) -> list[dict[str, Any]]:
    """Parse a JSONL prompt file.

    Returns:
      rows ``{"id", "prompt", ...}`` in file order (extra keys are kept).
    Raises:
      HxError: missing file, a line that is not a JSON object with a string ``prompt``,
        or a duplicate id.
    """
    if not os.path.isfile(path):
        raise HxError(f"prompts file not found: {path}")
    rows, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise HxError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise HxError(f"{path}:{number}: expected an object with a string 'prompt'")
            row.setdefault("id", number)
            if row["id"] in seen:
                raise HxError(f"{path}:{number}: duplicate id {row['id']!r}")
            seen.add(row["id"])
            rows.append(row)
    return rows


def completed_ids(path: str) -> set:
    """Ids already present in an output file.

    Every complete result line ends with a newline; bytes after the last newline are an
    interrupted write and are cut from the file.
    Raises:
      HxError: a complete line is not a result (the file is not an hx output).
    """
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        data = f.read()
    complete = data[:data.rfind(b"\n") + 1]
    if len(complete) < len(data):
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    ids = set()
    for number, line in enumerate(complete.splitlines(), 1):
        if not line.strip():
            continue
        try:
            ids.add(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise HxError(f"{path}:{number}: existing output line is not a result; move the "
                          "file away or choose another --output") from None
    return ids


def result_row(row: dict[str, Any], completion: Completion) -> dict[str, Any]:
    """The output line of one prompt."""
    return {"id": row["id"], "prompt": row["prompt"], "completion": completion.text,
            "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": len(completion.token_ids),
            "finish_reason": completion.finish_reason,
            "ttft_s": round(completion.ttft_s, 4),
            "decode_tok_s": (round(completion.decode_tok_s, 2)
                             if completion.decode_tok_s is not None else None)}


def _chunks(items: list, size: int) -> Iterable[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


@dataclass
class BatchJob:
    """Prompts of a JSONL file that still need an answer, tokenized and checked.

    Attributes:
      output_path: the results file being appended to.
      todo: input rows not yet answered.
      token_ids: their token ids.
      total: rows in the input file.
    """

    output_path: str
    todo: list[dict[str, Any]]
    token_ids: list[list[int]]
    total: int

    def workload(self, batch_size: int, max_new_tokens: int, spec: ModelSpec) -> Workload:
        """Largest shapes a batch of this job runs at (what a plan must fit)."""
        longest = max((len(t) for t in self.token_ids), default=1)
        return Workload.for_prompts(max(1, min(batch_size, len(self.todo))), longest,
                                    max_new_tokens, spec)

    def run(self, engine: Engine, sampling: SamplingParams, batch_size: int = 8,
            on_result: Callable[[dict[str, Any]], None] | None = None) -> BatchSummary:
        """Generate the remaining prompts, appending each batch's results as it ends.

        Prompts are sorted by length so each batch pads little, and one KV-cache length serves
        the whole run (decode compiles once).
        Raises:
          HxError: a batch size below 1, or a plan that does not fit the memory budget.
        """
        if batch_size < 1:
            raise HxError(f"batch size must be >= 1, got {batch_size}")
        summary = BatchSummary(self.total, self.total - len(self.todo), len(self.todo))
        if not self.todo:
            return summary
        ids = self.token_ids
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        slots = self.workload(batch_size, sampling.max_new_tokens, engine.model.spec).cache_slots
        with open(self.output_path, "a", encoding="utf-8") as out:
            for chunk in _chunks(order, batch_size):
                completions = engine.generate_ids([ids[i] for i in chunk], sampling, slots)
                for i, completion in zip(chunk, completions):
                    result = result_row(self.todo[i], completion)
                    out.write(json.dumps(result, ensure_ascii=False) + "\n")
                    if on_result:
                        on_result(result)
                out.flush()
                os.fsync(out.fileno())
        return summary


def prepare_batch(model: Model, prompts_path: str, output_path: str, chat: bool = False
                  ) -> BatchJob:
    """Read the prompts, drop those already answered in ``output_path``, tokenize and check
    the rest, so that a bad prompt fails before any work.

    Raises:
      HxError: bad input file, a prompt that is empty or longer than the context.
    """
    rows = read_prompts(prompts_path)
    done = completed_ids(output_path)
    todo = [r for r in rows if r["id"] not in done]
    ids = [encode_prompt(model.tokenizer, r["prompt"], chat) for r in todo]
    check_prompts([len(t) for t in ids], model.spec, [repr(r["id"]) for r in todo])
    return BatchJob(output_path, todo, ids, total=len(rows))


def run_batch(engine: Engine, prompts_path: str, output_path: str, sampling: SamplingParams,
              batch_size: int = 8, chat: bool = False,
              on_result: Callable[[dict[str, Any]], None] | None = None) -> BatchSummary:
    """Answer every prompt of ``prompts_path`` not yet in ``output_path`` (``prepare_batch``
    then ``BatchJob.run``)."""
    job = prepare_batch(engine.model, prompts_path, output_path, chat)
    return job.run(engine, sampling, batch_size, on_result)
