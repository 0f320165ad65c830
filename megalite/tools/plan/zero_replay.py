"""ZeRO stages 2-3 on one rank: the units stage 3 gathers (`chunk_units`, megalite's own
`layer_units` asked about a stand-in chunk), and the step's transient peak (`transient_peak`),
replayed from megalite.optim.zero's order of events."""
from __future__ import annotations

from dataclasses import dataclass, field

from megalite.optim.buffers import BucketLayout
from megalite.optim.zero import MAX_IN_FLIGHT, layer_units
from megalite.pipeline.partition import virtual_stage
from megalite.tools.plan.inputs import rank_parameter_layers, rank_parameters


class _Param:
    """Stands for one parameter in `megalite.optim.zero.layer_units`, which reads only ids and
    whether a parameter is deferred."""
    __slots__ = ("deferred",)

    def __init__(self, deferred: bool):
        self.deferred = deferred


class _Layer:
    def __init__(self, params: list):
        self._params = params

    def parameters(self):
        return iter(self._params)


class _Chunk:
    def __init__(self, layers: list):
        self.layers = layers


def chunk_units(params: list[tuple[int, bool]], layer_of: list[int | None]) -> list[list[int]]:
    """ZeRO-3 units of one chunk given as `rank_parameters` / `rank_parameter_layers`: megalite's
    own `layer_units`, asked about a stand-in chunk with the same layers and parameters."""
    stand_ins = [_Param(deferred) for _, deferred in params]
    n_layers = max((i for i in layer_of if i is not None), default=-1) + 1
    layers = [_Layer([p for p, i in zip(stand_ins, layer_of) if i == k]) for k in range(n_layers)]
    return layer_units(_Chunk(layers), stand_ins, lambda p: p.deferred)


# -------------------------------------------------------------------------------------------------
# Stages 2-3: the transient peak, replayed from megalite.optim.zero's order of events
# -------------------------------------------------------------------------------------------------
class _Replay:
    """The byte counters of `ShardedGradBuffer` / `ShardedParamBuffer` (`transient_peak`), driven by
    one step's events on one chunk: units gathered and freed, gradients arriving per parameter,
    buckets launched (at most MAX_IN_FLIGHT reduce-scatters in flight) and landed."""

    def __init__(self, buckets: list[BucketLayout], stage: int, pb: int, gb: int, keep_for_step: bool):
        self.buckets, self.stage, self.pb, self.gb = buckets, stage, pb, gb
        self.keep_for_step = keep_for_step
        self.bucket_of = {k: i for i, b in enumerate(buckets) for k in b.members}
        self.now = {"grads": 0, "gathered": 0}
        self.peak = {"grads": 0, "gathered": 0}
        self.peak_total = 0
        self.gathered: set[int] = set()
        self.open: dict[int, int] = {}  # bucket -> gradients in so far
        self.in_flight: list[int] = []
        # Kept whole from a backward's end for the next forward (zero3_hooks' `keep_at_turns`): the
        # first layer's unit, and the others released after it (set by _replay_step)
        self.turn_first: set[int] = set()
        self.turn_rest: set[int] = set()
        self._first_done = False

    def _count(self, kind: str, nbytes: int) -> None:
        self.now[kind] += nbytes
        self.peak[kind] = max(self.peak[kind], self.now[kind])
        self.peak_total = max(self.peak_total, sum(self.now.values()))

    def _numel(self, i: int) -> int:
        return self.buckets[i].end - self.buckets[i].start

    def gather(self, i: int) -> None:
        if i not in self.gathered:
            self.gathered.add(i)
            self._count("gathered", self._numel(i) * self.pb)

    def free(self, i: int) -> None:
        if i in self.gathered and not self.keep_for_step:
            self.gathered.discard(i)
            self._count("gathered", -self._numel(i) * self.pb)

    def grad(self, k: int) -> None:
        i = self.bucket_of[k]
        if i not in self.open:
            self.open[i] = 0
            self._count("grads", self._numel(i) * self.gb)
        self.open[i] += 1
        if self.open[i] == len(self.buckets[i].members):
            self._launch(i)

    def _launch(self, i: int) -> None:
        self.in_flight.append(i)
        while len(self.in_flight) > MAX_IN_FLIGHT:
            self._land(self.in_flight.pop(0))
        if self.stage == 3:  # its gradients are in: the unit is not needed again this backward
            self._first_done |= i in self.turn_first
            if not (i in self.turn_first or (i in self.turn_rest and self._first_done)):
                self.free(i)

    def _land(self, i: int) -> None:
        del self.open[i]
        self._count("grads", -self._numel(i) * self.gb)

    def end_of_backward(self) -> None:
        for i in list(self.open):
            if i not in self.in_flight:
                self._launch(i)
        while self.in_flight:
            self._land(self.in_flight.pop(0))


@dataclass
class _Peaks:
    peak_total: int = 0
    peak: dict = field(default_factory=lambda: {"grads": 0, "gathered": 0})
    layer_buckets: list = field(default_factory=list)


