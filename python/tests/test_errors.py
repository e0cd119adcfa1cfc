"""Bad input raises an exception that says what was wrong and what to do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import murmur
from conftest import Mlp


def test_a_model_that_is_not_the_runs_is_refused_with_what_differs(run_config, node_args):
    config = run_config("mlp-run", model='kind = "mlp"\nhidden = [256, 128]')

    class Narrow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(784, 256)
            self.fc2 = nn.Linear(256, 64)
            self.fc3 = nn.Linear(64, 10)

    with pytest.raises(murmur.ModelMismatchError) as refused:
        murmur.join(config, Narrow(), **node_args("narrow"))
    message = str(refused.value)
    assert "`fc2.weight` has shape [64, 256] here and [128, 256] in the run's model" in message
    assert "`fc3.weight`" in message

    # The same tensors as the run's model are taken.
    class Same(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(784, 256)
            self.fc2 = nn.Linear(256, 128)
            self.fc3 = nn.Linear(128, 10)

    murmur.join(config, Same(), **node_args("same")).leave()


def test_a_model_in_another_dtype_is_another_model(run_config, node_args):
    config = run_config("dtype-run", model='kind = "mlp"\nhidden = [256, 128]')

    class Half(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(784, 256)
            self.fc2 = nn.Linear(256, 128)
            self.fc3 = nn.Linear(128, 10)

    with pytest.raises(murmur.ModelMismatchError, match="bfloat16 here and float32"):
        murmur.join(config, Half().to(torch.bfloat16), **node_args("half"))
    with pytest.raises(murmur.ModelMismatchError, match=r"float64.*model\.float\(\)"):
        murmur.join(run_config("f64"), Mlp().double(), **node_args("double"))


def test_a_config_that_cannot_be_read_says_which_and_why(tmp_path, run_config, node_args):
    with pytest.raises(murmur.ConfigError, match=r"missing\.toml"):
        murmur.join(tmp_path / "missing.toml", Mlp(), **node_args("missing"))
    broken = tmp_path / "broken.toml"
    broken.write_text("[training]\nepochs = 1\nbatch_size = 8\n[sync]\nintervall = 4\n")
    with pytest.raises(murmur.ConfigError, match="intervall"):
        murmur.join(broken, Mlp(), **node_args("broken"))


def test_synchronous_rings_are_refused_for_a_peer_that_steps_its_own_optimizer(
    run_config, node_args
):
    config = run_config("ring")
    text = config.read_text().replace('mode = "gossip"', 'mode = "allreduce"')
    config.write_text(text + "[sync.allreduce]\nevery = 1\n")
    with pytest.raises(murmur.ConfigError, match="every > 1"):
        murmur.join(config, Mlp(), **node_args("ring"))


def test_an_address_that_is_not_a_multiaddr_is_named(run_config, node_args):
    with pytest.raises(murmur.ConfigError, match="not-an-address"):
        murmur.join(run_config("addr"), Mlp(), **node_args("addr", bootstrap=["not-an-address"]))


def test_quasi_global_momentum_is_named_as_the_native_optimizers_alone(run_config, node_args):
    config = run_config("quasi")
    optimizer = '[optimizer]\nkind = "sgd"\nlr = 0.1\nmomentum = 0.9\nquasi_global = true\n'
    config.write_text(config.read_text().replace("[sync]", optimizer + "[sync]"))
    with pytest.warns(UserWarning, match="quasi_global = false"):
        swarm = murmur.join(config, Mlp(), **node_args("quasi"))
    swarm.leave()
