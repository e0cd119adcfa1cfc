//! `murmur._native`: the Rust half of the `murmur` Python package. A Murmur node runs inside
//! the training process (decision 0071); the Python half (`python/murmur/`) wraps the user's
//! PyTorch model as the node's replica.
//!
//! - `swarm`: `join` and the `Swarm` handle the training loop holds.
//! - `replica`: the trainer contract answered by the Python side's adapter.
//! - `buffer`: `HostBuffer`, the flat buffers parameters cross in, without copies.
//! - `checkpoints`: a PyTorch replica's checkpoints, in Murmur's format.
//!
//! Data flow of one exchange: the replica driver lends a `HostBuffer` to the adapter, which
//! copies the model's tensors into it (`torch.frombuffer`, one copy); the buffer goes to the
//! sync engine as the snapshot; the mix comes back as another buffer, which the adapter adds
//! to the tensors in place (one copy).

mod bench;
mod buffer;
mod checkpoints;
mod replica;
mod swarm;

use std::path::PathBuf;

use pyo3::exceptions::PyException;
use pyo3::prelude::*;

pyo3::create_exception!(
    _native,
    MurmurError,
    PyException,
    "Something Murmur could not do; the message says what to do next."
);
pyo3::create_exception!(
    _native,
    ConfigError,
    MurmurError,
    "A run config, node config or argument that is not valid."
);
pyo3::create_exception!(
    _native,
    ModelMismatchError,
    MurmurError,
    "The model is not the run's (or its checkpoint's): the message lists what differs."
);
pyo3::create_exception!(
    _native,
    SwarmStopped,
    MurmurError,
    "The node stopped (it left, or failed): the training loop cannot go on in the swarm."
);

/// Starts a node of the run in `config` around `replica` (a `murmur._replica.TorchReplica`).
#[pyfunction]
#[pyo3(signature = (
    config, replica, *, data_dir, bootstrap=Vec::new(), listen=Vec::new(), api=None,
    peer_timeout=10.0, mdns=true, steps_per_epoch=None, samples_per_step=None,
    log="warn".to_owned(), progress=false,
))]
#[allow(clippy::too_many_arguments)]
fn join(
    py: Python<'_>,
    config: PathBuf,
    replica: Py<PyAny>,
    data_dir: PathBuf,
    bootstrap: Vec<String>,
    listen: Vec<String>,
    api: Option<String>,
    peer_timeout: f64,
    mdns: bool,
    steps_per_epoch: Option<u64>,
    samples_per_step: Option<u64>,
    log: String,
    progress: bool,
) -> PyResult<swarm::Swarm> {
    let args = swarm::JoinArgs {
        data_dir,
        bootstrap,
        listen,
        api,
        peer_timeout,
        mdns,
        steps_per_epoch,
        samples_per_step,
        log,
        progress,
    };
    swarm::join(py, config, replica, args)
}

/// The model fingerprint of the model `replica` describes: peers mix only with equal ones.
#[pyfunction]
fn fingerprint(py: Python<'_>, replica: Py<PyAny>) -> PyResult<String> {
    swarm::fingerprint(py, &replica)
}

/// Times a hand-over and a mix of `replica`'s model on the node's path against a memcpy of
/// its bytes (`bench/pytorch_exchange.py`); a JSON object of medians over `rounds`.
#[pyfunction]
fn bench_exchange(py: Python<'_>, replica: Py<PyAny>, rounds: usize) -> PyResult<String> {
    bench::exchange(py, replica, rounds.max(1))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_function(wrap_pyfunction!(join, m)?)?;
    m.add_function(wrap_pyfunction!(fingerprint, m)?)?;
    m.add_function(wrap_pyfunction!(bench_exchange, m)?)?;
    m.add_class::<swarm::Swarm>()?;
    m.add_class::<buffer::HostBuffer>()?;
    m.add("MurmurError", py.get_type::<MurmurError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("ModelMismatchError", py.get_type::<ModelMismatchError>())?;
    m.add("SwarmStopped", py.get_type::<SwarmStopped>())?;
    Ok(())
}
