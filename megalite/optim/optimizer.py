"""AdamW over fp32 master weights, plain, distributed (ZeRO-1) or layer-wise (whole parameters per
data-parallel rank: --optimizer dist_muon), with loss scaling and clipping.

The model's parameters live in `ParamAndGradBuffer`s. The optimizer updates fp32 *master*
tensors: with fp32 parameters and no sharding, the parameters themselves; otherwise fp32 copies of
the pieces this rank owns -- all of each parameter (plain) or, with the distributed optimizer,
only the parts that fall in this DP rank's shard of each bucket. Adam's states live beside the
masters, so their bytes per rank fall as 1/dp. After the update the masters are written back into
the parameter buffer (cast to the model dtype) and, sharded, all-gathered over DP.

Every operation of the update is elementwise, so the distributed optimizer and the plain one
produce the same bits from the same reduced gradients.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.optim.buffers import ParamAndGradBuffer
from megalite.optim.grads import counts_once, is_expert
from megalite.optim.zero import whole_parameters
from megalite.parallel import state, traffic


@dataclass
class _Piece:
    """A run of one parameter's elements updated here: buffer[lo:hi] <- master."""
    param: torch.nn.Parameter
    buffer: ParamAndGradBuffer
    lo: int
    hi: int
    master: torch.Tensor


