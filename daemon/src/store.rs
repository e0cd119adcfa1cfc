//! The node's data directory: its identity key, node settings, and the redb metadata store
//! (peer book, run progress, checkpoint index). Tensors never go into the store; checkpoints
//! are safetensors files next to it. See docs/decisions/0005 for why redb.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use libp2p::identity::Keypair;
use murmur_trainer::checkpoint::Checkpoint;
use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};
use serde::{Deserialize, Serialize};

use crate::model::ModelDescription;

/// Peer id (text) -> [`KnownPeer`] (JSON).
const PEERS: TableDefinition<'_, &str, &str> = TableDefinition::new("peers");
/// Run id -> [`RunProgress`] (JSON).
const PROGRESS: TableDefinition<'_, &str, &str> = TableDefinition::new("progress");
/// Step -> checkpoint path, of every checkpoint ever written: earlier versions kept it and
/// nothing read it. With short epochs it grew by hundreds of rows a minute (the store's file and
/// redb's page cache with it), so a store that has it drops it on open. The checkpoints are the
/// files of the checkpoint directory, which keeps the newest few.
const LEGACY_CHECKPOINTS: TableDefinition<'_, u64, &str> = TableDefinition::new("checkpoints");

/// Peers the peer book keeps at most: past it, the one seen longest ago is forgotten. Peers
/// choose what they announce, so the book must not grow with them.
pub const MAX_BOOK_PEERS: usize = 256;
/// Addresses kept per peer, and the longest address kept.
pub const MAX_BOOK_ADDRS: usize = 8;
const MAX_BOOK_ADDR_LEN: usize = 256;

/// The file name of the elastic center in a node's checkpoint directory.
pub const CENTER_FILE: &str = "center.safetensors";

/// Where a node keeps its state, and the names of the files in it.
#[derive(Clone, Debug)]
pub struct DataDir {
    root: PathBuf,
}

impl DataDir {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        DataDir { root: root.into() }
    }

    /// `$XDG_DATA_HOME/murmur`, else `~/.local/share/murmur`, else `./murmur-data`.
    pub fn default_root() -> PathBuf {
        if let Some(dir) = std::env::var_os("XDG_DATA_HOME").filter(|d| !d.is_empty()) {
            return PathBuf::from(dir).join("murmur");
        }
        match std::env::var_os("HOME").filter(|d| !d.is_empty()) {
            Some(home) => PathBuf::from(home).join(".local/share/murmur"),
            None => PathBuf::from("murmur-data"),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn identity_path(&self) -> PathBuf {
        self.root.join("identity.key")
    }

    pub fn store_path(&self) -> PathBuf {
        self.root.join("murmur.redb")
    }

    /// The file `nodectl join` writes its control API address to.
    pub fn api_path(&self) -> PathBuf {
        self.root.join("api")
    }

    /// The control API's token (owner-only), written beside `api` at each start; requests
    /// that change anything must carry it (decision 0038).
    pub fn api_token_path(&self) -> PathBuf {
        self.root.join("api-token")
    }

    /// The status the daemon last reported, written when it exits.
    pub fn last_status_path(&self) -> PathBuf {
        self.root.join("last-status.json")
    }

    pub fn checkpoints(&self) -> PathBuf {
        self.root.join("checkpoints")
    }

    /// The elastic center, saved beside the checkpoints when its holder leaves.
    pub fn center_path(&self) -> PathBuf {
        self.checkpoints().join(CENTER_FILE)
    }

    /// Node settings (`config.toml`): listen and bootstrap addresses, mDNS, API address.
    pub fn node_config_path(&self) -> PathBuf {
        self.root.join("config.toml")
    }

    /// Creates the directory and, unless it already exists, the identity key. Returns the key
    /// and whether it was created now.
    pub fn init(&self) -> Result<(Keypair, bool)> {
        fs::create_dir_all(&self.root)
            .with_context(|| format!("cannot create data dir `{}`", self.root.display()))?;
        let settings = self.node_config_path();
        if !settings.exists() {
            write_new(
                &settings,
                crate::config::NodeConfig::TEMPLATE.as_bytes(),
                0o644,
            )?;
        }
        let path = self.identity_path();
        if path.exists() {
            return Ok((self.identity()?, false));
        }
        let key = Keypair::generate_ed25519();
        let bytes = key
            .to_protobuf_encoding()
            .context("cannot encode the new identity key")?;
        if !write_new(&path, &bytes, 0o600)? {
            // Another `nodectl init` got there first: its key is the one.
            return Ok((self.identity()?, false));
        }
        Ok((key, true))
    }

    /// Reads the identity key; refuses one that others can read.
    pub fn identity(&self) -> Result<Keypair> {
        let path = self.identity_path();
        let meta = fs::metadata(&path).with_context(|| {
            format!(
                "no identity in `{}`: run `nodectl init --data-dir {}` first",
                self.root.display(),
                self.root.display()
            )
        })?;
        if meta.permissions().mode() & 0o077 != 0 {
            bail!(
                "`{}` is readable by other users; run `chmod 600 {}`",
                path.display(),
                path.display()
            );
        }
        let bytes = fs::read(&path).with_context(|| format!("cannot read `{}`", path.display()))?;
        Keypair::from_protobuf_encoding(&bytes).with_context(|| {
            format!(
                "`{}` is not a valid identity key; restore it from a backup, or delete it and \
                 run `nodectl init` for a new peer id",
                path.display()
            )
        })
    }
}

/// Writes `bytes` to a temporary file of `mode` beside `path`, flushed to disk: what
/// [`write_atomic`] and [`write_new`] then move into place.
fn write_temporary(path: &Path, bytes: &[u8], mode: u32) -> Result<PathBuf> {
    // Named by the process, so that two writers of one file never share a temporary file.
    let mut name = std::ffi::OsString::from(".");
    name.push(path.file_name().unwrap_or_default());
    name.push(format!(".{}.tmp", std::process::id()));
    let tmp = path.with_file_name(name);
    // One left by a crash of a process of the same number may have another mode: start afresh.
    match fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("cannot remove `{}`", tmp.display()));
        }
        _ => {}
    }
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .with_context(|| format!("cannot create `{}`", tmp.display()))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .with_context(|| format!("cannot write `{}`", tmp.display()))?;
    Ok(tmp)
}

