//! `nodectl join`: build a node from the run config, the node config and the flags, and run it.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use murmur_protocol::network::{Multiaddr, NetworkConfig, TransportKind};
use murmur_trainer::Trainer;
use murmur_trainer::data::{Dataset, Split};

use crate::cli::JoinArgs;
use crate::config::{NodeConfig, RunConfig};
use crate::node::{self, NodeSetup, NodeState, TrainerJob};
use crate::store::Store;

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

pub(super) fn run(args: JoinArgs) -> Result<()> {
    let mut config = RunConfig::load(&args.config)?;
    config.apply_overrides(args.data.as_deref(), args.shard.as_deref(), args.threads)?;
    let data = args.node.data_dir();
    let (keypair, created) = data.init()?;
    if created {
        println!("initialised {}", data.root().display());
    }
    let node_config = NodeConfig::load(&data.node_config_path())?;
    let store = Store::open(&data.store_path())?;

    let backend = super::select_backend(config.training.device, config.threads())?;
    let train_dir = config.data.shard.as_ref().unwrap_or(&config.data.dir);
    let train = Dataset::load(train_dir, Split::Train).context("training data")?;
    let test = Dataset::load(&config.data.dir, Split::Test).context("test data")?;
    let spec = config.train_spec();
    let config_hash = spec.config_hash();
    let mut trainer = Trainer::new(backend, spec, &train)?;
    let checkpoint_dir = data.checkpoints();
    super::train::prepare_checkpoints(&mut trainer, &checkpoint_dir, &config_hash, false)?;
    let fingerprint = trainer.network().architecture().fingerprint();
    let param_count = trainer.network().architecture().param_count();

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

    let state = Arc::new(NodeState::new(
        keypair.public().to_peer_id(),
        config.name(),
        &fingerprint,
        &format!("{:?}", config.model.kind).to_lowercase(),
        config.training.epochs,
        param_count,
        Duration::from_secs(args.peer_timeout_secs.max(1)),
    ));
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