class MegaliteOptimizer:
    def __init__(self, buffers: list[ParamAndGradBuffer], *, lr: float, weight_decay: float = 0.01,
                 betas=(0.9, 0.95), eps: float = 1e-8, distributed: bool = False, loss_scaler=None,
                 use_apex: bool = False, separate_embedding_lr: bool = False, moe: bool = False,
                 owners: dict[int, int] | None = None):
        from megalite.optim.loss_scaler import ConstantLossScaler

        # owners (--optimizer dist_muon, layer-wise): {id(param): the rank of its buffer's data-parallel
        # group that updates it, whole}; the others' parameters come back in `publish`.
        self.owners = owners
        distributed = distributed or owners is not None
        self.buffers, self.distributed = buffers, distributed
        self.moe = moe  # the model has expert layers (on some stage): norms add the expert grid's sum
        self.loss_scaler = loss_scaler or ConstantLossScaler()
        # While a step records its timeline (megalite.training.step): the wait for the gradient
        # norm's reductions drawn here, as "norm-wait". Over the pipeline's stages it is where the
        # last stage waits out the first's last backward (the schedule's drain).
        self.spans: list | None = None
        self.pieces: list[_Piece] = []
        for buf in buffers:
            if buf.param_dtype != torch.float32 and not buf.has_fp32_init:
                raise ValueError("low-precision parameters need their fp32 initial values (fp32_init)")
            rank = dist.get_rank(buf.dp_group) if buf.dp_group is not None else 0
            for bucket in buf.buckets:
                sharded = distributed and owners is None
                own_lo, own_hi = buf.owned_range(bucket) if sharded else (0, bucket.numel)
                own_lo, own_hi = bucket.start + own_lo, bucket.start + own_hi
                for p in bucket.params:
                    if owners is not None and owners[id(p)] != rank:
                        continue
                    p_lo, p_hi = buf.param_range(p)
                    lo, hi = max(p_lo, own_lo), min(p_hi, own_hi)
                    if lo < hi:
                        self.pieces.append(_Piece(p, buf, lo, hi, self._master(p, buf, lo, hi, p_lo, p_hi)))
        for buf in buffers:
            buf.drop_fp32_init()  # the masters hold these values now
        # layer-wise: the runs of each buffer's parameter data this rank does not update (zeroed before
        # `publish` sums the buffer over data parallelism)
        self._others_of = {id(buf): self._not_mine(buf) for buf in buffers} if owners is not None else {}
        # What each step reads, fixed once the masters exist (a step walks these lists, and asks
        # nothing of each piece: on a small model the per-piece Python was a visible share of it).
        self._dense_norm_pieces = [p for p in self.pieces if counts_once(p.param) and not is_expert(p.param)]
        self._expert_pieces = [p for p in self.pieces if is_expert(p.param)]
        self._copied_pieces = [p for p in self.pieces if not self._in_place(p)]  # published by a copy
        # Groups by weight decay (none on biases and norms) and, with separate_embedding_lr, the word
        # embedding and output layer apart (their lr is step()'s embedding_lr: --decoupled-lr).
        # (`decays`: the group's weight decay follows set_weight_decay, --weight-decay-incr-style.)
        groups: dict[tuple[bool, bool], list] = {}
        for piece in self.pieces:
            apart = separate_embedding_lr and getattr(piece.param, "is_embedding_or_output_parameter", False)
            decays = piece.param.ndim > 1 and not getattr(piece.param, "no_weight_decay", False)
            groups.setdefault((decays, apart), []).append(piece.master)
        param_groups_ = [{"params": ps, "weight_decay": weight_decay if decays else 0.0, "decays": decays,
                          "embedding_or_output": apart} for (decays, apart), ps in sorted(groups.items())]
        if not param_groups_:
            param_groups_ = [{"params": [torch.zeros(0, requires_grad=True)], "weight_decay": 0.0, "decays": False,
                              "embedding_or_output": False}]
        self.inner = _adamw(param_groups_, lr, betas, eps, use_apex)
        self.last_skipped: bool | None = None  # the last step's skip, where the host read it
        # Called with found_inf after each update (or skip), before the masters are published
        # (--qk-clip: megalite.training.qk_clip)
        self.after_update: list = []

    def _master(self, p, buf, lo, hi, p_lo, p_hi) -> torch.Tensor:
        whole = lo == p_lo and hi == p_hi
        if p.dtype == torch.float32:
            if whole and not self.distributed:
                return p  # fp32 and unsharded: the parameter is its own master
            master = buf.param_slice(lo, hi)  # fp32 shard: update the stored parameters in place
        else:
            master = buf.initial_fp32(lo, hi).clone()
        return master.view(p.shape) if whole else master

    @property
    def param_groups(self):
        return self.inner.param_groups

    def plain_groups(self) -> list[dict]:
        """The inner optimizer's groups as new dicts of megalite's keys only (for another optimizer
        built over the same masters: SGD, Muon's AdamW part, bf16 moments)."""
        return [{k: g[k] for k in ("params", "weight_decay", "decays", "embedding_or_output")}
                for g in self.inner.param_groups]

    def set_weight_decay(self, weight_decay: float) -> None:
        """The weight decay of the next steps, on the weights that decay (not biases and norms)."""
        for group in self.inner.param_groups:
            if group["decays"]:
                group["weight_decay"] = weight_decay

    def whole_parameters(self):
        """A context in which every parameter is whole on this rank (ZeRO-3 gathers them, and frees
        them after): for a checkpoint save or an export. Collective: every DP rank enters it."""
        return whole_parameters(self.buffers)

    def start_param_gather(self) -> None:
        """--overlap-param-gather: post the update's parameter gathers (a step's start)."""
        for buf in self.buffers:
            buf.start_param_gather()

    def finish_param_gather(self) -> None:
        """Wait for the update's parameter gathers still in flight (--overlap-param-gather leaves
        them to the next forward): before anything else reads the parameters."""
        for buf in self.buffers:
            buf.finish_param_gather()

    def unit_storage_keys(self) -> list[int]:
        """ZeRO-3: the storage keys of every gathered unit of every buffer (none below stage 3)."""
        return [k for buf in self.buffers if buf.zero_stage == 3 for k in buf.unit_storage_keys()]

    def non_layer_units_gathered(self):
        """ZeRO-3: a context holding every buffer's non-layer units gathered (see zero.py)."""
        stack = contextlib.ExitStack()
        for buf in self.buffers:
            if buf.zero_stage == 3:
                stack.enter_context(buf.non_layer_units_gathered())
        return stack

    def units_gathered_in_turn(self):
        """ZeRO-3: every unit of every buffer gathered in turn, yielding its storage key (see
        `ShardedParamBuffer.units_gathered_in_turn`). Collective: every DP rank walks them all."""
        for buf in self.buffers:
            if buf.zero_stage == 3:
                yield from buf.units_gathered_in_turn()

    def zero_grad(self) -> None:
        for buf in self.buffers:
            buf.zero_grad()

    def _attach_grads(self) -> None:
        for piece in self.pieces:
            if piece.master is piece.param:
                # The same object the buffer's hook recognises as accumulating in place.
                piece.param.grad = piece.param.main_grad
                continue
            g = piece.buffer.grad_slice(piece.lo, piece.hi)
            g = g if g.dtype == torch.float32 else g.float()
            piece.master.grad = g.view(piece.master.shape)

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the (unscaled) gradient: each element counted once over TP, PP, DP, and
        for experts once over the expert grid (ETP x EP x PP) and expert data parallelism."""
        return self._global_norm(lambda piece: piece.master.grad)

    def params_norm(self) -> torch.Tensor:
        """Global L2 norm of the fp32 master weights, each element counted once as in `grad_norm`
        (Megatron-LM's --log-params-norm). Collective: every rank calls it."""
        return self._global_norm(lambda piece: piece.master.detach())

    def _global_norm(self, tensor_of) -> torch.Tensor:
        device = self.buffers[0].device if self.buffers else torch.device("cpu")
        sq = self._sum_of_squares(self._dense_norm_pieces, device, tensor_of)
        # (a stage of dense layers adds zero: every rank takes part in the experts' reductions)
        expert_sq = self._sum_of_squares(self._expert_pieces, device, tensor_of) if self.moe else None
        if dist.is_initialized() and dist.get_world_size() > 1:
            with self._norm_wait(device):
                dense = next((b for b in self.buffers if not b.experts), None)
                if self.distributed and dense is not None and dense.dp_size > 1:  # shards over DP (x CP)
                    traffic.counted_all_reduce("metrics", sq, dense.dp_group)
                traffic.counted_all_reduce("metrics", sq, state.get_model_parallel_group())
                if self.moe:
                    experts = next((b for b in self.buffers if b.experts), None)
                    if self.distributed and experts is not None and experts.dp_size > 1:
                        traffic.counted_all_reduce("metrics", expert_sq, experts.dp_group)
                    traffic.counted_all_reduce("metrics", expert_sq, state.get_expert_model_pipeline_group())
        return (sq if expert_sq is None else sq + expert_sq).sqrt()[0]

    @contextlib.contextmanager
    def _norm_wait(self, device: torch.device):
        """Draw the norm's reductions into `spans` as one wait, where a step records them (a GPU's
        synchronized around it, as every span of a recorded step is)."""
        if self.spans is None:
            yield
            return
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize()
        self.spans.append(("wait for the gradient norm", "norm-wait", start, time.perf_counter() - start))

    @staticmethod
    def _sum_of_squares(pieces, device, tensor_of) -> torch.Tensor:
        sq = torch.zeros(1, dtype=torch.float32, device=device)
        grads = [tensor_of(piece) for piece in pieces]
        if grads:  # one multi-tensor kernel for all the norms, not one kernel per parameter
            sq += torch.stack(torch._foreach_norm(grads)).square().sum()
        return sq

    def step(self, lr: float, clip_grad: float, embedding_lr: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscale, measure the norm, skip on inf/NaN, clip, update, publish the new weights.
        Returns (grad norm, found_inf): device tensors, found_inf 1.0 when the step was skipped.
        `embedding_lr`: the lr of the word embedding and output layer, where they are grouped apart.

        The skip is decided on the device (fused AdamW's `found_inf` leaves weights, moments and
        step count alone), so a step makes no host sync. Only a dynamic fp16 loss scaler reads the
        flag on the host, to adjust the scale: one sync a step, there alone; apex's FusedAdam, which
        has no such input, reads it too."""
        self._attach_grads()
        grads = [p.master.grad for p in self.pieces]
        scale = self.loss_scaler.scale
        if scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / scale)
        norm = self.grad_norm()
        found_inf = (~torch.isfinite(norm)).float()
        self.last_skipped = None  # known on the host only where it was read
        if self.loss_scaler.needs_found_inf or not self._device_skip:
            self.last_skipped = bool(found_inf.item())
            self.loss_scaler.update(self.last_skipped)
        if self.last_skipped:
            for hook in self.after_update:
                hook(found_inf)
            return norm, found_inf
        # The fused update (AdamW; SGD under --optimizer sgd) divides each gradient by `grad_scale`
        # as it reads it, and stores it so: the clip rides in the update, no multiply pass first.
        # (Cleared after the update below, so no step starts with one set.)
        if clip_grad > 0 and self._device_skip:
            self.inner.grad_scale = ((norm + 1e-6) / clip_grad).clamp(min=1.0)
        elif clip_grad > 0:
            torch._foreach_mul_(grads, (clip_grad / (norm + 1e-6)).clamp(max=1.0))
        for group in self.inner.param_groups:
            group["lr"] = embedding_lr if group.get("embedding_or_output") and embedding_lr is not None else lr
        if self._device_skip:
            self.inner.found_inf = found_inf
        try:
            self.inner.step()
        finally:
            self.inner.grad_scale = None  # this step's clip, not the next caller's
        for hook in self.after_update:
            hook(found_inf)
        self.publish()
        return norm, found_inf

    @property
    def _device_skip(self) -> bool:
        return bool(self.inner.defaults.get("fused"))

    def _in_place(self, piece: _Piece) -> bool:
        return piece.master.data_ptr() == piece.buffer.param_slice(piece.lo, piece.hi).data_ptr()

    def publish(self) -> None:
        """Write the masters into the parameters (cast) and all-gather the shards (layer-wise: every
        buffer summed over its data-parallel group, each rank's parameters but its own zeroed first:
        x + 0 + ... is x exactly)."""
        for piece in self._copied_pieces:
            piece.buffer.param_slice(piece.lo, piece.hi).copy_(piece.master.detach().reshape(-1))
        if self.owners is not None:
            for buf in self.buffers:
                if buf.dp_size > 1:
                    for lo, hi in self._others_of[id(buf)]:
                        buf.param_data[lo:hi].zero_()
                    traffic.counted_all_reduce("dp", buf.param_data, buf.dp_group)
        elif self.distributed:
            for buf in self.buffers:
                buf.all_gather_params()

    def _not_mine(self, buf) -> list[tuple[int, int]]:
        mine = sorted((p.lo, p.hi) for p in self.pieces if p.buffer is buf)
        runs, at = [], 0
        for lo, hi in mine + [(buf.param_data.numel(), buf.param_data.numel())]:
            if lo > at:
                runs.append((at, lo))
            at = max(at, hi)
        return runs

    def state_bytes(self) -> int:
        """Bytes this rank holds for the optimizer: fp32 masters that are copies, plus Adam's (or SGD's) states."""
        total = sum(p.master.numel() * 4 for p in self._copied_pieces)
        for st in self.inner.state.values():
            held = {id(t): t for t in st.values() if torch.is_tensor(t) and t.dim() > 0}  # SGD's buffer has two names
            total += sum(t.numel() * t.element_size() for t in held.values())
        return total

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "loss_scaler": self.loss_scaler.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.inner.load_state_dict(sd["inner"])
        self.loss_scaler.load_state_dict(sd["loss_scaler"])


def moment_names(inner, master) -> tuple[str, ...]:
    """The moments `inner` keeps for `master`, as checkpoints hold them: Adam's two, or one (Muon's
    momentum) where the optimizer says so."""
    names = getattr(inner, "moment_names", None)
    return names(master) if names is not None else ("exp_avg", "exp_avg_sq")


def moment_dtype(inner, master, name: str) -> torch.dtype:
    """The dtype `inner` stores moment `name` of `master` in (LowPrecisionAdamW's bf16 moments; a
    chained Muon + AdamW asks the optimizer that holds the master)."""
    holder = getattr(inner, "optimizer_of", lambda m: inner)(master)
    return getattr(holder, "state_dtypes", {}).get(name, master.dtype)


def _adamw(groups, lr, betas, eps, use_apex):
    if use_apex:
        try:
            from apex.optimizers import FusedAdam  # NVIDIA apex, only if the user built it
        except ImportError as e:
            raise RuntimeError("--use-apex-adam needs NVIDIA apex built from source (it is not the PyPI "
                               "package named apex); drop the flag to use PyTorch's fused AdamW") from e
        return FusedAdam(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True)
    # Fused on CPU too: one code path, and its `found_inf` input skips a step without a host sync.
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)


class _SGD(torch.optim.SGD):
    """PyTorch's fused SGD, whose momentum buffer is also the state's "exp_avg": the first moment that
    checkpoints save and load at any layout beside Adam's (megalite.checkpoint), so a resumed run keeps
    its momentum."""

    @staticmethod
    def moment_names(master) -> tuple[str, ...]:
        return ("exp_avg",)

    def step(self, closure=None):
        for st in self.state.values():  # a loaded first moment is the buffer the update reads
            if "exp_avg" in st:
                st["momentum_buffer"] = st["exp_avg"]
        loss = super().step(closure)
        for st in self.state.values():
            if st.get("momentum_buffer") is not None:
                st["exp_avg"] = st["momentum_buffer"]
        return loss


def sgd(groups, lr: float, momentum: float = 0.0) -> torch.optim.SGD:
    """Megatron-LM's SGD (--optimizer sgd --sgd-momentum m): weight decay added to the gradient,
    d = g + wd * p; the buffer b = m * b + d (b = d at the first step); p -= lr * b. Fused, like the
    AdamW it replaces, so a step with inf/NaN gradients is skipped on the device."""
    return _SGD(groups, lr=lr, momentum=momentum, fused=True)

