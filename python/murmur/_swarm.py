"""``murmur.join`` and the :class:`Swarm` a training loop holds."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from . import _native
from ._replica import EvaluateResult, TorchReplica

# Swarms still in the swarm at exit leave properly (checkpoint, goodbye) before the
# interpreter goes.
_LIVE: weakref.WeakSet[Swarm] = weakref.WeakSet()


@atexit.register
def _leave_all() -> None:
    for swarm in list(_LIVE):
        with contextlib.suppress(_native.MurmurError):
            swarm.leave()


class Swarm:
    """A node of a Murmur run, running in this process, that keeps a model in sync with its
    peers. Call :meth:`step` after each optimizer step; leave with :meth:`leave`, or use the
    swarm as a context manager.

    In a process group (``process_group=``), rank 0 of the group runs the node and the other
    ranks follow it: after each step they take the parameters it mixed, so the group stays one
    replica.
    """

    def __init__(
        self,
        native: _native.Swarm | None,
        replica: TorchReplica,
        group: Any | None = None,
    ) -> None:
        self._native = native
        self._replica = replica
        self._group = group
        self._left = False
        #: On a follower rank: the leader's clock at the last step.
        self._leader_steps = 0
        _LIVE.add(self)

    # The training loop's calls.

    def step(self, loss: float | torch.Tensor | None = None, samples: int | None = None) -> None:
        """Tells the node this process took a step; returns when it may take the next one.

        When a mix with peers is due, the parameters are handed over or the mix lands on the
        model here; when this replica runs too far ahead of its peers, this waits at the
        staleness gate. ``loss`` (a number or a one-element tensor) shows on the status page;
        ``samples`` defaults to the run's ``training.batch_size``.
        """
        if self._native is not None:
            value = None if loss is None else float(loss)
            self._native.step(value, samples)
        if self._group is not None:
            self._follow()

    def finish(self) -> None:
        """Tells the node training is over: it keeps answering its peers until it leaves."""
        if self._native is not None:
            self._native.finish()

    def leave(self) -> None:
        """Saves a checkpoint, says goodbye to the peers and stops the node."""
        if self._left:
            return
        self._left = True
        _LIVE.discard(self)
        if self._native is not None:
            self._native.leave()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the node is asked to leave (``nodectl leave``) or ``timeout`` seconds
        pass; returns whether it left. Ctrl-C raises :class:`KeyboardInterrupt`."""
        if self._native is None:
            return False
        return self._native.wait(timeout)

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    # What the loop may read.

    def status(self) -> dict[str, Any]:
        """The node's status, as ``nodectl status --json`` prints it (empty on a follower)."""
        if self._native is None:
            return {}
        return json.loads(self._native.status_json())

    @property
    def is_leader(self) -> bool:
        """Whether this process runs the node (rank 0 of its group, or alone)."""
        return self._native is not None

    @property
    def peer_id(self) -> str | None:
        return None if self._native is None else self._native.peer_id

    @property
    def api(self) -> str | None:
        """The node's control API (``nodectl status --data-dir`` finds it too)."""
        return None if self._native is None else self._native.api

    @property
    def listen(self) -> list[str]:
        """The addresses other peers bootstrap from."""
        return [] if self._native is None else self._native.listen

    @property
    def start_step(self) -> int:
        """The step training resumed from (a checkpoint), or 0; on every rank of a group."""
        return self._leader_steps if self._native is None else self._native.start_step

    @property
    def steps(self) -> int:
        """Local steps taken, this replica's clock (a state sync moves it on); on every rank
        of a group, the leader's."""
        return self._leader_steps if self._native is None else self._native.steps

    @property
    def total_steps(self) -> int | None:
        """Steps in the run's epochs, when ``steps_per_epoch`` was given."""
        return None if self._native is None else self._native.total_steps

    @property
    def running(self) -> bool:
        """Whether the node still runs (it stops when it leaves, or fails)."""
        return self._native is not None and self._native.running

    @property
    def finished(self) -> bool:
        """Whether the run's epochs are done (with ``steps_per_epoch``)."""
        total = self.total_steps
        return total is not None and self.steps >= total

    def _follow(self) -> None:
        """In a process group: every rank takes what the node did to rank 0's model."""
        import torch.distributed as dist

        group = self._group
        source = dist.get_global_rank(group, 0)
        replica = self._replica
        device = replica.slots[0][2].device if replica.slots else torch.device("cpu")
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        flags = torch.zeros(3, dtype=torch.int64, device=device)
        if self._native is not None:
            flags[0] = int(replica.touched)
            flags[1] = int(replica.adopted)
            flags[2] = self._native.steps
            replica.touched = replica.adopted = False
        dist.broadcast(flags, src=source, group=group)
        touched, adopted, self._leader_steps = flags.tolist()
        if touched:
            with torch.no_grad():
                for _, _, tensor in replica.slots:
                    dist.broadcast(tensor.data, src=source, group=group)
        if adopted and replica.optimizer is not None:
            state = [replica.optimizer.state_dict() if self._native is not None else None]
            dist.broadcast_object_list(state, src=source, group=group)
            if self._native is None and state[0] is not None:
                replica.optimizer.load_state_dict(state[0])


