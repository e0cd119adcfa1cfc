//! Node settings: `<data-dir>/config.toml`, how this machine joins the network whatever the
//! run (listen and bootstrap addresses, mDNS, the control API, the ring data port, trust,
//! telemetry, serving as a relay).

use std::path::Path;

use anyhow::{Context, Result};
use murmur_protocol::network::RelayLimits;
use serde::{Deserialize, Serialize};

/// Node settings from `<data-dir>/config.toml`: how this machine joins the network, whatever
/// the run. Flags and `NODECTL_*` variables override them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    #[serde(default = "default_listen")]
    pub listen: Vec<String>,
    #[serde(default)]
    pub bootstrap: Vec<String>,
    #[serde(default = "default_true")]
    pub mdns: bool,
    /// Control API address; always on loopback.
    #[serde(default = "default_api")]
    pub api: String,
    /// Where the TCP data plane of all-reduce rings listens; peers connect to this address,
    /// so across machines use this host's address on the private network.
    #[serde(default = "default_ring_listen")]
    pub ring_listen: String,
    #[serde(default)]
    pub trust: TrustConfig,
    #[serde(default)]
    pub telemetry: TelemetryConfig,
    /// Serve as a relay for peers behind NAT: only on a host peers can dial.
    #[serde(default)]
    pub relay: bool,
    /// What a relay carries at most (with `relay = true`).
    #[serde(default)]
    pub relay_limits: RelayLimitsConfig,
    /// Whether this node runs as a client, one that cannot accept connections (decision 0066).
    #[serde(default)]
    pub client: ClientMode,
    /// Addresses peers can dial this node at, as the operator knows them (a server's public
    /// address, a forwarded port): taken as confirmed without waiting for AutoNAT.
    #[serde(default)]
    pub external_addrs: Vec<String>,
    /// What the node may hold beside its replica.
    #[serde(default)]
    pub memory: MemoryConfig,
}

/// `[memory]` of the node config: the memory a node's exchanges may hold beside its replica
/// and optimizer. Compressed exchanges keep two copies of the model for every partner
/// (decision 0081): without a bound they grow with the swarm.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryConfig {
    /// MiB the pair copies of compressed exchanges may hold, about 4 bytes a parameter for each
    /// partner kept (two copies of 16 bits a value, decision 0089). Unset: room for
    /// [`MemoryConfig::DEFAULT_PARTNERS`] partners' copies of the run's model, or
    /// [`MemoryConfig::DEFAULT_FLOOR_MIB`], whichever is more.
    #[serde(default)]
    pub pair_copies_mib: Option<u64>,
}

impl MemoryConfig {
    /// Partners whose pair copies a node keeps by default.
    pub const DEFAULT_PARTNERS: u64 = 4;
    /// The least budget by default: a small model's copies cost little, and a swarm of them
    /// keeps every pair (decision 0081).
    pub const DEFAULT_FLOOR_MIB: u64 = 1024;

    /// The budget in bytes of the pair copies for a model of `param_count` parameters.
    pub fn pair_copies_bytes(&self, param_count: usize) -> u64 {
        match self.pair_copies_mib {
            Some(mib) => mib.saturating_mul(1 << 20),
            None => (Self::DEFAULT_PARTNERS * murmur_sync::copies::Copies::bytes_for(param_count))
                .max(Self::DEFAULT_FLOOR_MIB << 20),
        }
    }
}

/// `client` of the node config: whether the node takes itself for one that peers cannot dial,
/// which exchanges only with peers it dialled and is never elected center nor let into a ring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientMode {
    /// A client once peers cannot dial it (AutoNAT) and no hole punch can reach it: its NAT
    /// maps each destination anew, or punches failed again and again and none worked.
    #[default]
    Auto,
    /// A client from the start: a host behind a firewall that takes no connection.
    Always,
    /// Never a client, whatever AutoNAT says.
    Never,
}

/// `[relay_limits]` of the node config. The defaults carry heartbeats and offers, not
/// parameters: a circuit closes after two minutes or 128 KiB.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RelayLimitsConfig {
    /// Peers that may hold a reservation (be reachable through this relay) at once.
    pub max_reservations: usize,
    /// Circuits relayed at once.
    pub max_circuits: usize,
    /// Circuits relayed at once for one peer.
    pub max_circuits_per_peer: usize,
    /// A circuit is closed after this many seconds...
    pub max_circuit_duration_s: u64,
    /// ...or this many bytes, whichever comes first.
    pub max_circuit_bytes: u64,
}

impl Default for RelayLimitsConfig {
    fn default() -> Self {
        let limits = RelayLimits::default();
        RelayLimitsConfig {
            max_reservations: limits.max_reservations,
            max_circuits: limits.max_circuits,
            max_circuits_per_peer: limits.max_circuits_per_peer,
            max_circuit_duration_s: limits.max_circuit_duration.as_secs(),
            max_circuit_bytes: limits.max_circuit_bytes,
        }
    }
}