/// Flushes the directory that holds `path`, so that a rename into it survives a crash.
fn sync_parent(path: &Path) -> Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("cannot flush the directory `{}`", dir.display()))
}

/// Replaces `path` with `bytes` (file mode `mode`) so that a crash at any point leaves either
/// the old file or the new one, whole: written to a temporary file, flushed, renamed over it.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    let tmp = write_temporary(path, bytes, mode)?;
    fs::rename(&tmp, path).with_context(|| format!("cannot replace `{}`", path.display()))?;
    sync_parent(path)
}

/// Creates `path` holding `bytes` unless it exists (then returns `false` and changes
/// nothing), as atomically as [`write_atomic`]: a crash leaves no file or the whole one.
pub fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<bool> {
    let tmp = write_temporary(path, bytes, mode)?;
    // A hard link does not replace an existing file: two racing writers cannot both win.
    let linked = fs::hard_link(&tmp, path);
    let _ = fs::remove_file(&tmp);
    match linked {
        Ok(()) => sync_parent(path).map(|()| true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e).with_context(|| format!("cannot create `{}`", path.display())),
    }
}

/// A peer this node has been connected to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KnownPeer {
    pub peer_id: String,
    pub addrs: Vec<String>,
    pub last_seen_unix: u64,
}

/// How far this node got in a run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunProgress {
    pub step: u64,
    pub epoch: u64,
    pub updated_unix: u64,
}

