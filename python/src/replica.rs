//! A PyTorch model as a [`Replica`]: the trainer contract answered by the Python side's
//! adapter (`murmur._replica.TorchReplica`).
//!
//! The training loop is the user's: it takes its steps and calls `swarm.step()`, which drives
//! the node's rules on the loop's own thread (the node lends its driver, decision 0071): the
//! model is never touched from two threads at once, and every call into Python below runs on
//! the loop's thread between two of its steps (or, once the loop has finished, on the thread
//! that answers the peers until the node leaves).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, bail};
use murmur_daemon::model::ModelDescription;
use murmur_daemon::node::replica::{
    Adoption, Clock, Evaluation, NamedBuffer, OptimizerBuffers, Replica, ReplicaInfo, ReplicaState,
    Saved, StepReport,
};
use pyo3::prelude::*;

use crate::buffer::HostBuffer;
use crate::checkpoints::Checkpoints;

/// Where the replica's clock stands, shared with the training loop's handle, which moves it.
#[derive(Debug, Default)]
pub(crate) struct SharedClock {
    /// Steps the loop took (a state sync moves it on).
    pub(crate) step: AtomicU64,
    /// The loop finished training (`swarm.finish()`).
    pub(crate) finished: AtomicBool,
}

/// A PyTorch model and its optimizer, behind the contract.
#[derive(Debug)]
pub(crate) struct TorchReplica {
    /// `murmur._replica.TorchReplica`.
    adapter: Py<PyAny>,
    info: ReplicaInfo,
    clock: Arc<SharedClock>,
    checkpoints: Checkpoints,
    /// A parameter buffer to fill at the next hand-over: the last delta landed, whose pages are
    /// in memory already (a fresh buffer of a large model costs as much as the copy).
    spare: Mutex<Option<Vec<f32>>>,
}

impl TorchReplica {
    pub(crate) fn new(
        adapter: Py<PyAny>,
        info: ReplicaInfo,
        clock: Arc<SharedClock>,
        checkpoints: Checkpoints,
    ) -> Self {
        TorchReplica {
            adapter,
            info,
            clock,
            checkpoints,
            spare: Mutex::new(None),
        }
    }

    fn model(&self) -> &ModelDescription {
        &self.info.model
    }

    /// A buffer of the parameters' length: the spare if there is one.
    fn buffer(&self) -> Vec<f32> {
        let count = self.model().param_count();
        let spare = self.spare.lock().unwrap_or_else(|p| p.into_inner()).take();
        match spare {
            Some(values) if values.len() == count => values,
            _ => vec![0.0; count],
        }
    }

    fn keep_spare(&self, values: Vec<f32>) {
        *self.spare.lock().unwrap_or_else(|p| p.into_inner()) = Some(values);
    }

    /// Calls `method` of the adapter with `args`.
    fn call<'py>(
        &self,
        py: Python<'py>,
        method: &str,
        args: impl pyo3::call::PyCallArgs<'py>,
    ) -> Result<Bound<'py, PyAny>> {
        self.adapter
            .bind(py)
            .call_method1(method, args)
            .map_err(|e| python_error(py, e))
            .with_context(|| format!("the model's `{method}`"))
    }

    /// The parameters of the model, copied into `flat`.
    pub(crate) fn read_params(&self, flat: Vec<f32>) -> Result<Vec<f32>> {
        Python::attach(|py| {
            let lent = Bound::new(py, HostBuffer::new(flat))?;
            self.call(py, "params_into", (&lent,))?;
            Ok(lent.borrow_mut().take()?)
        })
    }

    /// Calls `method` with `values` lent, and keeps them as the spare buffer afterwards.
    fn lend(&self, method: &str, values: Vec<f32>, extra: Option<u64>) -> Result<()> {
        let back = Python::attach(|py| -> Result<Vec<f32>> {
            let lent = Bound::new(py, HostBuffer::new(values))?;
            self.call(py, method, (&lent, extra))?;
            Ok(lent.borrow_mut().take()?)
        })?;
        self.keep_spare(back);
        Ok(())
    }
}

/// A Python exception as an error that reads like the traceback's last line.
pub(crate) fn python_error(py: Python<'_>, e: PyErr) -> anyhow::Error {
    let traceback = e
        .traceback(py)
        .and_then(|t| t.format().ok())
        .unwrap_or_default();
    anyhow::anyhow!("{e}\n{traceback}")
}