impl RelayLimitsConfig {
    /// The limits, each checked: a zero would make a relay that serves nobody.
    pub fn limits(&self) -> Result<RelayLimits> {
        let checks = [
            ("max_reservations", self.max_reservations as u64),
            ("max_circuits", self.max_circuits as u64),
            ("max_circuits_per_peer", self.max_circuits_per_peer as u64),
            ("max_circuit_duration_s", self.max_circuit_duration_s),
            ("max_circuit_bytes", self.max_circuit_bytes),
        ];
        for (name, value) in checks {
            if value == 0 {
                anyhow::bail!(
                    "[relay_limits] {name} = 0 would make a relay that serves nobody: raise it, \
                     or set relay = false to serve no relay"
                );
            }
        }
        Ok(RelayLimits {
            max_reservations: self.max_reservations,
            max_circuits: self.max_circuits,
            max_circuits_per_peer: self.max_circuits_per_peer,
            max_circuit_duration: std::time::Duration::from_secs(self.max_circuit_duration_s),
            max_circuit_bytes: self.max_circuit_bytes,
        })
    }
}

/// `[telemetry]` of the node config: where OpenTelemetry data goes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    /// Base URL of an OTLP/HTTP collector (`http://127.0.0.1:4318`); the standard
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` variable overrides it. Unset: nothing is exported.
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
}

/// `[trust]` of the node config: the peers this node lets into all-reduce rings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrustConfig {
    /// Peer ids (`nodectl id` prints a node's) allowed into rings.
    #[serde(default)]
    pub peers: Vec<String>,
    /// Refuse every other peer at connection time, not only at ring set-up.
    #[serde(default)]
    pub allowlist: bool,
}

impl TrustConfig {
    /// The trusted peer ids, each checked.
    pub fn peer_ids(&self) -> Result<Vec<murmur_protocol::network::PeerId>> {
        self.peers
            .iter()
            .map(|text| {
                text.parse().map_err(|e| {
                    anyhow::anyhow!(
                        "[trust] peers: `{text}` is not a peer id ({e}); `nodectl id` prints a node's"
                    )
                })
            })
            .collect()
    }
}

fn default_listen() -> Vec<String> {
    vec![
        "/ip4/0.0.0.0/tcp/0".to_owned(),
        "/ip4/0.0.0.0/udp/0/quic-v1".to_owned(),
    ]
}

fn default_true() -> bool {
    true
}

fn default_ring_listen() -> String {
    "127.0.0.1:0".to_owned()
}

fn default_api() -> String {
    "127.0.0.1:0".to_owned()
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            listen: default_listen(),
            bootstrap: Vec::new(),
            mdns: true,
            api: default_api(),
            ring_listen: default_ring_listen(),
            trust: TrustConfig::default(),
            telemetry: TelemetryConfig::default(),
            relay: false,
            relay_limits: RelayLimitsConfig::default(),
            client: ClientMode::Auto,
            external_addrs: Vec::new(),
            memory: MemoryConfig::default(),
        }
    }
}

impl NodeConfig {
    /// What `nodectl init` writes.
    pub const TEMPLATE: &'static str = r#"# Node settings for `nodectl join`; flags and NODECTL_* variables override them.
# Addresses to listen on (port 0 picks a free port).
listen = ["/ip4/0.0.0.0/tcp/0", "/ip4/0.0.0.0/udp/0/quic-v1"]
# Peers to dial at start, e.g. "/ip4/192.0.2.7/tcp/4001/p2p/12D3KooW...".
bootstrap = []
# Find peers on the local network by multicast DNS.
mdns = true
# Control API (HTTP+JSON); only loopback addresses are accepted.
api = "127.0.0.1:0"
# TCP address of the all-reduce data plane (sync.mode = "allreduce"); peers connect to it, so
# across machines use this host's private-network address, e.g. "10.0.0.5:7100".
ring_listen = "127.0.0.1:0"
# Serve as a relay for peers behind NAT (only on a host that peers can dial).
relay = false
# Run as a client that accepts no connections: "auto" (once peers cannot dial this node and no
# hole punch can reach it), "always" (a host behind a firewall), or "never".
client = "auto"
# Addresses peers can dial this node at, where you know them (a server's public address, a
# forwarded port), e.g. ["/ip4/198.51.100.7/tcp/4001"]; others are found by AutoNAT. A relay
# that peers only ever dial needs one to start serving.
external_addrs = []

[trust]
# Peer ids allowed into all-reduce rings (`nodectl id` prints a node's peer id).
peers = []
# Refuse every peer not in `peers` at connection time (trusted datacenter runs).
allowlist = false

[telemetry]
# OTLP/HTTP collector to send metrics and spans to, e.g. "http://127.0.0.1:4318"
# (OTEL_EXPORTER_OTLP_ENDPOINT overrides it). Commented out: nothing is exported.
# otlp_endpoint = "http://127.0.0.1:4318"

[relay_limits]
# With relay = true: peers that may be reachable through this node at once, circuits relayed
# at once (in all and per peer), and when a circuit is closed. The defaults carry heartbeats
# and offers, not parameters.
max_reservations = 128
max_circuits = 16
max_circuits_per_peer = 4
max_circuit_duration_s = 120
max_circuit_bytes = 131072

[memory]
# MiB the pair copies of compressed exchanges (codec other than "f32") may hold: about 4
# bytes a parameter for each partner kept. Past it the copies of the partner met longest ago
# are dropped, and that pair starts again from zero copies. Commented out: room for 4
# partners' copies of the run's model, or 1024 MiB, whichever is more. `nodectl status` shows
# what they hold.
# pair_copies_mib = 2048
"#;

    /// Reads `path`; a missing file means the defaults. An empty one is refused: it is what
    /// a write cut short leaves, and its defaults would turn a trust allowlist off.
    pub fn load(path: &Path) -> Result<Self> {
        match std::fs::read_to_string(path) {
            Ok(text) if text.trim().is_empty() => anyhow::bail!(
                "node config `{}` is empty (a write cut short?); restore it from a backup, or \
                 delete it to run on the defaults (`nodectl init` writes a commented one)",
                path.display()
            ),
            Ok(text) => Self::parse(path, &text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(NodeConfig::default()),
            Err(e) => Err(e).with_context(|| format!("cannot read `{}`", path.display())),
        }
    }

    /// Parses node-config text; `path` is only named in errors.
    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        toml::from_str(text).map_err(|e| {
            anyhow::anyhow!(
                "node config `{}`: {}",
                path.display(),
                e.message().trim_end().replace('\n', " ")
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_config_template_parses_to_the_defaults() {
        let parsed: NodeConfig = toml::from_str(NodeConfig::TEMPLATE).unwrap();
        assert_eq!(parsed, NodeConfig::default());
        // The pair copies' budget: four partners' copies of a large model, at least 1 GiB.
        let memory = &parsed.memory;
        // Two copies of 16 bits a value and a 4-byte scale a block of 256: 85M / 256 blocks.
        let pair = 2 * (2 * 85_000_000 + 4 * 85_000_000_u64.div_ceil(256));
        assert_eq!(memory.pair_copies_bytes(85_000_000), 4 * pair);
        assert_eq!(memory.pair_copies_bytes(200_000), 1 << 30);
        let set: NodeConfig = toml::from_str("[memory]\npair_copies_mib = 292").unwrap();
        assert_eq!(set.memory.pair_copies_bytes(85_000_000), 292 << 20);
        let missing = NodeConfig::load(Path::new("/no/such/config.toml")).unwrap();
        assert_eq!(missing, NodeConfig::default());
        // An empty file fails closed rather than turning an allowlist off.
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("config.toml");
        std::fs::write(&empty, "\n  \n").unwrap();
        let error = format!("{:#}", NodeConfig::load(&empty).unwrap_err());
        assert!(
            error.contains("is empty") && error.contains("restore"),
            "{error}"
        );
        let bad: Result<NodeConfig, _> = toml::from_str("lissen = []");
        assert!(bad.unwrap_err().to_string().contains("lissen"));
        let bad: Result<NodeConfig, _> = toml::from_str("[trust]\npeer = []");
        assert!(bad.unwrap_err().to_string().contains("peer"));
    }

    #[test]
    fn relay_limits_default_to_libp2ps_and_a_zero_is_refused() {
        let config: NodeConfig =
            toml::from_str("relay = true\n[relay_limits]\nmax_circuits = 64").unwrap();
        assert!(config.relay);
        let limits = config.relay_limits.limits().unwrap();
        assert_eq!(limits.max_circuits, 64);
        assert_eq!(limits.max_circuit_bytes, 128 * 1024);
        let config: NodeConfig =
            toml::from_str("relay = true\n[relay_limits]\nmax_circuit_bytes = 0").unwrap();
        let error = config.relay_limits.limits().unwrap_err().to_string();
        assert!(
            error.contains("max_circuit_bytes") && error.contains("relay = false"),
            "{error}"
        );
    }

    #[test]
    fn client_mode_is_auto_unless_set_and_a_wrong_one_is_named() {
        assert_eq!(NodeConfig::default().client, ClientMode::Auto);
        let config: NodeConfig = toml::from_str("client = \"always\"").unwrap();
        assert_eq!(config.client, ClientMode::Always);
        let error = NodeConfig::parse(Path::new("config.toml"), "client = \"sometimes\"")
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("sometimes") && error.contains("always"),
            "{error}"
        );
    }

    #[test]
    fn trust_lists_peer_ids_and_names_a_bad_one() {
        let id = "12D3KooWCdcqW6qWUXQiRN2C75zFuvmQER4TtfZJE8P11JfimZrG";
        let config: NodeConfig =
            toml::from_str(&format!("[trust]\npeers = [\"{id}\"]\nallowlist = true")).unwrap();
        assert!(config.trust.allowlist);
        assert_eq!(config.trust.peer_ids().unwrap()[0].to_string(), id);
        let config: NodeConfig = toml::from_str("[trust]\npeers = [\"not-a-peer-id\"]").unwrap();
        let error = config.trust.peer_ids().unwrap_err().to_string();
        assert!(
            error.contains("not-a-peer-id") && error.contains("nodectl id"),
            "{error}"
        );
    }
}
