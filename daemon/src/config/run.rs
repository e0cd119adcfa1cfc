//! Run configs: the TOML file that says what to train and how, its defaults, its validation,
//! and error messages that point at the offending line and key.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use murmur_protocol::ring::DataPlane;
use murmur_sync::settings::{ElasticTopology, Election};
use murmur_trainer::data::{DEFAULT_DATA_DIR, ShardInfo, text};
use murmur_trainer::model::{ModelKind, ModelSpec};
use murmur_trainer::optim::OptimizerSpec;
use murmur_trainer::train::TrainSpec;
use serde::{Deserialize, Serialize};

/// A whole run file. Every table rejects keys it does not know.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    #[serde(default)]
    pub run: RunSection,
    /// Murmur's own model, which `nodectl join` and `nodectl train` train. Peers that bring
    /// their own model (the Python package, docs/pytorch.md) need none; when the config has
    /// one, theirs must have its tensors (a swarm of native and PyTorch peers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelSpec>,
    /// The optimizer of Murmur's own trainer; a PyTorch peer steps its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<OptimizerSpec>,
    pub training: TrainingSection,
    #[serde(default)]
    pub data: DataSection,
    #[serde(default)]
    pub checkpoint: CheckpointSection,
    #[serde(default)]
    pub sync: SyncSection,
}

/// `[run]`: identity of the run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSection {
    /// Name used in logs and default paths (default: the config file's stem).
    pub name: Option<String>,
    /// Seed of parameter initialisation and data order.
    #[serde(default)]
    pub seed: u64,
}

/// `[training]`: how long and how.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainingSection {
    pub epochs: u64,
    pub batch_size: usize,
    /// Samples in one epoch (default: the mean shard size for a shard from `nodectl shard`,
    /// else one pass over the training set).
    pub epoch_samples: Option<usize>,
    /// Compute threads (default: every core).
    pub threads: Option<usize>,
    #[serde(default)]
    pub device: Device,
}

/// Where the replica trains: `"auto"`, `"cpu"`, `"cuda"` (the first GPU) or `"cuda:N"`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Device {
    /// The first GPU when the driver, cuBLAS and NVRTC load and a device answers, else the CPU.
    #[default]
    Auto,
    Cpu,
    /// GPU `N` (`cuda:N`); an error when there is none.
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => text
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| {
                    format!(
                        "unknown device {text:?}: use \"auto\", \"cpu\", \"cuda\" or \"cuda:N\""
                    )
                }),
        }
    }
}

impl TryFrom<String> for Device {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        text.parse()
    }
}

impl From<Device> for String {
    fn from(device: Device) -> String {
        device.to_string()
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Auto => f.write_str("auto"),
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// `[data]`: where the samples are.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// Directory with the Fashion-MNIST IDX files, whose test split is the test set; for a
    /// `gpt`, a directory of `.txt` documents, each keeping its last tenth for validation.
    /// Default: Debian's Fashion-MNIST directory, or for a `gpt` the Shakespeare corpus where
    /// `data/fetch-shakespeare.sh` installs it.
    #[serde(default)]
    pub dir: PathBuf,
    /// A shard directory written by `nodectl shard`, trained on instead of `dir`'s train split.
    pub shard: Option<PathBuf>,
    /// What the data is, for a run with no model of Murmur's (its peers bring theirs): images
    /// (Fashion-MNIST) or text. With a `[model]`, the model's kind says.
    pub kind: Option<DataKind>,
}

/// What a run's data is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataKind {
    /// Labelled 28x28 images in IDX files (Fashion-MNIST).
    Images,
    /// A directory of `.txt` documents.
    Text,
}

impl Default for DataSection {
    /// No directory: parsing puts in the default for the model's kind.
    fn default() -> Self {
        DataSection {
            dir: PathBuf::new(),
            shard: None,
            kind: None,
        }
    }
}

fn default_data_dir() -> PathBuf {
    PathBuf::from(DEFAULT_DATA_DIR)
}

/// `data.dir` when the config leaves it out: where the data the run reads is installed.
fn default_data_dir_for(reads_text: bool) -> PathBuf {
    if reads_text {
        text::default_corpus_dir()
    } else {
        default_data_dir()
    }
}

