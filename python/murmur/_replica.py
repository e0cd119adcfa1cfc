"""The PyTorch side of Murmur's trainer contract: a model and its optimizer as the node sees them.

The node calls these methods from its replica driver while the training loop waits in
``swarm.step()``, so the model is never touched from two threads at once. Parameters cross in
flat ``float32`` buffers the node lends (:class:`murmur._native.HostBuffer`), viewed in place
with :func:`torch.frombuffer`: one copy of the model's tensors each way, whatever their device
and dtype. The views die when a method returns; the node takes its buffer back then.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ._native import ModelMismatchError

#: What an ``evaluate`` callback may return: the accuracy, or the accuracy and the loss, or a
#: mapping with ``"accuracy"`` and optionally ``"loss"``.
EvaluateResult = float | tuple[float, float | None] | dict[str, float] | None

_EXCHANGED = (torch.float32, torch.bfloat16, torch.float16)


def unwrap(model: nn.Module) -> nn.Module:
    """The module a ``DistributedDataParallel`` (or ``DataParallel``) wrapper holds, so that a
    site of several GPUs describes the same tensors as a single-process peer."""
    return getattr(model, "module", model) if isinstance(model, _WRAPPERS) else model


_WRAPPERS: tuple[type, ...] = (nn.DataParallel, nn.parallel.DistributedDataParallel)


class TorchReplica:
    """A model (its parameters and floating-point buffers) and its optimizer, flattened in
    order into the node's buffers."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        evaluate: Callable[[], EvaluateResult] | None = None,
        buffers: bool = True,
    ) -> None:
        self.model = unwrap(model)
        self.optimizer = optimizer
        self._evaluate = evaluate
        named: list[tuple[str, torch.Tensor]] = list(self.model.named_parameters())
        if buffers:
            named += [
                (name, tensor)
                for name, tensor in self.model.named_buffers()
                if tensor.is_floating_point()
            ]
        self.tensors: list[tuple[str, torch.Tensor]] = named
        self.slots: list[tuple[int, int, torch.Tensor]] = []
        offset = 0
        for _, tensor in named:
            self.slots.append((offset, tensor.numel(), tensor))
            offset += tensor.numel()
        self.param_count = offset
        self._state_keys = _state_keys(optimizer)
        #: Set when the node changed the parameters (a mix, a state): a process group's other
        #: ranks then take them from this one.
        self.touched = False
        #: Set when the node replaced the optimizer's state (a state sync).
        self.adopted = False

    # What the node asks once, at join.

    def describe(self) -> list[tuple[str, list[int], str]]:
        """Every tensor's name, shape and dtype, in the order of the flat buffer."""
        for name, tensor in self.tensors:
            if tensor.dtype not in _EXCHANGED:
                raise ModelMismatchError(
                    f"`{name}` is {tensor.dtype}: Murmur exchanges float32, bfloat16 and "
                    "float16 tensors; convert the model (`model.float()`) or keep it out"
                )
        return [
            (name, list(tensor.shape), str(tensor.dtype).removeprefix("torch."))
            for name, tensor in self.tensors
        ]

    def device(self) -> str:
        """Where the model trains, as PyTorch names it."""
        return str(self.tensors[0][1].device) if self.tensors else "cpu"

    def optimizer_buffers(self) -> list[str]:
        """The names of the optimizer's state buffers a state sync hands a peer of the same
        optimizer."""
        kind = type(self.optimizer).__name__
        return [f"{kind}.{key}" for key in self._state_keys]

    # What the node asks between steps.

    def params_into(self, flat: Any) -> None:
        """Copies the model's tensors into the node's buffer ``flat``."""
        view = torch.frombuffer(flat, dtype=torch.float32)
        with torch.no_grad():
            for offset, count, tensor in self.slots:
                view[offset : offset + count].copy_(tensor.detach().reshape(-1))

    def add(self, delta: Any, mixed_over: int | None) -> None:
        """Adds the node's ``delta`` to the model's tensors where they stand now."""
        view = torch.frombuffer(delta, dtype=torch.float32)
        with torch.no_grad():
            for offset, count, tensor in self.slots:
                part = view[offset : offset + count].view(tensor.shape)
                tensor.add_(part.to(device=tensor.device, dtype=tensor.dtype))
        self.touched = True

    def set_params(self, flat: Any, _unused: int | None = None) -> None:
        """Replaces the model's tensors by the node's ``flat`` values."""
        view = torch.frombuffer(flat, dtype=torch.float32)
        self._load(view)
        self.touched = True

    def optimizer_state_into(self, buffers: Sequence[Any]) -> int:
        """Copies the optimizer's state into ``buffers`` (one per :meth:`optimizer_buffers`
        name, zeros where a tensor has none yet); returns the updates it applied."""
        updates = 0
        if self.optimizer is None:
            return updates
        views = [torch.frombuffer(b, dtype=torch.float32) for b in buffers]
        with torch.no_grad():
            for offset, count, tensor in self.slots:
                state = self.optimizer.state.get(tensor)
                if not state:
                    continue
                for key, view in zip(self._state_keys, views, strict=True):
                    value = state.get(key)
                    if isinstance(value, torch.Tensor) and value.numel() == count:
                        view[offset : offset + count].copy_(value.detach().reshape(-1))
                updates = max(updates, _updates(state))
        return updates

    def adopt(self, params: Any, buffers: Sequence[Any] | None, updates: int) -> str | None:
        """Continues from a peer's state: its parameters, and its optimizer's state when
        ``buffers`` holds it. Returns why the state is refused, or ``None``."""
        view = torch.frombuffer(params, dtype=torch.float32)
        self._load(view)
        self.touched = True
        if buffers is None or self.optimizer is None:
            return None
        views = [torch.frombuffer(b, dtype=torch.float32) for b in buffers]
        with torch.no_grad():
            for offset, count, tensor in self.slots:
                if not any(tensor is p for g in self.optimizer.param_groups for p in g["params"]):
                    continue
                state = self.optimizer.state[tensor]
                for key, view in zip(self._state_keys, views, strict=True):
                    part = view[offset : offset + count].view(tensor.shape)
                    state[key] = part.to(device=tensor.device, dtype=tensor.dtype).clone()
                if "step" in state or _counts_steps(self.optimizer):
                    old = state.get("step")
                    state["step"] = (
                        torch.tensor(float(updates), dtype=old.dtype, device=old.device)
                        if isinstance(old, torch.Tensor)
                        else torch.tensor(float(updates))
                    )
        self.adopted = True
        return None

    def evaluate(self) -> tuple[float, float | None] | None:
        """The ``evaluate`` callback's figures, the model put back in the mode it was in."""
        if self._evaluate is None:
            return None
        was_training = self.model.training
        try:
            with torch.no_grad():
                result = self._evaluate()
        finally:
            self.model.train(was_training)
        return _figures(result)

    def _load(self, view: torch.Tensor) -> None:
        with torch.no_grad():
            for offset, count, tensor in self.slots:
                part = view[offset : offset + count].view(tensor.shape)
                tensor.copy_(part)