def join(
    config: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    data_dir: str | os.PathLike[str] = "murmur-data",
    bootstrap: Sequence[str] = (),
    listen: Sequence[str] = (),
    api: str | None = None,
    peer_timeout: float = 10.0,
    mdns: bool = True,
    steps_per_epoch: int | None = None,
    samples_per_step: int | None = None,
    evaluate: Callable[[], EvaluateResult] | None = None,
    process_group: Any | None = None,
    buffers: bool = True,
    progress: bool | None = None,
    log: str = "warn",
) -> Swarm:
    """Joins the Murmur run described by the TOML file ``config`` with ``model``.

    Starts a node in this process: it finds the run's peers (``bootstrap`` addresses, the
    peer book of ``data_dir``, mDNS), and keeps ``model`` in sync with them by exchanging
    parameters as the run's ``[sync]`` section says. Returns once the node listens and the
    model may take its first step: resumed from the newest checkpoint in ``data_dir``, or
    from the swarm's state when this replica lags.

    Args:
        config: the run config (``[run]``, ``[training]``, ``[sync]``; a ``[model]`` section,
            if any, is Murmur's own model, which ``model`` must match tensor for tensor).
        model: any :class:`torch.nn.Module`, on any device, in float32, bfloat16 or float16;
            its parameters and floating-point buffers are what the swarm mixes.
        optimizer: its optimizer; its state goes to (and comes from) peers that run the same.
        data_dir: the node's identity, peer book and checkpoints.
        bootstrap: addresses of peers to join, such as ``/ip4/10.0.0.5/tcp/4001/p2p/12D3...``.
        listen: addresses to listen on (default: the node config's).
        api: the control API's address (default: the node config's).
        peer_timeout: seconds after which a silent peer is gone.
        mdns: find peers on the local network.
        steps_per_epoch: the loop's steps per epoch: the model is evaluated and checkpointed at
            each epoch's end, and :attr:`Swarm.finished` tells when the run's epochs are done.
        samples_per_step: samples in a step (default: ``training.batch_size``).
        evaluate: called at each epoch's end with gradients off; returns the accuracy, or
            ``(accuracy, loss)``, or ``{"accuracy": ..., "loss": ...}``.
        process_group: a ``torch.distributed`` group of ranks that train one replica (DDP);
            every rank calls ``join`` and ``step``; rank 0 runs the node.
        buffers: mix the model's floating-point buffers (batch-norm statistics) too.
        progress: show a progress line (default: when standard error is a terminal).
        log: the node's log filter, such as ``"info"`` or ``"warn,murmur_daemon=debug"``.

    Raises:
        ConfigError: a config or argument that is not valid; the message says which.
        ModelMismatchError: the model is not the run's or its checkpoint's; the message lists
            what differs.
        SwarmStopped: the node could not start.
    """
    replica = TorchReplica(model, optimizer, evaluate=evaluate, buffers=buffers)
    if process_group is not None:
        import torch.distributed as dist

        if dist.get_rank(process_group) != 0:
            follower = Swarm(None, replica, group=process_group)
            follower._follow()
            return follower
    native = _native.join(
        os.fspath(config),
        replica,
        data_dir=os.fspath(data_dir),
        bootstrap=list(bootstrap),
        listen=list(listen),
        api=api,
        peer_timeout=peer_timeout,
        mdns=mdns,
        steps_per_epoch=steps_per_epoch,
        samples_per_step=samples_per_step,
        log=log,
        progress=sys.stderr.isatty() if progress is None else progress,
    )
    swarm = Swarm(native, replica, group=process_group)
    if process_group is not None:
        # The other ranks start from what the node started rank 0 from (a checkpoint, the
        # swarm's state).
        swarm._follow()
    return swarm


def fingerprint(model: nn.Module, buffers: bool = True) -> str:
    """The fingerprint of ``model``'s tensors: peers mix only with models of the same one."""
    return _native.fingerprint(TorchReplica(model, buffers=buffers))