/// `[checkpoint]`: how progress is saved.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSection {
    /// Directory of `step-N.safetensors` files (default: `runs/<run name>/checkpoints`).
    pub dir: Option<PathBuf>,
    /// Save after every this many epochs (0: only at the end).
    #[serde(default = "one")]
    pub every_epochs: u64,
    /// How many checkpoints to keep.
    #[serde(default = "three")]
    pub keep: usize,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        CheckpointSection {
            dir: None,
            every_epochs: 1,
            keep: 3,
        }
    }
}

fn one() -> u64 {
    1
}

fn three() -> usize {
    3
}

/// `[sync]`: how the replicas of a run are kept together.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyncSection {
    /// `solo` (no mixing), `gossip`, `elastic` or `allreduce` (trusted peers only).
    #[serde(default)]
    pub mode: SyncModeName,
    /// Local steps between exchanges.
    #[serde(default = "default_interval")]
    pub interval: u64,
    /// Most steps a peer may run ahead of the slowest live peer it is coupled to, and how many
    /// steps apart an elastic exchange's parameters may be; a pairwise partner's older ones are
    /// mixed at a weight that shrinks with their age (decision 0029). `"off"` removes the
    /// bound.
    #[serde(default = "default_staleness", with = "staleness")]
    pub max_staleness: Option<u64>,
    /// Weight received parameters by `1 / (1 + age in steps)`.
    #[serde(default)]
    pub age_weighting: bool,
    /// Keep training while an exchange of this replica is under way (mixes then arrive a few
    /// steps late, and on a slow link the interval stretches to the link's pace); the default
    /// pauses for it (decisions 0008, 0021).
    #[serde(default)]
    pub overlap: bool,
    /// With `overlap`: the most local steps a mix may land after the snapshot it was computed
    /// from; the trainer waits for an exchange that would land later.
    #[serde(default = "default_max_merge_lag")]
    pub max_merge_lag: u64,
    /// Stretch the interval (up to 8 times) so that a peer pauses for its exchanges no longer
    /// than it computes between them: a peer on a slow link exchanges less often rather than
    /// fall behind and hold the others at the staleness gate.
    #[serde(default)]
    pub adapt_interval: bool,
    /// Gossip and elastic: `none`, or `nesterov` (the DiLoCo outer step on the replica's own
    /// progress, taken at each snapshot for an exchange and paid with its mix, which is
    /// applied as it came; decisions 0022 and 0030).
    #[serde(default)]
    pub outer: OuterOptimizer,
    /// Outer learning rate of the `nesterov` outer step.
    #[serde(default = "default_outer_lr")]
    pub outer_lr: f32,
    /// Outer momentum of the `nesterov` outer step.
    #[serde(default = "default_outer_momentum")]
    pub outer_momentum: f32,
    /// How pairwise exchanges encode parameters: `f32` (whole replicas), or a compressed
    /// difference against copies both partners hold: `bf16`, `int8` or `int4` (blockwise) or
    /// `topk`.
    #[serde(default)]
    pub codec: CodecName,
    /// With `codec = "int8"`, `"int4"` or `"bf16"`: exchange with a partner whose exchanges take more
    /// than twice the compute of one interval through sparse top-k instead (decision 0025).
    #[serde(default)]
    pub adapt_codec: bool,
    /// Testing knob: make this node this many times slower (1 = full speed).
    #[serde(default = "default_slowdown")]
    pub slowdown: f64,
    /// Exchange parameters and state over connections through relays too, where no direct
    /// connection is up; by default they wait for one (decision 0066). For swarms whose relays
    /// are run with limits raised to carry them.
    #[serde(default)]
    pub relayed_exchanges: bool,
    #[serde(default)]
    pub elastic: ElasticSection,
    #[serde(default)]
    pub allreduce: AllreduceSection,
}

impl Default for SyncSection {
    fn default() -> Self {
        SyncSection {
            mode: SyncModeName::default(),
            interval: default_interval(),
            max_staleness: default_staleness(),
            age_weighting: false,
            overlap: false,
            max_merge_lag: default_max_merge_lag(),
            adapt_interval: false,
            outer: OuterOptimizer::default(),
            outer_lr: default_outer_lr(),
            outer_momentum: default_outer_momentum(),
            codec: CodecName::default(),
            adapt_codec: false,
            relayed_exchanges: false,
            slowdown: default_slowdown(),
            elastic: ElasticSection::default(),
            allreduce: AllreduceSection::default(),
        }
    }
}

