"""Murmur: train your own PyTorch model in a Murmur swarm.

Each process that trains runs a Murmur node (the same one ``nodectl join`` runs) that finds the
run's peers and keeps the model close to theirs by exchanging parameters, never data::

    import murmur

    swarm = murmur.join("my-run.toml", model, optimizer)
    for x, y in loader:
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        swarm.step()  # hands over or applies a mix when one is due; waits at the staleness gate
    swarm.leave()

Every sync feature is the node's: gossip and elastic averaging, the outer step, the codecs,
overlap, the checks of what peers send, the staleness bound, state sync for late joiners, NAT
traversal. The run shows in ``nodectl status``, ``/metrics`` and the status page as a native
one does. See docs/pytorch.md.
"""

from ._native import ConfigError, ModelMismatchError, MurmurError, SwarmStopped
from ._swarm import Swarm, fingerprint, join

__all__ = [
    "ConfigError",
    "ModelMismatchError",
    "MurmurError",
    "Swarm",
    "SwarmStopped",
    "fingerprint",
    "join",
]

__version__ = "0.1.0"
