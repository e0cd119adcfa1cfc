//! docs/configuration.md against the code: every key it documents exists, and every key the
//! config types accept is documented.
//!
//! The code's keys come from the config types themselves: each section refuses unknown keys,
//! and serde's error for an unknown key lists every key the section accepts.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

use std::collections::BTreeSet;
use std::path::Path;

use murmur_daemon::config::{NodeConfig, RunConfig};

/// The smallest valid run config; each section's keys are probed by adding an unknown one.
const MINIMAL_RUN: &str = "[run]\nname = \"docs\"\n[model]\nkind = \"mlp\"\n\
                           [optimizer]\nkind = \"sgd\"\nlr = 0.1\n\
                           [training]\nepochs = 1\nbatch_size = 8\n";

const RUN_SECTIONS: [&str; 9] = [
    "run",
    "model",
    "optimizer",
    "training",
    "data",
    "checkpoint",
    "sync",
    "sync.elastic",
    "sync.allreduce",
];

/// The keys an error for an unknown key says are expected: the backquoted words after
/// "expected".
fn expected_keys(error: &str) -> Vec<String> {
    let (_, list) = error
        .split_once("expected")
        .unwrap_or_else(|| panic!("not an unknown-key error: {error}"));
    list.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// `text` with an unknown key added to the table at `path` (created if absent).
fn with_unknown_key(text: &str, path: &str) -> String {
    let mut doc: toml_edit::DocumentMut = text.parse().unwrap();
    let mut table = doc.as_table_mut();
    for part in path.split('.') {
        table = table
            .entry(part)
            .or_insert(toml_edit::table())
            .as_table_mut()
            .unwrap();
    }
    table.insert("zzz_not_a_key", toml_edit::value(1));
    doc.to_string()
}

/// Every `section.key` the code accepts; a key that is itself a table is left to its section.
fn code_keys() -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    for section in RUN_SECTIONS {
        let text = with_unknown_key(MINIMAL_RUN, section);
        let error = format!(
            "{:#}",
            RunConfig::parse(Path::new("docs.toml"), &text).unwrap_err()
        );
        for key in expected_keys(&error) {
            if !RUN_SECTIONS.contains(&format!("{section}.{key}").as_str()) {
                keys.insert(format!("{section}.{key}"));
            }
        }
    }
    const NODE_SECTIONS: [&str; 4] = ["trust", "telemetry", "relay_limits", "memory"];
    for table in std::iter::once("").chain(NODE_SECTIONS) {
        let prefix = if table.is_empty() {
            String::new()
        } else {
            format!("{table}.")
        };
        let text = if table.is_empty() {
            "zzz_not_a_key = 1\n".to_owned()
        } else {
            with_unknown_key("", table)
        };
        let error = toml::from_str::<NodeConfig>(&text).unwrap_err().to_string();
        for key in expected_keys(&error) {
            if !NODE_SECTIONS.contains(&key.as_str()) {
                keys.insert(format!("node.{prefix}{key}"));
            }
        }
    }
    keys
}

/// Every key in the tables of docs/configuration.md, as `section.key` (node settings as
/// `node.key`).
fn documented_keys() -> BTreeSet<String> {
    let docs = include_str!("../../docs/configuration.md");
    let mut section = String::new();
    let mut keys = BTreeSet::new();
    for line in docs.lines() {
        if line.starts_with("# Node settings") {
            section = "node".into();
        } else if let Some(name) = line
            .strip_prefix("## `[")
            .or_else(|| line.strip_prefix("`["))
            .and_then(|rest| rest.split_once("]`"))
            .map(|(name, _)| name)
        {
            section = name.to_owned();
        } else if let Some(key) = line
            .strip_prefix("| `")
            .and_then(|rest| rest.split_once("` |"))
            .map(|(key, _)| key)
        {
            keys.insert(format!("{section}.{key}"));
        }
    }
    keys
}

#[test]
fn every_documented_key_exists_and_every_key_is_documented() {
    let (code, docs) = (code_keys(), documented_keys());
    // The probe must have found the sections, or the comparison below proves nothing.
    assert!(code.contains("sync.allreduce.plane"), "{code:?}");
    assert!(code.contains("node.trust.allowlist"), "{code:?}");
    let undocumented: Vec<_> = code.difference(&docs).collect();
    let unknown: Vec<_> = docs.difference(&code).collect();
    assert!(
        undocumented.is_empty(),
        "keys missing from docs/configuration.md: {undocumented:?}"
    );
    assert!(
        unknown.is_empty(),
        "docs/configuration.md documents keys the code does not have: {unknown:?}"
    );
}
