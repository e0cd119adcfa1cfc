//! `nodectl join`: build a node from the run config, the node config and the flags, and run it.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use murmur_protocol::network::{Keypair, Multiaddr, NetworkConfig, TransportKind};
use murmur_trainer::data::{Dataset, Split};
use murmur_trainer::{Backend, Trainer};

use crate::cli::JoinArgs;
use crate::config::{NodeConfig, RunConfig};
use crate::device::{on_backend, select_backend};
use crate::node::trainer::TrainerJob;
use crate::node::{self, NodeSetup};
use crate::readout::NodeState;
use crate::settings::{Identity, SyncSettings};
use crate::store::{DataDir, Store};
use crate::telemetry::{Endpoint, Telemetry};

fn parse_addrs(what: &str, addrs: &[String]) -> Result<Vec<Multiaddr>> {
    addrs
        .iter()
        .map(|a| {
            a.parse::<Multiaddr>().with_context(|| {
                format!("{what} `{a}` is not a multiaddr like /ip4/127.0.0.1/tcp/4001")
            })
        })
        .collect()
}

/// Applies `--max-staleness` and `--slowdown`.
fn apply_sync_overrides(config: &mut RunConfig, args: &JoinArgs) -> Result<()> {
    if let Some(bound) = &args.max_staleness {
        config.sync.max_staleness = match bound.as_str() {
            "off" => None,
            steps => Some(steps.parse().map_err(|_| {
                anyhow::anyhow!("--max-staleness `{steps}` is not a number of steps or `off`")
            })?),
        };
    }
    if let Some(slowdown) = args.slowdown {
        if !(slowdown.is_finite() && slowdown >= 1.0) {
            anyhow::bail!("--slowdown must be 1 (full speed) or more, not {slowdown}");
        }
        config.sync.slowdown = slowdown;
    }
    Ok(())
}

/// The exporters of this node when `OTEL_EXPORTER_OTLP_ENDPOINT` or `[telemetry]
/// otlp_endpoint` names a collector; its peer id tells it apart from the others there.
pub(super) fn telemetry(args: &JoinArgs) -> Result<Option<Telemetry>> {
    let data = args.node.data_dir();
    // A node config that does not parse is reported by `join` itself, with its path.
    let configured = NodeConfig::load(&data.node_config_path())
        .ok()
        .and_then(|config| config.telemetry.otlp_endpoint);
    let Some(endpoint) = Endpoint::resolve(configured.as_deref()) else {
        return Ok(None);
    };
    let peer_id = open_data_dir(&data)?.public().to_peer_id().to_string();
    Telemetry::start(&endpoint, Some(&peer_id)).map(Some)
}

/// The node's identity, creating the data dir on first use.
fn open_data_dir(data: &DataDir) -> Result<Keypair> {
    let (keypair, created) = data.init()?;
    if created {
        println!("initialised {}", data.root().display());
    }
    Ok(keypair)
}

pub(super) fn run(args: JoinArgs) -> Result<()> {
    let mut config = RunConfig::load(&args.config)?;
    config.apply_overrides(args.data.as_deref(), args.shard.as_deref(), args.threads)?;
    apply_sync_overrides(&mut config, &args)?;
    let backend = select_backend(config.training.device, config.threads())?;
    on_backend!(backend, backend => join(args, &config, backend))
}

/// Joins with the replica on `backend`.
fn join<B: Backend>(args: JoinArgs, config: &RunConfig, backend: B) -> Result<()> {
    let data = args.node.data_dir();
    let keypair = open_data_dir(&data)?;
    let node_config = NodeConfig::load(&data.node_config_path())?;
    let sync = SyncSettings::resolve(config, &node_config)?;
    let store = Store::open(&data.store_path())?;

    let train_dir = config.data.shard.as_ref().unwrap_or(&config.data.dir);
    let train = Dataset::load(train_dir, Split::Train).context("training data")?;
    let test = Dataset::load(&config.data.dir, Split::Test).context("test data")?;
    let spec = config.train_spec_for(train_dir)?;
    let config_hash = spec.config_hash();
    let mut trainer = Trainer::new(backend, spec, &train)?;
    let checkpoint_dir = data.checkpoints();
    super::train::prepare_checkpoints(&mut trainer, &checkpoint_dir, &config_hash, false)?;
    let fingerprint = trainer.network().architecture().fingerprint();
    let param_count = trainer.network().architecture().param_count();
    tracing::info!(
        train = train.len(),
        epochs = config.training.epochs,
        epoch_samples = trainer.epoch_samples(),
        steps = trainer.total_steps(),
        dir = %train_dir.display(),
        "training data"
    );

    let listen = if args.listen.is_empty() {
        &node_config.listen
    } else {
        &args.listen
    };
    let mut bootstrap = parse_addrs("--bootstrap", &args.bootstrap)?;
    bootstrap.extend(parse_addrs("bootstrap", &node_config.bootstrap)?);
    // The peer book: a restart reconnects to known peers without a bootstrap flag.
    for peer in store.known_peers()? {
        for addr in &peer.addrs {
            if let Ok(addr) = format!("{addr}/p2p/{}", peer.peer_id).parse() {
                bootstrap.push(addr);
            }
        }
    }
    let mut network = NetworkConfig::new(keypair.clone(), config.name(), &fingerprint);
    network.listen = parse_addrs("--listen", listen)?;
    network.bootstrap = bootstrap;
    network.mdns = node_config.mdns && !args.no_mdns;
    network.transport = TransportKind::TcpQuic;
    let trusted = node_config.trust.peer_ids()?;
    if node_config.trust.allowlist {
        if trusted.is_empty() {
            bail!(
                "[trust] allowlist = true with no peers would refuse everyone: add peer ids to \
                 [trust] peers in the node config, or set allowlist = false"
            );
        }
        tracing::info!(
            peers = trusted.len(),
            "trust allowlist on: refusing every other peer"
        );
        network.allowlist = Some(trusted);
    }

    let identity = Identity {
        peer_id: keypair.public().to_peer_id(),
        run_id: config.name().to_owned(),
        fingerprint: fingerprint.clone(),
        model: format!("{:?}", config.model.kind).to_lowercase(),
        device: trainer.backend().name(),
        epochs: config.training.epochs,
        param_count,
        optimizer_buffers: trainer.spec().optimizer.state_names().len(),
    };
    let peer_timeout = Duration::from_secs(args.peer_timeout_secs.max(1));
    let state = Arc::new(NodeState::new(identity, peer_timeout, sync));
    let setup = NodeSetup {
        data,
        store,
        network,
        api_addr: args.api.clone().unwrap_or(node_config.api),
        job: TrainerJob {
            trainer,
            train,
            test,
            checkpoint_dir,
            config_hash,
            keep: config.checkpoint.keep,
        },
        state,
        config_path: args.config.clone(),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("murmur-net")
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(node::run(setup))
}
