"""A PyTorch peer's checkpoints: it resumes from its newest, and refuses another model's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import murmur
from conftest import Mlp, batches, train_step


def test_a_peer_resumes_where_it_left_its_model_and_optimizer(run_config, node_args):
    config, args = run_config("resume"), node_args("resume")
    data = batches(seed=2)
    model = Mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with murmur.join(config, model, optimizer, steps_per_epoch=4, **args) as swarm:
        for batch in data[:6]:
            swarm.step(train_step(model, optimizer, batch))
    # Leaving saved step 6 (the epochs saved steps 4 and, before it, nothing else).
    saved = {name: value.clone() for name, value in model.state_dict().items()}
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]

    again = Mlp()
    optimizer = torch.optim.SGD(again.parameters(), lr=0.05, momentum=0.9)
    with murmur.join(config, again, optimizer, steps_per_epoch=4, **args) as swarm:
        assert swarm.start_step == 6
        assert swarm.steps == 6
        for name, value in again.state_dict().items():
            assert torch.equal(value, saved[name]), name
        for param, expected in zip(again.parameters(), momentum, strict=True):
            assert torch.equal(optimizer.state[param]["momentum_buffer"], expected)


def test_a_checkpoint_of_another_model_is_refused_with_what_differs(run_config, node_args):
    config, args = run_config("another"), node_args("another")
    model = Mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with murmur.join(config, model, optimizer, **args) as swarm:
        swarm.step(train_step(model, optimizer, batches(seed=3)[0]))

    class Wider(Mlp):
        def __init__(self) -> None:
            super().__init__(hidden=(32, 8))

    with pytest.raises(murmur.ModelMismatchError) as refused:
        murmur.join(config, Wider(), **args)
    message = str(refused.value)
    assert "was written for another model" in message
    assert "`fc1.weight` has shape [32, 20] here and [16, 20] in the checkpoint" in message


def test_a_checkpoint_of_another_run_in_the_data_dir_is_refused(run_config, node_args):
    args = node_args("shared-dir")
    model = Mlp()
    with murmur.join(run_config("first-run"), model, **args) as swarm:
        swarm.step()

    with pytest.raises(murmur.ModelMismatchError, match="another run"):
        murmur.join(run_config("second-run"), nn.Sequential(Mlp()).get_submodule("0"), **args)