impl Replica for TorchReplica {
    fn describe(&self) -> &ReplicaInfo {
        &self.info
    }

    fn clock(&self) -> Clock {
        Clock {
            step: self.clock.step.load(Ordering::Acquire),
            finished: self.clock.finished.load(Ordering::Acquire),
        }
    }

    fn step(&mut self) -> Result<Option<StepReport>> {
        bail!("a PyTorch peer's loop takes its own steps and reports them to the node's driver")
    }

    fn gradient(&mut self) -> Result<(u64, Vec<f32>)> {
        bail!(
            "a PyTorch peer steps its own optimizer: sync.mode = \"allreduce\" with every = 1 \
             (synchronous SGD) is for Murmur's own trainer; use every > 1, gossip or elastic"
        )
    }

    fn apply_mean_gradient(&mut self, _mean: &[f32]) -> Result<StepReport> {
        bail!("a PyTorch peer steps its own optimizer, not the ring's mean gradient")
    }

    fn params(&mut self) -> Result<Vec<f32>> {
        let flat = self.buffer();
        self.read_params(flat)
    }

    fn set_params(&mut self, params: Vec<f32>) -> Result<()> {
        self.lend("set_params", params, None)
    }

    fn add(&mut self, delta: Vec<f32>, mixed_over: Option<u64>) -> Result<()> {
        self.lend("add", delta, mixed_over)
    }

    fn state(&mut self) -> Result<ReplicaState> {
        let params = self.params()?;
        let count = self.model().param_count();
        let optimizer = Python::attach(|py| -> Result<Option<OptimizerBuffers>> {
            if self.info.optimizer_buffers.is_empty() {
                return Ok(None);
            }
            let lent: Vec<Bound<'_, HostBuffer>> = (self.info.optimizer_buffers.iter())
                .map(|_| Bound::new(py, HostBuffer::new(vec![0.0; count])))
                .collect::<PyResult<_>>()?;
            let updates: u64 = self
                .call(py, "optimizer_state_into", (lent.clone(),))?
                .extract()?;
            let buffers = (self.info.optimizer_buffers.iter())
                .zip(lent)
                .map(|(name, lent)| {
                    Ok(NamedBuffer {
                        name: name.clone(),
                        values: lent.borrow_mut().take()?,
                    })
                })
                .collect::<PyResult<_>>()?;
            Ok(Some(OptimizerBuffers { buffers, updates }))
        })?;
        Ok(ReplicaState {
            step: self.clock().step,
            params,
            optimizer,
        })
    }

    fn adopt(&mut self, state: ReplicaState) -> Result<Adoption> {
        let ReplicaState {
            step,
            params,
            optimizer,
        } = state;
        let adoption = Python::attach(|py| -> Result<Adoption> {
            let params = Bound::new(py, HostBuffer::new(params))?;
            let (buffers, updates) = match optimizer {
                Some(o) => {
                    let lent = (o.buffers.into_iter())
                        .map(|b| Bound::new(py, HostBuffer::new(b.values)))
                        .collect::<PyResult<Vec<_>>>()?;
                    (Some(lent), o.updates)
                }
                None => (None, 0),
            };
            let whole = buffers.is_some();
            let refused: Option<String> = self
                .call(py, "adopt", (&params, buffers, updates))?
                .extract()?;
            Ok(match refused {
                Some(why) => Adoption::Refused(why),
                None if whole => Adoption::Whole,
                None => Adoption::ParametersOnly,
            })
        })?;
        if !matches!(adoption, Adoption::Refused(_)) {
            self.clock.step.store(step, Ordering::Release);
        }
        Ok(adoption)
    }

    fn evaluate(&mut self) -> Result<Option<Evaluation>> {
        Python::attach(|py| {
            let figures: Option<(f64, Option<f64>)> = self.call(py, "evaluate", ())?.extract()?;
            Ok(figures.map(|(accuracy, loss)| Evaluation { accuracy, loss }))
        })
    }

    fn checkpoint(&mut self) -> Result<Option<Saved>> {
        let state = self.state()?;
        if !(state.params.iter().all(|v| v.is_finite())) {
            bail!(
                "not saving the replica at step {}: it holds values that are not finite \
                 (training diverged); the newest checkpoint is the last good one",
                state.step
            );
        }
        let epoch = self.info.epochs_at(state.step);
        self.checkpoints.save(&state, epoch).map(Some)
    }
}
