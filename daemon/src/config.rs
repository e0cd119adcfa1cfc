//! What the TOML files say: the run config (what to train and how, shared by every peer of a
//! run) and the node config (how this machine joins the network). Both reject unknown keys
//! and name the file, line and key of an error.

mod node;
mod run;

pub use node::{ClientMode, NodeConfig, TelemetryConfig, TrustConfig};
pub use run::{
    AllreduceSection, CheckpointSection, CodecName, DataSection, Device, ElasticSection,
    OuterOptimizer, RunConfig, RunSection, SyncModeName, SyncSection, TrainingSection,
};
