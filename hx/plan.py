"""``ExecutionPlan``: where each op runs and where each layer's KV cache lives (DESIGN §4).

A plan is plain data: it prints, compares, round-trips through JSON and is checked against a
``ModelSpec`` without running anything. The executor interprets it.

JSON form (``layers`` may also be a single object applied to every layer)::

    {"name": "mixed",
     "prefill": {"EMBED": "accelerator", "HEAD": "accelerator",
                 "layers": [{"Q": "accelerator", "K": "accelerator", ..., "MLP2": "host"}, ...]},
     "decode": {...same shape...},
     "kv": ["host", "accelerator", ...]}          # one entry per layer (or one string)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from hx.devices import ACCELERATOR, DEVICE_NAMES, HOST
from hx.errors import HxError
from hx.models.spec import EMBED, HEAD, LAYER_OPS, ModelSpec

PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class PhasePlan:
    """Device of every op in one phase.

    Attributes:
      embed: device of EMBED.
      layers: per layer, the device of each op in ``LAYER_OPS`` order.
      head: device of HEAD.
    """

    embed: str
    layers: tuple[tuple[str, ...], ...]
    head: str

    def device(self, layer: int | None, op: str) -> str:
        """Device of ``op`` in ``layer`` (``layer`` is None for EMBED and HEAD)."""
        if op == EMBED:
            return self.embed
        if op == HEAD:
            return self.head
        return self.layers[layer][LAYER_OPS.index(op)]

    def sequence(self) -> Iterator[tuple[int | None, str, str]]:
        """(layer, op, device) in execution order: EMBED, each layer's seven ops, HEAD."""
        yield None, EMBED, self.embed
        for i, devices in enumerate(self.layers):
            for op, dev in zip(LAYER_OPS, devices):
                yield i, op, dev
        yield None, HEAD, self.head

    def to_json(self) -> dict[str, Any]:
        """``{"EMBED": device, "HEAD": device, "layers": [{op: device}, ...]}``."""
        return {EMBED: self.embed, HEAD: self.head,
                "layers": [dict(zip(LAYER_OPS, devs)) for devs in self.layers]}

    @classmethod
    def from_json(cls, data: dict[str, Any], n_layers: int) -> "PhasePlan":
        """Parse ``to_json``'s form; ``layers`` may be one object for all layers and missing
        ops default to the accelerator.

        Raises:
          HxError: unknown op or device, or a layer count other than ``n_layers``.
        """
        layers = data.get("layers", {})
        if isinstance(layers, dict):
            layers = [layers] * n_layers
        if len(layers) != n_layers:
            raise HxError(f"plan has {len(layers)} layers, the model has {n_layers}")
        rows = []
        for i, layer in enumerate(layers):
            unknown = set(layer) - set(LAYER_OPS)
            if unknown:
                raise HxError(f"plan layer {i}: unknown ops {sorted(unknown)}; ops are "
                              f"{', '.join(LAYER_OPS)}")
            rows.append(tuple(_device(layer.get(op, ACCELERATOR)) for op in LAYER_OPS))
        return cls(embed=_device(data.get(EMBED, ACCELERATOR)), layers=tuple(rows),
                   head=_device(data.get(HEAD, ACCELERATOR)))


def _device(name: Any) -> str:
    if name not in DEVICE_NAMES:
        raise HxError(f"plan names device {name!r}; devices are {', '.join(DEVICE_NAMES)}")
    return name