/// The exchange codecs a run config may name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CodecName {
    #[default]
    F32,
    Bf16,
    Int8,
    /// Half a byte a value (`Codec::INT4`).
    Int4,
    /// Sparse top-k, 5 % of the values a message (`Codec::TOP_K`).
    Topk,
}

/// The sync modes a run config may name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncModeName {
    #[default]
    Solo,
    Gossip,
    Elastic,
    Allreduce,
}

/// As a config spells it.
impl std::fmt::Display for SyncModeName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SyncModeName::Solo => "solo",
            SyncModeName::Gossip => "gossip",
            SyncModeName::Elastic => "elastic",
            SyncModeName::Allreduce => "allreduce",
        })
    }
}

/// `[sync.allreduce]`: ring all-reduce among trusted peers (decision 0010).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllreduceSection {
    /// `1`: average gradients every step (synchronous SGD); `H > 1`: average parameters every
    /// `H` local steps (local SGD).
    #[serde(default = "one")]
    pub every: u64,
    /// After each parameter average (`every > 1`): `none`, or `nesterov` (the DiLoCo outer step).
    #[serde(default)]
    pub outer: OuterOptimizer,
    /// Outer learning rate of the `nesterov` outer step.
    #[serde(default = "default_outer_lr")]
    pub outer_lr: f32,
    /// Outer momentum of the `nesterov` outer step.
    #[serde(default = "default_outer_momentum")]
    pub outer_momentum: f32,
    /// `tcp` (plain TCP admitted by one-time tokens: private links) or `libp2p` (encrypted).
    #[serde(default = "default_plane")]
    pub plane: DataPlane,
    /// Seconds a round (set-up and all-reduce) may take before it is aborted and retried.
    #[serde(default = "default_ring_timeout")]
    pub ring_timeout: f64,
    /// The first round waits until the ring has this many members, this node included; later
    /// rounds go on with whoever is live.
    #[serde(default = "one_usize")]
    pub min_peers: usize,
    /// Sub-chunk size in KiB: the unit that is sent, checksummed and reduced at once.
    #[serde(default = "default_sub_chunk_kb")]
    pub sub_chunk_kb: usize,
}

impl Default for AllreduceSection {
    fn default() -> Self {
        AllreduceSection {
            every: 1,
            outer: OuterOptimizer::default(),
            outer_lr: default_outer_lr(),
            outer_momentum: default_outer_momentum(),
            plane: default_plane(),
            ring_timeout: default_ring_timeout(),
            min_peers: 1,
            sub_chunk_kb: default_sub_chunk_kb(),
        }
    }
}

/// What follows a parameter average (`allreduce`) or a mix (gossip, elastic).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OuterOptimizer {
    /// The replicas continue from the average.
    #[default]
    None,
    /// DiLoCo: Nesterov momentum on `anchor - average`.
    Nesterov,
}

/// The outer step's learning rate and momentum under `section`.
fn check_outer(section: &str, lr: f32, momentum: f32) -> Result<()> {
    if !(lr.is_finite() && lr > 0.0) {
        bail!("{section}.outer_lr must be positive");
    }
    if !(0.0..1.0).contains(&momentum) {
        bail!("{section}.outer_momentum must be in [0, 1)");
    }
    Ok(())
}

/// `sync.adapt_codec` switches slow links from a dense compressed codec to top-k: it needs
/// pairwise exchanges and such a codec to switch from.
fn check_adapt_codec(sync: &SyncSection) -> Result<()> {
    if !matches!(sync.mode, SyncModeName::Gossip | SyncModeName::Elastic) {
        bail!("sync.adapt_codec applies to pairwise exchanges (gossip); remove it here");
    }
    if !matches!(
        sync.codec,
        CodecName::Int8 | CodecName::Int4 | CodecName::Bf16
    ) {
        bail!(
            "sync.adapt_codec switches slow links from sync.codec to top-k, so it needs \
             sync.codec = \"int8\", \"int4\" or \"bf16\" (the codec of the other links)"
        );
    }
    Ok(())
}