def transient_peak(config, tp, pp, vpp, pp_rank, seq_length, explicit, stage, pb, gb, buckets, reshard,
               keep, ep=1, etp=None, experts=None, v_shape=False) -> _Peaks:
    """Stages 2-3: the largest transient of one step on this rank. Chunks run one at a time and
    each forward and backward ends with nothing in flight (and, resharding, nothing gathered), so
    the rank's peak is its fullest chunk's; kept gathered (no resharding) they add up."""
    out = _Peaks()
    if stage < 2:
        return out
    chunks = rank_parameters(config, tp, pp, vpp, pp_rank, seq_length, explicit, ep=ep, etp=etp, experts=experts,
                             v_shape=v_shape)
    layers = rank_parameter_layers(config, tp, pp, vpp, pp_rank, seq_length, explicit, experts=experts,
                                   v_shape=v_shape)
    v = vpp or 1
    peaks = []
    for c, (params, layer_of, chunk_buckets) in enumerate(zip(chunks, layers, buckets)):
        if not params:  # a chunk without expert weights: no expert buffer
            peaks.append(_Replay(chunk_buckets, stage, pb, gb, False))
            out.layer_buckets.append(set())
            continue
        post = virtual_stage(pp, pp_rank, c, v_shape) == pp * v - 1
        replay = _Replay(chunk_buckets, stage, pb, gb, keep and stage == 3)
        pre = virtual_stage(pp, pp_rank, c, v_shape) == 0
        layer_bucket = _replay_step(replay, params, layer_of, post, reshard or stage < 3,
                                    turns=v == 1 and reshard and not keep, pre=pre)
        out.layer_buckets.append(set(layer_bucket))
        peaks.append(replay)
    out.peak = {k: max(r.peak[k] for r in peaks) for k in ("grads", "gathered")}
    out.peak_total = max(r.peak_total for r in peaks)
    if stage == 3 and (keep or not reshard) and len(peaks) > 1:
        # Interleaved, every chunk forwards before the first backward and keeps its units: one
        # chunk's peak with the other chunks whole.
        whole = [sum(b.end - b.start for b in chunk) * pb for chunk in buckets]
        out.peak_total = max(r.peak_total + sum(whole) - whole[c] for c, r in enumerate(peaks))
        out.peak["gathered"] = sum(whole)
    return out


def _replay_step(replay: _Replay, params, layer_of, post: bool, reshard: bool, turns: bool = False,
                 pre: bool = False) -> list[int]:
    """One micro-batch's forward and backward of a chunk, in the order megalite's hooks see them
    (zero3_hooks._UnitHooks; stage 2 only has the backward's gradients). `turns`: the backward keeps
    its first layer whole for the next forward, and (`pre`, the chunk with the embeddings) the other
    units released after it. Returns the bucket of each layer."""
    layer_ids = sorted({i for i in layer_of if i is not None})  # an expert buffer skips the dense layers
    n_layers = len(layer_ids)
    layer_bucket = [replay.bucket_of[layer_of.index(i)] for i in layer_ids]
    others = sorted({replay.bucket_of[k] for k, i in enumerate(layer_of) if i is None})
    if turns and n_layers:
        replay.turn_first, replay.turn_rest = {layer_bucket[0]}, set(others) if pre else set()
    if replay.stage == 3:  # forward: the chunk's other units, then each layer with the next prefetched
        for i in others:
            replay.gather(i)
        for i in range(n_layers):
            replay.gather(layer_bucket[i])
            if i + 1 < n_layers:
                replay.gather(layer_bucket[i + 1])
            if reshard:
                replay.free(layer_bucket[i])
        if reshard:
            for i in others:
                replay.free(i)
        for i in others:  # backward: the chunk's output hook gathers them, prefetches the last layer
            replay.gather(i)
        if n_layers:
            replay.gather(layer_bucket[-1])
    # Gradients, as backward produces them: the output layer's and final norm's first (with the
    # deferred tied copy that the output layer uses), then the layers last to first (each in
    # reverse definition order), then the embeddings (a tied one once both its uses are in).
    in_layers = [k for k, i in enumerate(layer_of) if i is not None]
    first, last = (in_layers[0], in_layers[-1]) if in_layers else (len(params), len(params) - 1)
    early = [k for k, (_, deferred) in enumerate(params) if deferred and post]
    tail = [k for k in reversed(range(last + 1, len(params))) if k not in early]
    head = [k for k in reversed(range(min(first, last + 1))) if k not in early]
    for k in early + tail:
        replay.grad(k)
    for i in reversed(range(n_layers)):
        if replay.stage == 3:
            replay.gather(layer_bucket[i])
            if i > 0:
                replay.gather(layer_bucket[i - 1])
        for k in reversed([k for k, j in enumerate(layer_of) if j == layer_ids[i]]):
            replay.grad(k)
    for k in head:
        replay.grad(k)
    replay.end_of_backward()
    return layer_bucket