@dataclass(frozen=True)
class ExecutionPlan:
    """Op placement per phase and KV-cache home per layer.

    Attributes:
      prefill / decode: ``PhasePlan`` of each phase.
      kv: per layer, the device holding its KV cache.
      name: label for reports.
    """

    prefill: PhasePlan
    decode: PhasePlan
    kv: tuple[str, ...]
    name: str = "custom"

    @property
    def n_layers(self) -> int:
        """Number of decoder layers the plan covers."""
        return len(self.kv)

    def phase(self, phase: str) -> PhasePlan:
        """The ``PhasePlan`` of ``"prefill"`` or ``"decode"``."""
        if phase not in PHASES:
            raise KeyError(f"unknown phase {phase!r}; phases are {PHASES}")
        return self.prefill if phase == "prefill" else self.decode

    @classmethod
    def uniform(cls, n_layers: int, host_ops: Iterable[str] = (), name: str | None = None
                ) -> "ExecutionPlan":
        """Every layer alike in both phases: ``host_ops`` on the host, the rest on the
        accelerator; KV cache on the device of SCORE.

        ``host_ops`` may include ``EMBED`` and ``HEAD``.
        Raises:
          HxError: an unknown op name.
        """
        host_ops = tuple(host_ops)
        unknown = set(host_ops) - set(LAYER_OPS) - {EMBED, HEAD}
        if unknown:
            raise HxError(f"unknown ops {sorted(unknown)}; ops are "
                          f"{', '.join((EMBED,) + LAYER_OPS + (HEAD,))}")

        def dev(op: str) -> str:
            return HOST if op in host_ops else ACCELERATOR

        layer = tuple(dev(op) for op in LAYER_OPS)
        phase = PhasePlan(embed=dev(EMBED), layers=(layer,) * n_layers, head=dev(HEAD))
        label = name or ("all-accelerator" if not host_ops else "host:" + ",".join(host_ops))
        return cls(prefill=phase, decode=phase, kv=(dev("SCORE"),) * n_layers, name=label)

    @classmethod
    def all_accelerator(cls, n_layers: int) -> "ExecutionPlan":
        """Everything on the accelerator."""
        return cls.uniform(n_layers, name="all-accelerator")

    @classmethod
    def all_host(cls, n_layers: int) -> "ExecutionPlan":
        """Everything on the host CPU."""
        return cls.uniform(n_layers, (EMBED, *LAYER_OPS, HEAD), name="all-host")

    def validate(self, spec: ModelSpec) -> None:
        """Check the plan fits the model's structure.

        Raises:
          HxError: a layer count that differs from the model's.
        """
        for phase in PHASES:
            if len(self.phase(phase).layers) != spec.n_layers:
                raise HxError(f"plan {self.name!r} has {len(self.phase(phase).layers)} "
                              f"{phase} layers; the model has {spec.n_layers}")
        if len(self.kv) != spec.n_layers:
            raise HxError(f"plan {self.name!r} gives {len(self.kv)} KV homes; the model has "
                          f"{spec.n_layers} layers")

    def to_json(self) -> dict[str, Any]:
        """The JSON form shown in the module docstring."""
        return {"name": self.name, "prefill": self.prefill.to_json(),
                "decode": self.decode.to_json(), "kv": list(self.kv)}

    @classmethod
    def from_json(cls, data: dict[str, Any], n_layers: int) -> "ExecutionPlan":
        """Parse the JSON form; ``decode`` defaults to ``prefill`` and vice versa.

        Raises:
          HxError: malformed plan (unknown op or device, wrong layer count).
        """
        if not isinstance(data, dict) or not ({"prefill", "decode"} & set(data)):
            raise HxError("a plan is a JSON object with 'prefill' and/or 'decode' entries")
        prefill = PhasePlan.from_json(data.get("prefill", data.get("decode")), n_layers)
        decode = PhasePlan.from_json(data.get("decode", data.get("prefill")), n_layers)
        kv = data.get("kv")
        if kv is None:
            kv = [decode.device(i, "SCORE") for i in range(n_layers)]
        elif isinstance(kv, str):
            kv = [kv] * n_layers
        if len(kv) != n_layers:
            raise HxError(f"plan gives {len(kv)} KV homes; the model has {n_layers} layers")
        return cls(prefill=prefill, decode=decode, kv=tuple(_device(d) for d in kv),
                   name=str(data.get("name", "custom")))

    def save(self, path: str) -> None:
        """Write ``to_json`` to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path: str, n_layers: int) -> "ExecutionPlan":
        """Read a plan JSON file.

        Raises:
          HxError: missing file, invalid JSON or malformed plan.
        """
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise HxError(f"plan file not found: {path}") from None
        except json.JSONDecodeError as e:
            raise HxError(f"plan file {path} is not valid JSON: {e}") from None
        return cls.from_json(data, n_layers)
