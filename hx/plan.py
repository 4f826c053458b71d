"""``ExecutionPlan``: where each op runs, where its weights live, where each KV cache lives.

A plan is plain data (docs/architecture.md, "Plans"): it prints, compares, round-trips through JSON
and is checked
against a ``ModelSpec`` without running anything; the executor interprets it. Its tables:

* placement per phase (``prefill``, ``decode``): the device of EMBED, of each layer's seven ops,
  of HEAD -- ``"accelerator"`` or ``"host"``;
* weight homes (one for both phases), per op that owns weights:
  ``"resident"`` -- kept in accelerator memory;
  ``"streamed"`` -- kept in host memory (the accelerator's ``pinned_host`` memory kind) and copied
  into accelerator memory ahead of the segment that uses it, then freed;
  ``"host"`` -- kept on the host CPU device, float32, for host-placed ops (an accelerator op
  whose weights live here has them copied in like streamed ones);
  ``"disk"`` -- kept on the disk tier (NVMe), read into host memory every step and, for an
  accelerator op, copied on like a streamed one (FlexGen's weights on disk; ``hx.disk``);
* KV-cache home per layer: ``"accelerator"``, ``"host"``, ``"disk"`` (read into host memory
  every step and attended there: FlexGen's KV on disk; planned and simulated only, the
  executor refuses it), or ``"streamed"`` (kept in host memory and attended on the
  accelerator: each step copies the layer's cache in, H2D, and the new positions' K, V back,
  D2H -- FlexGen's and KVPR's setting; ``hx.streamed_kv``).
  SCORE runs on the host for a ``host`` or ``disk`` cache, on the accelerator for an
  ``accelerator`` or ``streamed`` one, in both phases (``score_device``);
* KV recompute per layer (``kv_recompute``, KVPR: Jiang et al. 2024, "KVPR: Efficient LLM
  Inference with I/O-Aware KV Cache Partial Recomputation"): for a ``streamed`` cache, the
  first r positions cross the link as the layer's input activations ``h`` (d_model values a
  position instead of 2 x n_kv_heads x head_dim) and their K, V are recomputed on the
  accelerator while the K, V of positions [r, S) cross; 0: the whole cache crosses. Only a
  layer whose K and V ops run on the accelerator in both phases recomputes;
* for a Mixture of Experts, expert homes per layer (``experts``: ``ExpertHomes``): none (the
  layer's routed experts are MLP2's), or each routed expert ``resident``, ``streamed`` or
  ``host``, computed where it lives by one op per home (``models.ops.EXPERT_OPS``).

JSON form (``layers`` may be a single object meaning every layer; a missing entry defaults)::

    {"name": "mixed",
     "prefill": {"EMBED": "host", "HEAD": "accelerator", "layers": [{"Q": "accelerator", ...}]},
     "decode":  {...same shape...},
     "weights": {"EMBED": "host", "HEAD": "streamed", "layers": [{"Q": "resident", ...}]},
     "kv": ["host", "accelerator", ...], "prefill_chunk": 256,
     "kv_recompute": [0, 512, ...],
     "experts": [{"resident": [0, 1], "host": [2, 3]}, null, ...]}

``kv_recompute`` is written only when some layer recomputes (files without it load as 0),
``experts`` only when some layer's experts have homes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Iterator, Sequence

from hx.devices import ACCELERATOR, DEVICE_NAMES, HOST
from hx.errors import HxError
from hx.models.ops import EXPERTS_HOST, EXPERTS_RESIDENT, EXPERTS_STREAMED
from hx.models.spec import EMBED, EXPERT_OPS, HEAD, LAYER_OPS, SCORE, ModelSpec

PHASES = ("prefill", "decode")
RESIDENT, STREAMED, DISK = "resident", "streamed", "disk"
KV_HOMES = (*DEVICE_NAMES, DISK, STREAMED)
WEIGHT_HOMES = (RESIDENT, STREAMED, HOST, DISK)
WEIGHTED_OPS = tuple(op for op in LAYER_OPS if op != SCORE)  # SCORE owns no weights


def weight_owners(spec: ModelSpec) -> list[tuple[int | None, str]]:
    """Every (layer, op) that owns weights: EMBED and HEAD (layer None), then each layer's
    weighted ops in order."""
    return [(None, EMBED), (None, HEAD)] + [(i, op) for i in range(spec.n_layers)
                                             for op in WEIGHTED_OPS]


def home_device(home: str) -> str:
    """The device that computes with weights homed at ``home``: the host for ``host``, the
    accelerator for the others (``streamed`` and ``disk`` weights are copied to it)."""
    return HOST if home == HOST else ACCELERATOR


def score_device(kv_home: str) -> str:
    """The device SCORE runs on for a layer whose KV cache lives at ``kv_home``: the host for
    a ``disk`` cache (read into host memory), the accelerator for a ``streamed`` one (copied
    in each step)."""
    return {DISK: HOST, STREAMED: ACCELERATOR}.get(kv_home, kv_home)


def _recompute(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise HxError(f"plan's kv_recompute entries are token counts >= 0, got {value!r}")
    return value


def _kv_home(value: Any) -> str:
    if value not in KV_HOMES:
        raise HxError(f"plan names KV home {value!r}; expected one of {', '.join(KV_HOMES)}")
    return value


@dataclass(frozen=True)
class OpTable:
    """A value for EMBED, for each listed op of every layer, and for HEAD.

    Attributes:
      embed: value of EMBED.
      layers: per layer, one value per op of ``OPS`` (in that order).
      head: value of HEAD.
    """

    OPS: ClassVar[tuple[str, ...]] = LAYER_OPS
    VALUES: ClassVar[tuple[str, ...]] = DEVICE_NAMES
    KIND: ClassVar[str] = "device"

    embed: str
    layers: tuple[tuple[str, ...], ...]
    head: str

    def get(self, layer: int | None, op: str) -> str:
        """Value of ``op`` in ``layer`` (``layer`` is None for EMBED and HEAD)."""
        if op == EMBED:
            return self.embed
        if op == HEAD:
            return self.head
        return self.layers[layer][self.OPS.index(op)]

    def sequence(self) -> Iterator[tuple[int | None, str, str]]:
        """(layer, op, value) in execution order: EMBED, each layer's ops, HEAD."""
        yield None, EMBED, self.embed
        for i, values in enumerate(self.layers):
            for op, value in zip(self.OPS, values):
                yield i, op, value
        yield None, HEAD, self.head

    @classmethod
    def uniform(cls, n_layers: int, value_of) -> "OpTable":
        """Every layer alike: ``value_of(op)`` for each op, EMBED and HEAD."""
        row = tuple(value_of(op) for op in cls.OPS)
        return cls(value_of(EMBED), (row,) * n_layers, value_of(HEAD))

    def stage(self, layers: range, embed: str, head: str) -> "OpTable":
        """The table of a pipeline stage: ``layers``' rows, and ``embed`` and ``head`` for its
        ends."""
        return dataclasses.replace(self, embed=embed, layers=self.layers[layers.start:layers.stop],
                                   head=head)

    def to_json(self) -> dict[str, Any]:
        """``{"EMBED": value, "HEAD": value, "layers": [{op: value}, ...]}``."""
        return {EMBED: self.embed, HEAD: self.head,
                "layers": [dict(zip(self.OPS, row)) for row in self.layers]}

    @classmethod
    def from_json(cls, data: dict[str, Any], n_layers: int, default: str) -> "OpTable":
        """Parse ``to_json``'s form; ``layers`` may be one object for all layers; missing
        entries take ``default``.

        Raises:
          HxError: unknown op or value, or a layer count other than ``n_layers``.
        """
        if not isinstance(data, dict):
            raise HxError(f"a plan's {cls.KIND} table must be a JSON object")
        layers = data.get("layers", {})
        if isinstance(layers, dict):
            layers = [layers] * n_layers
        if len(layers) != n_layers:
            raise HxError(f"plan has {len(layers)} layers, the model has {n_layers}")
        rows = []
        for i, layer in enumerate(layers):
            unknown = set(layer) - set(cls.OPS)
            if unknown:
                raise HxError(f"plan layer {i}: unknown ops {sorted(unknown)} in the {cls.KIND} "
                              f"table; ops are {', '.join(cls.OPS)}")
            rows.append(tuple(cls._value(layer.get(op, default)) for op in cls.OPS))
        return cls(cls._value(data.get(EMBED, default)), tuple(rows),
                   cls._value(data.get(HEAD, default)))

    @classmethod
    def _value(cls, v: Any) -> str:
        if v not in cls.VALUES:
            raise HxError(f"plan names {cls.KIND} {v!r}; expected one of {', '.join(cls.VALUES)}")
        return v