def _state_keys(optimizer: torch.optim.Optimizer | None) -> list[str]:
    """The per-parameter state tensors of ``optimizer``, by key, in a fixed order."""
    if optimizer is None:
        return []
    groups = optimizer.param_groups
    if isinstance(optimizer, torch.optim.SGD):
        return ["momentum_buffer"] if any(g.get("momentum", 0) for g in groups) else []
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        keys = ["exp_avg", "exp_avg_sq"]
        if any(g.get("amsgrad", False) for g in groups):
            keys.append("max_exp_avg_sq")
        return keys
    # Another optimizer: the tensors of parameters' shapes it already keeps (after a step).
    for group in groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state:
                return sorted(
                    key
                    for key, value in state.items()
                    if isinstance(value, torch.Tensor) and value.shape == param.shape
                )
    return []


def _counts_steps(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


def _updates(state: dict[str, Any]) -> int:
    step = state.get("step", 0)
    return int(step.item()) if isinstance(step, torch.Tensor) else int(step)


def _figures(result: EvaluateResult) -> tuple[float, float | None] | None:
    if result is None:
        return None
    if isinstance(result, dict):
        loss = result.get("loss")
        return float(result["accuracy"]), None if loss is None else float(loss)
    if isinstance(result, tuple):
        accuracy, loss = result
        return float(accuracy), None if loss is None else float(loss)
    return float(result), None
