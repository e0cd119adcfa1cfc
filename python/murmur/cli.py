"""Command-line flags for training scripts that join a swarm, the same as ``nodectl join``'s.

A script that uses them can be started by Murmur's testnet scripts in place of ``nodectl join``
(``testnet/run.sh --python SCRIPT``)::

    parser = argparse.ArgumentParser()
    murmur.cli.add_node_arguments(parser)
    args = parser.parse_args()
    swarm = murmur.cli.join(args, model, optimizer, steps_per_epoch=len(loader))
"""

from __future__ import annotations

import argparse
import signal
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._replica import EvaluateResult
from ._swarm import Swarm
from ._swarm import join as join_swarm


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``nodectl join``'s flags: the run config, the node's data dir and its network."""
    node = parser.add_argument_group("the Murmur node")
    node.add_argument("--config", "-c", required=True, help="the run config (TOML)")
    node.add_argument(
        "--data-dir",
        default="murmur-data",
        help="the node's identity, peer book and checkpoints (default: murmur-data)",
    )
    node.add_argument(
        "--bootstrap",
        action="append",
        default=[],
        metavar="MULTIADDR",
        help="a peer to join, such as /ip4/10.0.0.5/tcp/4001/p2p/12D3KooW... (repeatable)",
    )
    node.add_argument(
        "--listen",
        action="append",
        default=[],
        metavar="MULTIADDR",
        help="an address to listen on (repeatable; default: the node config's)",
    )
    node.add_argument("--api", help="the control API's address (default: the node config's)")
    node.add_argument("--no-mdns", action="store_true", help="do not look for peers by mDNS")
    node.add_argument(
        "--peer-timeout-secs",
        type=float,
        default=10.0,
        help="seconds after which a silent peer is gone (default: 10)",
    )
    node.add_argument(
        "--log", default="warn", help="the node's log filter, such as info (default: warn)"
    )


def join(
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    evaluate: Callable[[], EvaluateResult] | None = None,
    steps_per_epoch: int | None = None,
    **kwargs: Any,
) -> Swarm:
    """Joins the swarm as the flags of :func:`add_node_arguments` say, and prints how to reach
    this node, as ``nodectl join`` does. SIGTERM then raises :class:`KeyboardInterrupt`, so that
    a ``with swarm:`` block leaves properly (a checkpoint, a goodbye) when the script is
    stopped."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    swarm = join_swarm(
        args.config,
        model,
        optimizer,
        data_dir=args.data_dir,
        bootstrap=args.bootstrap,
        listen=args.listen,
        api=args.api,
        mdns=not args.no_mdns,
        peer_timeout=args.peer_timeout_secs,
        log=args.log,
        evaluate=evaluate,
        steps_per_epoch=steps_per_epoch,
        **kwargs,
    )
    announce(swarm, args.config)
    return swarm


def announce(swarm: Swarm, config: str) -> None:
    """Prints the lines ``nodectl join`` prints once its node is ready."""
    if not swarm.is_leader:
        return
    print(f"peer id: {swarm.peer_id}")
    for address in swarm.listen:
        print(f"listening on {address}")
    tcp = next((a for a in swarm.listen if "/tcp/" in a), None) or next(iter(swarm.listen), None)
    if tcp is not None:
        print(f"to join this node: nodectl join --config {config} --bootstrap {tcp}")
    print(f"ready peer_id={swarm.peer_id} api={swarm.api}", flush=True)