class Placement(OpTable):
    """Device (``accelerator``/``host``) of every op in one phase."""


class WeightHomes(OpTable):
    """Home (``resident``/``streamed``/``host``/``disk``) of the weights of every op that owns
    some."""

    OPS = WEIGHTED_OPS
    VALUES = WEIGHT_HOMES
    KIND = "weight home"

    def get(self, layer: int | None, op: str) -> str | None:
        """Home of ``op``'s weights, or None for SCORE (it owns none)."""
        return None if op == SCORE else super().get(layer, op)


# the op that computes an MoE layer's routed experts of each home (``models.ops.EXPERT_OPS``),
# in the order a layer runs them: the host's before MLP2, the accelerator's after it. A
# disk-homed expert is a streamed one read from a mapped file instead of host memory: the
# streamed op copies both kinds as routed.
EXPERT_OP_OF = {HOST: EXPERTS_HOST, RESIDENT: EXPERTS_RESIDENT, STREAMED: EXPERTS_STREAMED,
                DISK: EXPERTS_STREAMED}
EXPERT_HOMES = tuple(EXPERT_OP_OF)
EXPERT_HOME_OF = {EXPERTS_HOST: HOST, EXPERTS_RESIDENT: RESIDENT,
                  EXPERTS_STREAMED: STREAMED}  # an expert op's home (its weights' buffers)


