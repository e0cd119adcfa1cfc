//! `nodectl join`: build a node from the run config, the node config and the flags, run it,
//! and own what a process has that a node does not: the lines it prints, its signals, its exit.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use murmur_protocol::network::{Keypair, Multiaddr, NetworkConfig, TransportKind};
use murmur_sync::settings::{Election, Timeouts};
use murmur_trainer::{Backend, Trainer};

use crate::cli::JoinArgs;
use crate::config::{ClientMode, NodeConfig, RunConfig};
use crate::device::{on_backend, select_backend};
use crate::node::replica::Replica;
use crate::node::replica::native::{NativeCheckpoints, NativeReplica};
use crate::node::{self, Drive, NodeSetup, Ready};
use crate::settings::{Identity, NodeSettings, resolve_sync};
use crate::store::{DataDir, Store};
use crate::telemetry::{Endpoint, Telemetry};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tracing::info;

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
    telemetry_of(&args.node.data_dir())
}

/// The exporters of the node whose data dir is `data`, as `nodectl join` starts them.
pub fn telemetry_of(data: &DataDir) -> Result<Option<Telemetry>> {
    // A node config that does not parse is reported by `join` itself, with its path.
    let configured = NodeConfig::load(&data.node_config_path())
        .ok()
        .and_then(|config| config.telemetry.otlp_endpoint);
    let Some(endpoint) = Endpoint::resolve(configured.as_deref()) else {
        return Ok(None);
    };
    let peer_id = open_data_dir(data)?.public().to_peer_id().to_string();
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

/// How a node joins the network: what the flags and the node config say, resolved.
#[derive(Clone, Debug)]
pub struct JoinOptions {
    pub listen: Vec<Multiaddr>,
    pub bootstrap: Vec<Multiaddr>,
    pub mdns: bool,
    pub transport: TransportKind,
    /// Control API address (loopback).
    pub api: String,
    pub peer_timeout: Duration,
}

impl JoinOptions {
    /// What the flags (or a Python caller's arguments) say, over the node config: `listen`
    /// replaces the config's addresses, `bootstrap` adds to its list, `no_mdns` turns mDNS off.
    pub fn resolve(
        node_config: &NodeConfig,
        listen: &[String],
        bootstrap: &[String],
        no_mdns: bool,
        api: Option<String>,
        peer_timeout: Duration,
    ) -> Result<Self> {
        let listen = if listen.is_empty() {
            &node_config.listen
        } else {
            listen
        };
        let mut addrs = parse_addrs("--bootstrap", bootstrap)?;
        addrs.extend(parse_addrs("bootstrap", &node_config.bootstrap)?);
        Ok(JoinOptions {
            listen: parse_addrs("--listen", listen)?,
            bootstrap: addrs,
            mdns: node_config.mdns && !no_mdns,
            transport: TransportKind::TcpQuic,
            api: api.unwrap_or_else(|| node_config.api.clone()),
            peer_timeout: peer_timeout.max(Duration::from_secs(1)),
        })
    }
}

/// Joins with the replica on `backend`.
fn join<B: Backend + 'static>(args: JoinArgs, config: &RunConfig, backend: B) -> Result<()> {
    let data = args.node.data_dir();
    open_data_dir(&data)?;
    let mut node_config = NodeConfig::load(&data.node_config_path())?;
    if let Some(mib) = args.pair_copies_mib {
        node_config.memory.pair_copies_mib = Some(mib);
    }
    let options = JoinOptions::resolve(
        &node_config,
        &args.listen,
        &args.bootstrap,
        args.no_mdns,
        args.api.clone(),
        Duration::from_secs(args.peer_timeout_secs),
    )?;
    let setup = prepare(config, &node_config, data, &options, backend)?;
    println!("peer id: {}", setup.settings.identity.peer_id);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("murmur-net")
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(run_until_signalled(setup, &args.config))
}

/// Everything a node of `config` that trains Murmur's own model on `backend` starts from,
/// in the data dir `data` (which must have an identity): see [`setup`]. Its replica resumes
/// from the newest checkpoint of this config.
pub fn prepare<B: Backend + 'static>(
    config: &RunConfig,
    node_config: &NodeConfig,
    data: DataDir,
    options: &JoinOptions,
    backend: B,
) -> Result<NodeSetup> {
    let replica = native_replica(config, &data, backend)?;
    setup(
        config,
        node_config,
        data,
        options,
        replica,
        Drive::OwnThread,
    )
}

/// Murmur's own trainer for `config` on `backend`, resumed from the newest checkpoint of this
/// config in `data`.
pub fn native_replica<B: Backend + 'static>(
    config: &RunConfig,
    data: &DataDir,
    backend: B,
) -> Result<Box<dyn Replica>> {
    let train_dir = config.data.shard.as_ref().unwrap_or(&config.data.dir);
    let spec = config.train_spec_for(train_dir)?;
    let (train, test) = super::samples::load(config)?;
    let config_hash = spec.config_hash();
    let mut trainer = Trainer::new(backend, spec, &train)?;
    let checkpoint_dir = data.checkpoints();
    super::train::prepare_checkpoints(&mut trainer, &checkpoint_dir, &config_hash, false)?;
    tracing::info!(
        train = train.len(),
        epochs = config.training.epochs,
        epoch_samples = trainer.epoch_samples(),
        steps = trainer.total_steps(),
        dir = %train_dir.display(),
        "training data"
    );
    let checkpoints = NativeCheckpoints {
        dir: checkpoint_dir,
        config_hash,
        keep: config.checkpoint.keep,
    };
    Ok(Box::new(NativeReplica::new(
        trainer,
        train,
        test,
        checkpoints,
    )))
}