/// The metadata store.
#[derive(Debug)]
pub struct Store {
    db: Database,
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Store {
    pub fn open(path: &Path) -> Result<Self> {
        let db = Database::create(path).with_context(|| {
            format!(
                "cannot open the store `{}` (is another nodectl using this data dir?)",
                path.display()
            )
        })?;
        let txn = db.begin_write()?;
        txn.open_table(PEERS)?;
        txn.open_table(PROGRESS)?;
        txn.delete_table(LEGACY_CHECKPOINTS)?;
        txn.commit()?;
        Ok(Store { db })
    }

    /// Adds or refreshes a peer in the peer book: at most [`MAX_BOOK_ADDRS`] of its addresses
    /// (long ones left out), and at most [`MAX_BOOK_PEERS`] peers, forgetting the one seen
    /// longest ago.
    pub fn remember_peer(&self, peer_id: &str, addrs: &[String]) -> Result<()> {
        let entry = KnownPeer {
            peer_id: peer_id.to_owned(),
            addrs: addrs
                .iter()
                .filter(|a| a.len() <= MAX_BOOK_ADDR_LEN)
                .take(MAX_BOOK_ADDRS)
                .cloned()
                .collect(),
            last_seen_unix: now_unix(),
        };
        let json = serde_json::to_string(&entry)?;
        let txn = self.db.begin_write()?;
        {
            let mut table = txn.open_table(PEERS)?;
            table.insert(peer_id, json.as_str())?;
            while table.len()? > MAX_BOOK_PEERS as u64 {
                let mut oldest: Option<(u64, String)> = None;
                for row in table.iter()? {
                    let (id, value) = row?;
                    // A damaged entry goes first.
                    let seen = serde_json::from_str::<KnownPeer>(value.value())
                        .map_or(0, |p| p.last_seen_unix);
                    if id.value() != peer_id && oldest.as_ref().is_none_or(|(s, _)| seen < *s) {
                        oldest = Some((seen, id.value().to_owned()));
                    }
                }
                let Some((_, id)) = oldest else { break };
                table.remove(id.as_str())?;
            }
        }
        txn.commit()?;
        Ok(())
    }

    pub fn known_peers(&self) -> Result<Vec<KnownPeer>> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(PEERS)?;
        let mut peers = Vec::new();
        for entry in table.iter()? {
            let (_, value) = entry?;
            // A damaged entry is skipped, not fatal: the peer book is a cache.
            if let Ok(peer) = serde_json::from_str(value.value()) {
                peers.push(peer);
            }
        }
        Ok(peers)
    }

    pub fn set_progress(&self, run_id: &str, step: u64, epoch: u64) -> Result<()> {
        let json = serde_json::to_string(&RunProgress {
            step,
            epoch,
            updated_unix: now_unix(),
        })?;
        let txn = self.db.begin_write()?;
        txn.open_table(PROGRESS)?.insert(run_id, json.as_str())?;
        txn.commit()?;
        Ok(())
    }

    pub fn progress(&self, run_id: &str) -> Result<Option<RunProgress>> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(PROGRESS)?;
        let value = table.get(run_id)?;
        Ok(value.and_then(|v| serde_json::from_str(v.value()).ok()))
    }
}

/// Saves the elastic center `params` of `model`, at the replica's `step` and `epoch`, to `path`
/// (`DataDir::center_path`): a safetensors file in the checkpoints' format, with no optimizer
/// state, that `nodectl evaluate` reads beside a node's checkpoints.
pub fn save_center(
    path: &Path,
    model: &ModelDescription,
    step: u64,
    epoch: u64,
    params: Vec<f32>,
) -> Result<()> {
    let center = Checkpoint {
        step,
        epoch,
        // A center resumes no trainer: it is read by its tensors' names and the fingerprint.
        config_hash: String::new(),
        fingerprint: model.fingerprint(),
        params,
        optimizer_state: Vec::new(),
        optimizer_state_names: Vec::new(),
        optimizer_updates: 0,
    };
    let bytes = center
        .to_bytes(&model.layout())
        .with_context(|| format!("cannot encode the elastic center for `{}`", path.display()))?;
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).with_context(|| format!("cannot create `{}`", dir.display()))?;
    }
    write_atomic(path, &bytes, 0o644)
}

#[cfg(test)]
mod tests {
    use redb::TableHandle;

    use super::*;

    #[test]
    fn init_creates_a_private_key_once_and_keeps_the_peer_id() {
        let dir = tempfile::tempdir().unwrap();
        let data = DataDir::new(dir.path().join("node"));
        let (key, created) = data.init().unwrap();
        assert!(created);
        let mode = fs::metadata(data.identity_path())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let (again, created) = data.init().unwrap();
        assert!(!created);
        assert_eq!(key.public().to_peer_id(), again.public().to_peer_id());

        fs::set_permissions(data.identity_path(), fs::Permissions::from_mode(0o644)).unwrap();
        let err = format!("{:#}", data.identity().unwrap_err());
        assert!(err.contains("chmod 600"), "{err}");
    }

