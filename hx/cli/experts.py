"""``hx expert-trace``: a Mixture of Experts' routing over a prompts file, written as the trace
``--expert-activity`` reads (``hx.measure.expert_trace``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import typer

from hx.batch import read_prompts
from hx.cli.common import DtypeOption, HostMatmulOption, ModelOption, WeightsOption, app, note
from hx.cli.console import out
from hx.generate import encode_prompt
from hx.measure.expert_trace import count_picks, write_trace
from hx.models.loader import load, resolve_dtype


@app.command("expert-trace")
def expert_trace_command(
    prompts: Path = typer.Option(..., "--prompts", help="JSONL file of {\"id\", \"prompt\"} "
                                                        "lines (hx generate's)."),
    output: Path = typer.Option(..., "--output", "-o", help="The trace file to write."),
    model: Optional[str] = ModelOption,
    dtype: str = DtypeOption,
    weights: str = WeightsOption,
    host_matmul: str = HostMatmulOption,
    chat: bool = typer.Option(False, "--chat", help="Wrap prompts in the model's chat template."),
) -> None:
    """Count, per MoE layer, the prompts' tokens routed to each expert (each prompt prefilled
    alone on the host) and write them as JSON ("layers": a list per layer of each expert's
    count): the file `hx plan` and `hx generate` take as --expert-activity."""
    loaded = load(model, resolve_dtype(dtype), weights, host_matmul=host_matmul)
    ids = [encode_prompt(loaded.tokenizer, row["prompt"], chat)
           for row in read_prompts(str(prompts))]
    counts = count_picks(loaded, ids)
    tokens = sum(map(len, ids))
    write_trace(str(output), counts, loaded.spec, tokens)
    share = counts / counts.sum(axis=1, keepdims=True)
    top = np.sort(share, axis=1)[:, ::-1]
    quarter = max(1, share.shape[1] // 4)
    out.print(f"{loaded.spec.name}: {tokens} tokens of {len(ids)} prompts routed; per layer "
              f"the busiest expert takes {top[:, 0].mean():.1%} of the picks on average, the "
              f"busiest quarter {top[:, :quarter].sum(axis=1).mean():.1%} (uniform: "
              f"{1 / share.shape[1]:.1%}, {quarter / share.shape[1]:.1%})", soft_wrap=True)
    note(f"trace written to {output}")