/// Everything a node of `config` starts from around `replica`, driven as `drive` says, in the
/// data dir `data` (which must have an identity): its settings and its store. The known peers
/// of the peer book are dialled with the bootstrap addresses.
pub fn setup(
    config: &RunConfig,
    node_config: &NodeConfig,
    data: DataDir,
    options: &JoinOptions,
    replica: Box<dyn Replica>,
    drive: Drive,
) -> Result<NodeSetup> {
    let keypair = data.identity()?;
    let sync = resolve_sync(config, node_config)?;
    let open_election = sync
        .mode
        .elastic()
        .is_some_and(|elastic| elastic.election == Election::Open);
    if sync.centered() && open_election {
        tracing::warn!(
            "sync.elastic.election = \"open\": the elastic center is elected among every peer \
             of the run, and a stranger can make an identity that wins the election; unless \
             every peer that can reach this run is yours, list the peers you run (`nodectl \
             trust add <peer-id>`) and leave the election to them"
        );
    }
    let store = Store::open(&data.store_path())?;
    let info = replica.describe().clone();
    let fingerprint = info.fingerprint();

    let mut bootstrap = options.bootstrap.clone();
    // The peer book: a restart reconnects to known peers without a bootstrap flag.
    for peer in store.known_peers()? {
        for addr in &peer.addrs {
            if let Ok(addr) = format!("{addr}/p2p/{}", peer.peer_id).parse() {
                bootstrap.push(addr);
            }
        }
    }
    let mut network = NetworkConfig::new(keypair.clone(), config.name(), &fingerprint);
    network.listen = options.listen.clone();
    network.bootstrap = bootstrap;
    network.mdns = options.mdns;
    network.transport = options.transport;
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
    network.external_addrs = node_config
        .external_addrs
        .iter()
        .map(|addr| {
            addr.parse().with_context(|| {
                format!(
                    "external_addrs in the node config: `{addr}` is not a multiaddr (write one \
                     like \"/ip4/198.51.100.7/tcp/4001\")"
                )
            })
        })
        .collect::<Result<_>>()?;
    if node_config.relay && node_config.client == ClientMode::Always {
        bail!(
            "the node config sets relay = true and client = \"always\": a client takes no \
             connection, so it can relay nobody; set one of them back (a relay belongs on a \
             host peers can dial)"
        );
    }
    if node_config.relay {
        let limits = node_config.relay_limits.limits()?;
        tracing::info!(
            reservations = limits.max_reservations,
            circuits = limits.max_circuits,
            circuit_bytes = limits.max_circuit_bytes,
            "serving as a relay for peers behind NAT"
        );
        network.relay = Some(limits);
    }
    let identity = Identity {
        peer_id: keypair.public().to_peer_id(),
        run_id: config.name().to_owned(),
        fingerprint,
        model: info.kind.clone(),
        device: info.device.clone(),
        epochs: config.training.epochs,
        param_count: info.param_count(),
        optimizer_buffers: info.optimizer_buffers.clone(),
    };
    let settings = NodeSettings {
        identity,
        sync,
        timeouts: Timeouts::new(options.peer_timeout),
        network,
        api_addr: options.api.clone(),
        data,
        client: node_config.client,
        pair_copies_budget: node_config.memory.pair_copies_bytes(info.param_count()),
    };
    Ok(NodeSetup {
        settings,
        replica,
        drive,
        store,
    })
}

/// Runs the node until SIGINT, SIGTERM or `nodectl leave`, printing how to reach it once it is
/// ready; returns once it has left.
async fn run_until_signalled(setup: NodeSetup, config_path: &Path) -> Result<()> {
    let shutdown = CancellationToken::new();
    let (ready, is_ready) = oneshot::channel();
    let node = tokio::spawn(node::run(setup, shutdown.clone(), ready));
    let signals = tokio::spawn(leave_on_signal(shutdown.clone()));
    if let Ok(ready) = is_ready.await {
        announce(&ready, config_path);
    }
    let result = node.await.context("the node panicked");
    signals.abort();
    result?
}

/// Prints how to reach this node and the stable `ready` line scripts wait for.
fn announce(ready: &Ready, config_path: &Path) {
    for addr in &ready.listen {
        println!("listening on {addr}");
    }
    let tcp = ready
        .listen
        .iter()
        .find(|a| a.to_string().contains("/tcp/"))
        .or(ready.listen.first());
    if let Some(addr) = tcp {
        println!(
            "to join this node: nodectl join --config {} --bootstrap {addr}",
            config_path.display()
        );
    }
    println!("ready peer_id={} api={}", ready.peer_id, ready.api);
}

/// Cancels `shutdown` at the first SIGINT or SIGTERM.
async fn leave_on_signal(shutdown: CancellationToken) {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => info!("interrupted"),
        () = terminate => info!("terminated"),
    }
    shutdown.cancel();
}