    #[test]
    fn atomic_writes_replace_whole_files_and_new_ones_never_overwrite() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        // A temporary file left by a crash, with a mode too open, is not reused.
        let stale = dir
            .path()
            .join(format!(".secret.{}.tmp", std::process::id()));
        fs::write(&stale, b"stale").unwrap();
        fs::set_permissions(&stale, fs::Permissions::from_mode(0o644)).unwrap();
        assert!(write_new(&path, b"first", 0o600).unwrap());
        assert!(!write_new(&path, b"second", 0o600).unwrap());
        assert_eq!(fs::read(&path).unwrap(), b"first");
        write_atomic(&path, b"third", 0o600).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"third");
        let mode = fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["secret"], "no temporary file is left behind");
    }

    #[test]
    fn missing_identity_says_to_init() {
        let dir = tempfile::tempdir().unwrap();
        let err = format!("{:#}", DataDir::new(dir.path()).identity().unwrap_err());
        assert!(err.contains("nodectl init"), "{err}");
    }

    #[test]
    fn the_peer_book_keeps_a_bounded_number_of_peers_and_addresses() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("murmur.redb")).unwrap();
        let many: Vec<String> = (0..50).map(|i| format!("/ip4/10.0.0.{i}/tcp/1")).collect();
        let long = format!("/dns4/{}/tcp/1", "a".repeat(300));
        store
            .remember_peer("first", &[long, many[0].clone()])
            .unwrap();
        assert_eq!(store.known_peers().unwrap()[0].addrs, [many[0].clone()]);
        for i in 0..MAX_BOOK_PEERS + 20 {
            store.remember_peer(&format!("peer-{i:04}"), &many).unwrap();
        }
        let peers = store.known_peers().unwrap();
        assert_eq!(peers.len(), MAX_BOOK_PEERS);
        assert!(peers.iter().all(|p| p.addrs.len() == MAX_BOOK_ADDRS));
        // The newest is always kept.
        let newest = format!("peer-{:04}", MAX_BOOK_PEERS + 19);
        assert!(peers.iter().any(|p| p.peer_id == newest));
    }

    #[test]
    fn store_keeps_peers_progress_and_checkpoints_across_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("murmur.redb");
        {
            let store = Store::open(&path).unwrap();
            store
                .remember_peer("12D3KooA", &["/ip4/127.0.0.1/tcp/4001".into()])
                .unwrap();
            store.set_progress("run-1", 938, 1).unwrap();
        }
        let store = Store::open(&path).unwrap();
        let peers = store.known_peers().unwrap();
        assert_eq!(peers.len(), 1);
        assert_eq!(peers[0].addrs, ["/ip4/127.0.0.1/tcp/4001"]);
        assert_eq!(store.progress("run-1").unwrap().unwrap().step, 938);
        assert!(store.progress("run-2").unwrap().is_none());
    }

    /// Earlier versions recorded every checkpoint in the store, and the table grew for as long
    /// as a node ran; opening such a store drops it.
    #[test]
    fn a_store_with_the_old_checkpoint_table_drops_it_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("murmur.redb");
        {
            let db = Database::create(&path).unwrap();
            let txn = db.begin_write().unwrap();
            {
                let mut table = txn.open_table(LEGACY_CHECKPOINTS).unwrap();
                for step in 0..1000u64 {
                    table
                        .insert(step, "checkpoints/step-N.safetensors")
                        .unwrap();
                }
            }
            txn.commit().unwrap();
        }
        let store = Store::open(&path).unwrap();
        store.set_progress("run-1", 1, 0).unwrap();
        let txn = store.db.begin_read().unwrap();
        let tables: Vec<String> = txn
            .list_tables()
            .unwrap()
            .map(|t| t.name().to_owned())
            .collect();
        assert!(!tables.contains(&"checkpoints".to_owned()), "{tables:?}");
    }
}