/// A mode's own settings are refused in a run of another mode rather than ignored: a run whose
/// mode was changed, or mistyped, and whose elastic, ring or pairwise settings were left would
/// otherwise run without them, silently (decision 0076).
fn check_mode_settings(sync: &SyncSection) -> Result<()> {
    let mode = sync.mode;
    if mode != SyncModeName::Elastic && sync.elastic != ElasticSection::default() {
        bail!(
            "[sync.elastic] applies to elastic runs, and this run's sync.mode is \"{mode}\": \
             remove [sync.elastic], or set sync.mode = \"elastic\""
        );
    }
    if mode != SyncModeName::Allreduce && sync.allreduce != AllreduceSection::default() {
        bail!(
            "[sync.allreduce] applies to allreduce runs, and this run's sync.mode is \
             \"{mode}\": remove [sync.allreduce], or set sync.mode = \"allreduce\""
        );
    }
    if !matches!(mode, SyncModeName::Gossip | SyncModeName::Elastic) {
        let why = match mode {
            SyncModeName::Allreduce => "a ring averages f32 every sync.allreduce.every steps",
            _ => "a solo run exchanges nothing",
        };
        if sync.codec != CodecName::F32 {
            bail!(
                "sync.codec applies to the exchanges of gossip and elastic runs, and this \
                 run's sync.mode is \"{mode}\" ({why}): remove sync.codec"
            );
        }
        if sync.adapt_interval {
            bail!(
                "sync.adapt_interval applies to the exchanges of gossip and elastic runs, and \
                 this run's sync.mode is \"{mode}\" ({why}): remove sync.adapt_interval"
            );
        }
    }
    Ok(())
}

/// Quasi-global momentum carries a mix's displacement on as momentum. Mixes rarer than every
/// 8 steps count at a share (decision 0035), but it still diverged with the outer step, and
/// with top-k's lagging copies; it is allowed where it was measured to hold (decision 0023).
fn check_quasi_global(sync: &SyncSection) -> Result<()> {
    if !matches!(sync.mode, SyncModeName::Solo | SyncModeName::Gossip) {
        bail!("optimizer.quasi_global applies to gossip (and solo) runs only; remove it here");
    }
    if sync.outer == OuterOptimizer::Nesterov {
        bail!(
            "optimizer.quasi_global cannot go with sync.outer = \"nesterov\": both carry each \
             replica's progress on as momentum, and together they diverged (decisions 0023 and \
             0035); set one of them off"
        );
    }
    let top_k = "top-k's copies lag the replicas and the momentum pulled them apart (decision \
                 0023)";
    if sync.codec == CodecName::Topk {
        bail!(
            "optimizer.quasi_global cannot go with sync.codec = \"topk\": {top_k}; set \
             quasi_global = false or another codec"
        );
    }
    if sync.adapt_codec {
        bail!(
            "optimizer.quasi_global cannot go with sync.adapt_codec = true (it sends top-k on \
             slow links): {top_k}; set one of them to false"
        );
    }
    Ok(())
}

fn default_outer_lr() -> f32 {
    0.7
}

fn default_outer_momentum() -> f32 {
    0.9
}

fn default_plane() -> DataPlane {
    DataPlane::Tcp
}

fn default_ring_timeout() -> f64 {
    5.0
}

fn one_usize() -> usize {
    1
}

fn default_sub_chunk_kb() -> usize {
    1024
}

/// `[sync.elastic]`: elastic averaging (EASGD).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ElasticSection {
    /// Pull toward the center per exchange (default `0.9 / p`, p the live peers).
    pub alpha: Option<f32>,
    /// `center` (one elected peer holds the center variable) or `gossip` (pairwise, no center).
    #[serde(default)]
    pub topology: ElasticTopology,
    /// Peer id of the center; default: elected from the live peers.
    pub center: Option<String>,
    /// Who stands for the center's election when `center` is not pinned or not live.
    #[serde(default)]
    pub election: Election,
}

fn default_max_merge_lag() -> u64 {
    256
}

fn default_interval() -> u64 {
    8
}

fn default_staleness() -> Option<u64> {
    Some(256)
}

fn default_slowdown() -> f64 {
    1.0
}

/// `max_staleness = 64` or `max_staleness = "off"`.
mod staleness {
    use serde::de::{self, Visitor};
    use serde::{Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(value: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(steps) => s.serialize_u64(*steps),
            None => s.serialize_str("off"),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        struct Bound;
        impl Visitor<'_> for Bound {
            type Value = Option<u64>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a number of steps (0 or more) or \"off\"")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                u64::try_from(v)
                    .map(Some)
                    .map_err(|_| E::custom("max_staleness must be 0 or more steps, or \"off\""))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(Some(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                match v {
                    "off" => Ok(None),
                    other => v.parse().map(Some).map_err(|_| {
                        E::custom(format!(
                            "expected a number of steps or \"off\", found \"{other}\""
                        ))
                    }),
                }
            }
        }
        d.deserialize_any(Bound)
    }
}