@dataclass(frozen=True)
class ExpertHomes:
    """Where each routed expert of an MoE layer lives (docs/architecture.md, "Plans"): the
    unit of placement of a layer's experts is one expert.

    A layer with homes runs its experts as one op of ``EXPERT_OPS`` per device side
    (``EXPERT_OP_OF``; ``host``: computed on the host on the rows routed to them;
    ``resident``: on the accelerator; ``streamed``: held in host memory and copied to the
    accelerator once the layer's routing is known, only the experts some row routes to, and
    computed there; ``disk``: the same copy read from a mapped file, so that between steps
    the expert costs no memory at all -- MoE-Infinity's and HOBBIT's SSD tier); MLP2 keeps the
    shared expert and the residual add (``ModelSpec.expert_part``). A layer without homes
    runs its experts inside MLP2, placed as MLP2's weights are (``WeightHomes``).

    Attributes:
      layers: per decoder layer, () or one home per routed expert (``EXPERT_HOMES``); ()
        altogether: no layer has homes.

    JSON form: per layer null or ``{"resident": [ids], "streamed": [ids], "host": [ids],
    "disk": [ids]}``.
    """

    layers: tuple[tuple[str, ...], ...] = ()

    def of(self, layer: int) -> tuple[str, ...]:
        """The homes of ``layer``'s experts; () where it has none."""
        return self.layers[layer] if self.layers else ()

    def groups(self, layer: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """((op, expert ids), ...) of ``layer``'s expert ops that run some experts, in
        ``EXPERT_OPS`` order (the streamed op's ids: its streamed and disk-homed experts)."""
        homes = self.of(layer)
        return tuple((op, ids) for op in EXPERT_OPS
                     if (ids := tuple(e for e, h in enumerate(homes) if EXPERT_OP_OF[h] == op)))

    def homes(self, layer: int) -> tuple[tuple[str, str], ...]:
        """((op, home), ...): the homes of ``layer``'s experts and the op that runs each
        (``EXPERT_HOMES`` order)."""
        homes = self.of(layer)
        return tuple((EXPERT_OP_OF[h], h) for h in EXPERT_HOMES if h in homes)

    def on_disk(self, layer: int) -> tuple[bool, ...]:
        """Per expert of ``layer``'s streamed op (``groups`` order), whether it is read from
        disk."""
        homes = self.of(layer)
        return tuple(homes[e] == DISK for e in dict(self.groups(layer)).get(EXPERTS_STREAMED, ()))

    def part(self, layer: int | None, op: str) -> int:
        """How many routed experts ``op`` of ``layer`` holds where the layer's experts have
        homes (MLP2: 0; an expert op: its home's), else -1 (``ModelSpec.expert_part``)."""
        if layer is None or op not in ("MLP2", *EXPERT_OPS) or not self.of(layer):
            return -1
        return len(dict(self.groups(layer)).get(op, ()))

    def woven(self, sequence: Iterable[tuple[int | None, str, str]]
              ) -> Iterator[tuple[int | None, str, str]]:
        """``sequence`` (a phase's (layer, op, device)) with each layer's expert ops around
        its MLP2: its host experts before, its accelerator experts after."""
        for layer, op, device in sequence:
            groups = self.groups(layer) if op == "MLP2" and self.layers else ()
            for g, _ in groups:
                if g == EXPERTS_HOST:
                    yield layer, g, HOST
            yield layer, op, device
            for g, _ in groups:
                if g != EXPERTS_HOST:
                    yield layer, g, ACCELERATOR

    def stage(self, layers: range) -> "ExpertHomes":
        """The homes of a pipeline stage's ``layers``."""
        return ExpertHomes(self.layers[layers.start:layers.stop] if self.layers else ())

    def to_json(self) -> list[dict[str, list[int]] | None]:
        """The JSON form (class docstring)."""
        return [{home: [e for e, h in enumerate(homes) if h == home] for home in EXPERT_HOMES
                 if home in homes} or None for homes in self.layers]

    @classmethod
    def from_json(cls, data: Any, n_layers: int) -> "ExpertHomes":
        """Parse ``to_json``'s form (a single object: every layer alike).

        Raises:
          HxError: not that form; an unknown home; an expert named twice or in no home.
        """
        rows = [data] * n_layers if isinstance(data, dict) else data
        if not isinstance(rows, list) or len(rows) != n_layers:
            raise HxError(f"a plan's experts table is a list of {n_layers} entries (null or "
                          "{home: [expert ids]}), or one object for every layer")
        layers = []
        for i, row in enumerate(rows):
            if row is None:
                layers.append(())
                continue
            if not isinstance(row, dict) or set(row) - set(EXPERT_HOMES):
                raise HxError(f"plan's experts of layer {i}: homes are "
                              f"{', '.join(EXPERT_HOMES)}, got {row!r}")
            ids = sorted(e for home in row.values() for e in home)
            if not all(isinstance(e, int) for e in ids) or ids != list(range(len(ids))):
                raise HxError(f"plan's experts of layer {i} must name each expert 0..X-1 "
                              "once")
            homes = {e: home for home, given in row.items() for e in given}
            layers.append(tuple(homes[e] for e in range(len(ids))))
        return cls(tuple(layers) if any(layers) else ())


@dataclass(frozen=True)
class ExecutionPlan:
    """Op placement per phase, weight homes, and KV-cache home per layer.

    Attributes:
      prefill / decode: ``Placement`` of each phase.
      weights: ``WeightHomes`` (shared by both phases).
      kv: per layer, where its KV cache lives: a device, ``disk`` (SCORE on the host) or
        ``streamed`` (host memory, SCORE on the accelerator).
      name: label for reports.
      prefill_chunk: prefill runs the prompt in steps of at most this many tokens, which
        bounds its activations and XLA temporaries (None: the whole prompt in one step).
      kv_recompute: per layer, r: the cache positions [0, r) whose K, V a ``streamed`` layer
        recomputes on the accelerator from their activations ``h`` (tokens; KVPR) instead
        of copying them; () means 0 for every layer.
      experts: an MoE model's routed experts placed one by one (``ExpertHomes``; empty:
        each layer's experts are MLP2's).
    """

    prefill: Placement
    decode: Placement
    weights: WeightHomes
    kv: tuple[str, ...]
    name: str = "custom"
    prefill_chunk: int | None = None
    kv_recompute: tuple[int, ...] = ()
    experts: ExpertHomes = ExpertHomes()

    def sequence(self, phase: str) -> Iterator[tuple[int | None, str, str]]:
        """(layer, op, device) of ``phase`` in execution order: the placement's, with the
        expert ops of layers whose experts have homes (``ExpertHomes.woven``)."""
        return self.experts.woven(self.phase(phase).sequence())

    def weight_home(self, layer: int | None, op: str) -> str | None:
        """Home of the weights of ``op`` of ``layer``: an expert op's home, else
        ``WeightHomes.get``."""
        if op in EXPERT_OPS:
            return EXPERT_HOME_OF[op]
        return self.weights.get(layer, op)

    def op_spec(self, spec: ModelSpec, layer: int | None, op: str) -> ModelSpec:
        """The spec ``op`` of ``layer`` is held and computed with: the layer's
        (``ModelSpec.layer_spec``; ``spec`` for EMBED and HEAD), or where the layer's experts
        have homes, MLP2's and the expert ops' parts of it (``ModelSpec.expert_part``)."""
        held = spec if layer is None else spec.layer_spec(layer)
        n = self.experts.part(layer, op)
        return held if n < 0 else held.expert_part(op, n)

    def held_ops(self) -> Iterator[tuple[int | None, str, str]]:
        """(layer, op, home) of every op that holds weights (``weight_owners`` order, each
        layer's expert ops after its MLP2), an expert op once for each home of its experts
        (``ExpertHomes.homes``: the streamed op's in host memory and on disk)."""
        for layer, op, home in self.weights.sequence():
            yield layer, op, home
            if op == "MLP2" and layer is not None:
                for g, h in self.experts.homes(layer):
                    yield layer, g, h

    def held_spec(self, spec: ModelSpec, layer: int | None, op: str, home: str) -> ModelSpec:
        """The spec of what ``op`` of ``layer`` holds at ``home`` (``held_ops``): ``op_spec``,
        but an expert op's experts at that home alone."""
        if op not in EXPERT_OPS:
            return self.op_spec(spec, layer, op)
        return spec.layer_spec(layer).expert_part(op, self.experts.of(layer).count(home))

    @property
    def n_layers(self) -> int:
        """Number of decoder layers the plan covers."""
        return len(self.kv)

    def recompute(self, layer: int) -> int:
        """r of ``layer``: cache positions whose K, V it recomputes (0 without recompute)."""
        return self.kv_recompute[layer] if self.kv_recompute else 0

    def can_recompute(self, layer: int) -> bool:
        """Whether ``layer`` may recompute K, V (r > 0): its cache is ``streamed`` and its K
        and V ops run on the accelerator in both phases, beside its SCORE."""
        return self.kv[layer] == STREAMED and all(
            self.phase(phase).get(layer, op) == ACCELERATOR for phase in PHASES
            for op in ("K", "V"))

    def with_recompute(self, r: int | Iterable[int]) -> "ExecutionPlan":
        """The same plan with r (one count for every ``streamed`` layer, or one per layer;
        layers that cannot recompute, ``can_recompute``, keep 0)."""
        rs = [r] * self.n_layers if isinstance(r, int) else list(r)
        rs = tuple(x if self.can_recompute(layer) else 0 for layer, x in enumerate(rs))
        return dataclasses.replace(self, kv_recompute=rs if any(rs) else ())

    @property
    def refusal(self) -> str | None:
        """Why the executor cannot run this plan yet (None: it can): KV caches on disk
        (planned and simulated only)."""
        if DISK in self.kv:
            return (f"plan {self.name!r} keeps KV caches on disk: hx plans and simulates them "
                    "there (hx simulate, hx ablate --hardware) but does not run it yet; keep "
                    "them in host memory to run it")
        return None

    def stage(self, layers: range, first: bool, last: bool) -> "ExecutionPlan":
        """The plan of one pipeline stage (``ModelSpec.pipeline_stage``): ``layers``' rows, KV
        homes and recompute counts; EMBED and HEAD as planned at the model's ends, and
        elsewhere the pass-through where its neighbour runs (EMBED on the device of the
        stage's first op, HEAD on that of its last), so the residual stream crosses between
        stages straight from device to device."""
        placements = []
        for placement in (self.prefill, self.decode):
            embed = placement.embed if first else placement.layers[layers.start][0]
            head = placement.head if last else placement.layers[layers.stop - 1][-1]
            placements.append(placement.stage(layers, embed, head))
        prefill, decode = placements

        def home(device: str) -> str:
            return RESIDENT if device == ACCELERATOR else HOST

        weights = self.weights.stage(layers, self.weights.embed if first else home(decode.embed),
                                     self.weights.head if last else home(decode.head))
        return dataclasses.replace(
            self, prefill=prefill, decode=decode, weights=weights,
            kv=self.kv[layers.start:layers.stop],
            kv_recompute=self.kv_recompute[layers.start:layers.stop],
            experts=self.experts.stage(layers),
            name=f"{self.name} [layers {layers.start}-{layers.stop - 1}]")

    @classmethod
    def joined(cls, parts: Sequence["ExecutionPlan"], name: str) -> "ExecutionPlan":
        """One plan of the model from its pipeline stages' plans, in order (what ``stage``
        cuts): EMBED as the first stage places it, HEAD as the last, every stage's layers, KV
        homes and recompute counts, and the smallest prefill chunk any stage needs (None
        where none needs one)."""
        first, last = parts[0], parts[-1]

        def table(of):
            return dataclasses.replace(of(first), layers=tuple(
                row for p in parts for row in of(p).layers), head=of(last).head)

        recompute = tuple(p.recompute(i) for p in parts for i in range(p.n_layers))
        chunks = [p.prefill_chunk for p in parts if p.prefill_chunk is not None]
        experts = tuple(p.experts.of(i) for p in parts for i in range(p.n_layers))
        return cls(table(lambda p: p.prefill), table(lambda p: p.decode),
                   table(lambda p: p.weights), tuple(k for p in parts for k in p.kv), name,
                   min(chunks) if chunks else None, recompute if any(recompute) else (),
                   ExpertHomes(experts if any(experts) else ()))

    def phase(self, phase: str) -> Placement:
        """The ``Placement`` of ``"prefill"`` or ``"decode"``."""
        if phase not in PHASES:
            raise KeyError(f"unknown phase {phase!r}; phases are {PHASES}")
        return self.prefill if phase == "prefill" else self.decode

    @classmethod
    def from_placement(cls, prefill: Placement, decode: Placement | None = None,
                       name: str = "custom", streamed: bool = False) -> "ExecutionPlan":
        """A plan whose weight homes follow the decode placement (accelerator ops' weights
        ``resident``, or ``streamed`` when ``streamed``; host ops' weights ``host``) and whose
        KV caches live where SCORE runs in decode."""
        decode = decode or prefill
        acc_home = STREAMED if streamed else RESIDENT
        layers = tuple(tuple(acc_home if decode.get(i, op) == ACCELERATOR else HOST
                             for op in WEIGHTED_OPS) for i in range(len(decode.layers)))
        weights = WeightHomes(acc_home if decode.embed == ACCELERATOR else HOST, layers,
                              acc_home if decode.head == ACCELERATOR else HOST)
        kv = tuple(decode.get(i, SCORE) for i in range(len(decode.layers)))
        return cls(prefill, decode, weights, kv, name)

    @classmethod
    def uniform(cls, n_layers: int, host_ops: Iterable[str] = (), name: str | None = None
                ) -> "ExecutionPlan":
        """Every layer alike in both phases: ``host_ops`` on the host (may include EMBED and
        HEAD), the rest on the accelerator with resident weights; KV where SCORE runs.

        Raises:
          HxError: an unknown op name.
        """
        host_ops = tuple(host_ops)
        unknown = set(host_ops) - set(LAYER_OPS) - {EMBED, HEAD}
        if unknown:
            raise HxError(f"unknown ops {sorted(unknown)}; ops are "
                          f"{', '.join((EMBED,) + LAYER_OPS + (HEAD,))}")
        placement = Placement.uniform(n_layers,
                                      lambda op: HOST if op in host_ops else ACCELERATOR)
        label = name or ("all-accelerator" if not host_ops else "host:" + ",".join(host_ops))
        return cls.from_placement(placement, name=label)

    @classmethod
    def all_accelerator(cls, n_layers: int) -> "ExecutionPlan":
        """Everything on the accelerator, every weight resident."""
        return cls.uniform(n_layers, name="all-accelerator")

    @classmethod
    def all_host(cls, n_layers: int) -> "ExecutionPlan":
        """Everything on the host CPU."""
        return cls.uniform(n_layers, (EMBED, *LAYER_OPS, HEAD), name="all-host")

    def validate(self, spec: ModelSpec, to_run: bool = True) -> None:
        """Check the plan's structure against the model (memory is checked by
        ``hx.memory.check_fits``).

        Args:
          to_run: also refuse what the executor does not run yet (``refusal``: KV caches on
            disk; the executor calls this with the default). False checks a plan to
            simulate.

        Raises:
          HxError: a layer count that differs from the model's; SCORE not where its layer's
            KV cache lives; a host op whose weights are not at home on the host; a recompute
            count on a layer that cannot recompute (``can_recompute``), or not one per
            layer; with ``to_run``, a KV cache on disk.
        """
        for phase in PHASES:
            n = len(self.phase(phase).layers)
            if n != spec.n_layers:
                raise HxError(f"plan {self.name!r} has {n} {phase} layers; the model has "
                              f"{spec.n_layers}")
        if len(self.kv) != spec.n_layers or len(self.weights.layers) != spec.n_layers:
            raise HxError(f"plan {self.name!r} gives {len(self.kv)} KV homes and "
                          f"{len(self.weights.layers)} weight rows; the model has "
                          f"{spec.n_layers} layers")
        for phase in PHASES:
            for layer, op, device in self.phase(phase).sequence():
                if op == SCORE and device != score_device(self.kv[layer]):
                    raise HxError(f"plan {self.name!r}: {phase} SCORE of layer {layer} runs on "
                                  f"the {device} but its KV cache lives on the "
                                  f"{self.kv[layer]}; SCORE must run where its KV cache is")
                home = self.weights.get(layer, op)
                if device == HOST and home not in (None, HOST):
                    where = f"layer {layer} {op}" if layer is not None else op
                    raise HxError(f"plan {self.name!r}: {phase} {where} runs on the host but "
                                  f"its weights are {home}; host ops need weights at home "
                                  "on the host")
        self._validate_recompute()
        self._validate_experts(spec)
        if to_run and self.refusal:
            raise HxError(self.refusal)

    def _validate_experts(self, spec: ModelSpec) -> None:
        if not self.experts.layers:
            return
        if spec.moe is None:
            raise HxError(f"plan {self.name!r} places routed experts, but {spec.name} is not a "
                          "Mixture of Experts")
        if len(self.experts.layers) != spec.n_layers:
            raise HxError(f"plan {self.name!r} gives expert homes for "
                          f"{len(self.experts.layers)} layers; the model has {spec.n_layers}")
        for layer, homes in enumerate(self.experts.layers):
            moe = spec.layer_spec(layer).moe
            if homes and moe is None:
                raise HxError(f"plan {self.name!r}: layer {layer} gives homes to routed "
                              f"experts; that layer of {spec.name} is dense")
            if homes and len(homes) != moe.routed:
                raise HxError(f"plan {self.name!r}: layer {layer} gives homes to {len(homes)} "
                              f"routed experts; {spec.name} has {moe.routed} a layer")

    def _validate_recompute(self) -> None:
        if self.kv_recompute and len(self.kv_recompute) != len(self.kv):
            raise HxError(f"plan {self.name!r} gives {len(self.kv_recompute)} kv_recompute "
                          f"entries for {len(self.kv)} layers")
        for layer, r in enumerate(self.kv_recompute):
            if r and self.kv[layer] != STREAMED:
                raise HxError(f"plan {self.name!r}: layer {layer} recomputes {r} positions' "
                              f"K, V but its cache is {self.kv[layer]}; recompute needs a "
                              "streamed cache")
            if r and not self.can_recompute(layer):
                raise HxError(f"plan {self.name!r}: layer {layer} recomputes {r} positions' "
                              "K, V but its K or V op runs on the host; recompute runs them "
                              "on the accelerator: place K and V there or set its r to 0")

    def to_json(self) -> dict[str, Any]:
        """The JSON form shown in the module docstring."""
        data = {"name": self.name, "prefill": self.prefill.to_json(),
                "decode": self.decode.to_json(), "weights": self.weights.to_json(),
                "kv": list(self.kv), "prefill_chunk": self.prefill_chunk}
        if any(self.kv_recompute):
            data["kv_recompute"] = list(self.kv_recompute)
        if self.experts.layers:
            data["experts"] = self.experts.to_json()
        return data

    def with_prefill_chunk(self, chunk: int | None) -> "ExecutionPlan":
        """The same plan with prefill in chunks of at most ``chunk`` tokens."""
        return dataclasses.replace(self, prefill_chunk=chunk)

    @classmethod
    def from_json(cls, data: dict[str, Any], n_layers: int) -> "ExecutionPlan":
        """Parse the JSON form. ``decode`` defaults to ``prefill`` and vice versa; missing
        placements default to the accelerator; weight homes and KV homes not given follow
        the decode placement (``from_placement``).

        Raises:
          HxError: malformed plan (unknown op, device or home; wrong layer count).
        """
        if not isinstance(data, dict) or not ({"prefill", "decode"} & set(data)):
            raise HxError("a plan is a JSON object with 'prefill' and/or 'decode' entries")
        prefill = Placement.from_json(data.get("prefill", data.get("decode")), n_layers,
                                      ACCELERATOR)
        decode = Placement.from_json(data.get("decode", data.get("prefill")), n_layers,
                                     ACCELERATOR)
        plan = cls.from_placement(prefill, decode, name=str(data.get("name", "custom")))
        weights = plan.weights
        if "weights" in data:  # given entries override the homes derived from placement
            given, derived = data["weights"], plan.weights.to_json()
            if not isinstance(given, dict):
                raise HxError("a plan's weight home table must be a JSON object")
            rows = given.get("layers", {})
            rows = [rows] * n_layers if isinstance(rows, dict) else rows
            if len(rows) != n_layers:
                raise HxError(f"plan has {len(rows)} weight rows, the model has {n_layers}")
            merged = {EMBED: given.get(EMBED, derived[EMBED]),
                      HEAD: given.get(HEAD, derived[HEAD]),
                      "layers": [{**d, **g} for d, g in zip(derived["layers"], rows)]}
            weights = WeightHomes.from_json(merged, n_layers, RESIDENT)
        kv = data.get("kv", list(plan.kv))
        if isinstance(kv, str):
            kv = [kv] * n_layers
        if len(kv) != n_layers:
            raise HxError(f"plan gives {len(kv)} KV homes; the model has {n_layers} layers")
        chunk = data.get("prefill_chunk")
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise HxError(f"plan's prefill_chunk must be a positive integer or null, got "
                          f"{chunk!r}")
        recompute = data.get("kv_recompute") or ()
        if isinstance(recompute, int):
            recompute = [recompute] * n_layers
        if recompute and len(recompute) != n_layers:
            raise HxError(f"plan gives {len(recompute)} kv_recompute entries; the model has "
                          f"{n_layers} layers")
        recompute = tuple(_recompute(r) for r in recompute)
        experts = ExpertHomes.from_json(data["experts"], n_layers) if data.get(
            "experts") else ExpertHomes()
        return cls(prefill, decode, weights, tuple(_kv_home(d) for d in kv), plan.name,
                   chunk, recompute if any(recompute) else (), experts)

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


def stage_layers(n_layers: int, pp: int) -> list[range]:
    """``n_layers`` cut into ``pp`` contiguous ranges, the pipeline stages' layers
    (``ExecutionPlan.stage``, ``hx.pipeline``), the first ones a layer longer where ``pp`` does
    not divide it.

    Raises:
      HxError: more stages than layers.
    """
    if not 1 <= pp <= n_layers:
        raise HxError(f"{pp} pipeline stages of {n_layers} layers: 1 to {n_layers} stages")
    size, extra = divmod(n_layers, pp)
    bounds = [0]
    for s in range(pp):
        bounds.append(bounds[-1] + size + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def stage_cuts(n_layers: int, pp: int) -> list[tuple[range, bool, bool]]:
    """(layers, first, last) of each of ``pp`` stages (``stage_layers``): what
    ``ModelSpec.pipeline_stage`` and ``ExecutionPlan.stage`` take.

    Raises:
      HxError: more stages than layers.
    """
    cuts = stage_layers(n_layers, pp)
    return [(layers, s == 0, s == pp - 1) for s, layers in enumerate(cuts)]


@dataclass(frozen=True)
class Stint:
    """``plan`` runs from decode step ``start`` (0: the first decode step; prefill runs under
    the first stint's plan) until the next stint's start: a schedule of plans that follows
    the context as it grows (``hx.planner.replan``)."""

    start: int
    plan: ExecutionPlan


def plan_at(stints: Sequence[Stint], step: int) -> ExecutionPlan:
    """The plan of decode step ``step`` under ``stints`` (in order, the first at 0)."""
    return next(s.plan for s in reversed(stints) if s.start <= step)


def recompute_consistent(stints: Sequence[Stint]) -> list[Stint]:
    """``stints`` with r set to 0 for a layer from the first stint where it does not
    recompute on: the host keeps a layer's activations ``h`` only while it recomputes
    (``hx.streamed_kv``), so a later plan cannot recompute positions written before."""
    kept = [True] * stints[0].plan.n_layers
    out = []
    for stint in stints:
        rs = [stint.plan.recompute(i) if keep else 0 for i, keep in enumerate(kept)]
        kept = [keep and r > 0 for keep, r in zip(kept, rs)]
        out.append(Stint(stint.start, stint.plan.with_recompute(rs)))
    return out
