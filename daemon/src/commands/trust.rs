//! `nodectl trust add|rm|ls`: the `[trust] peers` list of the node config, edited in place so
//! that the operator's comments and other settings survive.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use anyhow::{Context, Result, bail};
use murmur_protocol::network::PeerId;
use serde_json::json;
use toml_edit::{Array, DocumentMut, Item, Table, value};

use crate::cli::DataDirArgs;
use crate::config::NodeConfig;
use crate::store;

fn parse_peer(text: &str) -> Result<PeerId> {
    text.parse().map_err(|e| {
        anyhow::anyhow!("`{text}` is not a peer id ({e}); `nodectl id` on that machine prints it")
    })
}

/// The node config as an editable document (the template when there is none yet).
fn load(path: &Path) -> Result<DocumentMut> {
    if path.parent().is_some_and(|dir| !dir.is_dir()) {
        bail!(
            "no node data dir at {}: run `nodectl init` (with the same --data-dir) first",
            path.parent()
                .map_or_else(Default::default, |d| d.display().to_string())
        );
    }
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => NodeConfig::TEMPLATE.to_owned(),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    text.parse()
        .with_context(|| format!("{} is not valid TOML; fix it by hand first", path.display()))
}

/// The `[trust] peers` array, created if missing.
fn peers_mut(doc: &mut DocumentMut) -> Result<&mut Array> {
    let trust = doc
        .entry("trust")
        .or_insert_with(|| Item::Table(Table::new()))
        .as_table_mut()
        .context("`trust` in the node config must be a table: [trust]")?;
    trust
        .entry("peers")
        .or_insert_with(|| value(Array::new()))
        .as_array_mut()
        .context("`[trust] peers` in the node config must be a list of peer ids")
}

/// Writes `doc` after checking that it still parses as a node config.
fn save(path: &Path, doc: &DocumentMut) -> Result<()> {
    let text = doc.to_string();
    toml::from_str::<NodeConfig>(&text)
        .with_context(|| format!("the edited {} would not load", path.display()))?;
    // Written whole or not at all: a crash must not leave a config without its allowlist.
    let mode = std::fs::metadata(path).map_or(0o644, |m| m.permissions().mode() & 0o777);
    store::write_atomic(path, text.as_bytes(), mode)
}

fn listed(peers: &Array, peer: &PeerId) -> Option<usize> {
    let wanted = peer.to_string();
    peers
        .iter()
        .position(|v| v.as_str() == Some(wanted.as_str()))
}

pub(super) fn add(peer_id: &str, node: &DataDirArgs) -> Result<()> {
    let peer = parse_peer(peer_id)?;
    let path = node.data_dir().node_config_path();
    let mut doc = load(&path)?;
    let peers = peers_mut(&mut doc)?;
    let added = listed(peers, &peer).is_none();
    if added {
        peers.push(peer.to_string());
        save(&path, &doc)?;
    }
    report(node.json, "add", &peer, added, &path);
    Ok(())
}

pub(super) fn remove(peer_id: &str, node: &DataDirArgs) -> Result<()> {
    let peer = parse_peer(peer_id)?;
    let path = node.data_dir().node_config_path();
    let mut doc = load(&path)?;
    let peers = peers_mut(&mut doc)?;
    let Some(at) = listed(peers, &peer) else {
        bail!("{peer} is not in the trust list of {}", path.display());
    };
    peers.remove(at);
    let allowlist_left_empty = peers.is_empty()
        && doc
            .get("trust")
            .and_then(|t| t.get("allowlist"))
            .and_then(Item::as_bool)
            == Some(true);
    if allowlist_left_empty {
        bail!(
            "{peer} is the last trusted peer and [trust] allowlist = true: with an empty list the \
             node would refuse everyone; set allowlist = false first"
        );
    }
    save(&path, &doc)?;
    report(node.json, "rm", &peer, true, &path);
    Ok(())
}

fn report(json: bool, action: &str, peer: &PeerId, changed: bool, path: &Path) {
    if json {
        println!(
            "{}",
            json!({"action": action, "peer_id": peer.to_string(), "changed": changed, "config": path})
        );
    } else if !changed {
        println!("{peer} was already trusted ({})", path.display());
    } else if action == "add" {
        println!(
            "trusted {peer} ({}); restart the daemon to apply",
            path.display()
        );
    } else {
        println!(
            "no longer trusting {peer} ({}); restart the daemon to apply",
            path.display()
        );
    }
}

pub(super) fn list(node: &DataDirArgs) -> Result<()> {
    let path = node.data_dir().node_config_path();
    let config = NodeConfig::load(&path)?;
    let peers = config.trust.peer_ids()?;
    if node.json {
        let ids: Vec<String> = peers.iter().map(ToString::to_string).collect();
        println!(
            "{}",
            json!({"peers": ids, "allowlist": config.trust.allowlist, "config": path})
        );
        return Ok(());
    }
    if peers.is_empty() {
        println!(
            "no trusted peers ({}); add one with `nodectl trust add <peer-id>`",
            path.display()
        );
    }
    for peer in &peers {
        println!("{peer}");
    }
    let allowlist = if config.trust.allowlist {
        "on: every other peer is refused at connection time"
    } else {
        "off"
    };
    println!("allowlist {allowlist}");
    Ok(())
}