impl RunConfig {
    /// Reads, parses and validates a run file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config `{}`: check the path", path.display()))?;
        let mut config = Self::parse(path, &text)?;
        if config.run.name.is_none() {
            config.run.name = path.file_stem().map(|s| s.to_string_lossy().into_owned());
        }
        Ok(config)
    }

    /// Parses and validates run-file text; `path` is only used in messages.
    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        let mut config: RunConfig = toml::from_str(text).map_err(|e| {
            let location = e
                .span()
                .map(|span| {
                    let before = &text[..span.start.min(text.len())];
                    let line = before.matches('\n').count() + 1;
                    let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
                    format!(":{line}:{column}")
                })
                .unwrap_or_default();
            anyhow::anyhow!(
                "config `{}{location}`: {}; fix that key (docs/configuration.md lists every key)",
                path.display(),
                e.message().trim_end().replace('\n', " ")
            )
        })?;
        if config.data.dir.as_os_str().is_empty() {
            config.data.dir = default_data_dir_for(config.reads_text());
        }
        config
            .validate()
            .with_context(|| format!("config `{}`", path.display()))?;
        Ok(config)
    }

    fn validate(&self) -> Result<()> {
        if let Some(model) = &self.model {
            model.expand()?;
            let reads = if self.reads_text() {
                DataKind::Text
            } else {
                DataKind::Images
            };
            if self.data.kind.is_some_and(|kind| kind != reads) {
                bail!(
                    "data.kind = {:?} does not fit [model] kind = {:?}, which reads {reads:?}: \
                     leave data.kind out (the model says what it reads)",
                    self.data.kind,
                    model.kind
                );
            }
        }
        if let Some(optimizer) = &self.optimizer {
            optimizer.validate()?;
        }
        let t = &self.training;
        if self
            .model
            .as_ref()
            .is_some_and(|m| m.kind == ModelKind::Gpt)
            && t.epoch_samples.is_none()
        {
            bail!(
                "a `gpt` needs training.epoch_samples, the windows of text in one epoch (it \
                 is evaluated and saved after each); one pass over every window would be \
                 millions of steps. nanoGPT's CPU recipe is 8 epochs of 3000 at batch_size 12"
            );
        }
        if t.epochs == 0 {
            bail!("training.epochs must be at least 1");
        }
        if t.batch_size == 0 {
            bail!("training.batch_size must be at least 1");
        }
        if t.epoch_samples == Some(0) {
            bail!("training.epoch_samples must be at least 1 (leave it out for the default)");
        }
        if t.threads == Some(0) {
            bail!("training.threads must be at least 1 (leave it out to use every core)");
        }
        if self.checkpoint.keep == 0 {
            bail!("checkpoint.keep must be at least 1");
        }
        let sync = &self.sync;
        if sync.interval == 0 {
            bail!("sync.interval must be at least 1 step");
        }
        if sync.max_merge_lag == 0 {
            bail!("sync.max_merge_lag must be at least 1 step (it bounds how late a mix lands)");
        }
        if !(sync.slowdown.is_finite() && sync.slowdown >= 1.0) {
            bail!("sync.slowdown must be 1 (full speed) or more");
        }
        if let Some(alpha) = sync.elastic.alpha
            && !(alpha > 0.0 && alpha < 1.0)
        {
            bail!("sync.elastic.alpha must be between 0 and 1 (exclusive)");
        }
        let ring = &sync.allreduce;
        if ring.every == 0 {
            bail!("sync.allreduce.every must be at least 1 step");
        }
        if !(ring.ring_timeout.is_finite() && ring.ring_timeout > 0.0) {
            bail!("sync.allreduce.ring_timeout must be a positive number of seconds");
        }
        check_outer("sync.allreduce", ring.outer_lr, ring.outer_momentum)?;
        check_outer("sync", sync.outer_lr, sync.outer_momentum)?;
        if sync.outer == OuterOptimizer::Nesterov
            && !matches!(sync.mode, SyncModeName::Gossip | SyncModeName::Elastic)
        {
            bail!(
                "sync.outer = \"nesterov\" applies to gossip and elastic; in allreduce mode set \
                 sync.allreduce.outer (with every > 1) instead"
            );
        }
        if sync.adapt_codec {
            check_adapt_codec(sync)?;
        }
        check_mode_settings(sync)?;
        if self
            .optimizer
            .as_ref()
            .is_some_and(|o| o.quasi_global == Some(true))
        {
            check_quasi_global(sync)?;
        }
        if ring.min_peers == 0 {
            bail!("sync.allreduce.min_peers must be at least 1 (this node counts)");
        }
        if ring.sub_chunk_kb == 0 {
            bail!("sync.allreduce.sub_chunk_kb must be at least 1");
        }
        if ring.outer == OuterOptimizer::Nesterov && ring.every == 1 {
            bail!(
                "sync.allreduce.outer = \"nesterov\" needs every > 1: with every = 1 the \
                 gradients are averaged and the inner optimizer already steps"
            );
        }
        Ok(())
    }

    /// Applies the `--data`, `--shard` and `--threads` flags that `train` and `join` share.
    pub fn apply_overrides(
        &mut self,
        data: Option<&Path>,
        shard: Option<&Path>,
        threads: Option<usize>,
    ) -> Result<()> {
        if let Some(dir) = data {
            self.data.dir = dir.to_owned();
        }
        if let Some(shard) = shard {
            self.data.shard = Some(shard.to_owned());
        }
        if let Some(threads) = threads {
            if threads == 0 {
                bail!("--threads must be at least 1");
            }
            self.training.threads = Some(threads);
        }
        Ok(())
    }

    pub fn name(&self) -> &str {
        self.run.name.as_deref().unwrap_or("run")
    }

    /// Whether the run's data is text: its model is a `gpt`, or with no model `data.kind`
    /// says so.
    pub fn reads_text(&self) -> bool {
        match &self.model {
            Some(model) => model.kind == ModelKind::Gpt,
            None => self.data.kind == Some(DataKind::Text),
        }
    }

    /// Murmur's own model and optimizer, for the commands that train them.
    pub fn native(&self) -> Result<(&ModelSpec, &OptimizerSpec)> {
        match (&self.model, &self.optimizer) {
            (Some(model), Some(optimizer)) => Ok((model, optimizer)),
            (None, _) => bail!(
                "run `{}` has no [model]: its peers bring their own (a PyTorch model, \
                 docs/pytorch.md), and nodectl trains only Murmur's models; start this run's \
                 peers from Python with `murmur.join`, or add a [model] section \
                 (docs/configuration.md)",
                self.name()
            ),
            (Some(_), None) => bail!(
                "run `{}` has a [model] but no [optimizer]: Murmur's trainer needs one; add \
                 an [optimizer] section (docs/configuration.md)",
                self.name()
            ),
        }
    }

    /// The parts of the config that determine the trained parameters of Murmur's own model.
    pub fn train_spec(&self) -> Result<TrainSpec> {
        let (model, optimizer) = self.native()?;
        Ok(TrainSpec {
            model: model.clone(),
            optimizer: optimizer.clone(),
            batch_size: self.training.batch_size,
            epochs: self.training.epochs,
            seed: self.run.seed,
            epoch_samples: self.training.epoch_samples,
        })
    }

    /// [`Self::train_spec`] for training on `train_dir`. Without `training.epoch_samples`, a
    /// shard made by `nodectl shard` sets the epoch to the mean shard size, so that every peer
    /// of the set takes the same number of steps whatever its shard holds (decision 0008).
    pub fn train_spec_for(&self, train_dir: &Path) -> Result<TrainSpec> {
        let mut spec = self.train_spec()?;
        if let Some(info) = ShardInfo::read(train_dir)? {
            spec.epoch_samples = spec.epoch_samples.or(Some(info.mean_samples()));
        }
        Ok(spec)
    }

    pub fn checkpoint_dir(&self) -> PathBuf {
        self.checkpoint
            .dir
            .clone()
            .unwrap_or_else(|| Path::new("runs").join(self.name()).join("checkpoints"))
    }

    /// Compute threads: the config's, else every core.
    pub fn threads(&self) -> usize {
        self.training
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
    }
}

#[cfg(test)]
mod tests;
