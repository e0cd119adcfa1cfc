//! The daemon's layers (see `src/lib.rs`): every `crate::` and `super::` path in `src/` is read,
//! and an import that points to a higher layer, a cycle between modules, or one actor of the
//! running node reaching into another fails the test with the file and the path. And the rule
//! between the workspace's crates: which may depend on which, and that the sync crate does no I/O.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The layer of a module (its path without `crate::`), or `None` for a module this test does
/// not know: a new module must be given a layer here.
fn layer(module: &[&str]) -> Option<u8> {
    match module {
        [] => Some(4),
        [
            "allocator" | "cli" | "clock" | "config" | "model" | "settings" | "store" | "events"
            | "report",
            ..,
        ] => Some(0),
        ["api"] | ["api", "types", ..] => Some(0),
        ["api", "client", ..] | ["readout", ..] | ["device", ..] => Some(1),
        ["api", "server", ..] | ["metrics", ..] | ["telemetry", ..] => Some(2),
        ["node", ..] | ["sim", ..] => Some(3),
        ["commands", ..] => Some(4),
        _ => None,
    }
}

/// The unit a module belongs to in the dependency graph: the top-level module, except that the
/// API's parts and the node's actors are units of their own, and the replica's driver is one
/// apart from the trainer contract it drives (which every actor may use).
fn unit(module: &[&str]) -> String {
    match module {
        ["node", "replica", "driver", ..] => "node::replica::driver".to_owned(),
        ["api", part, ..] | ["node", part, ..] => format!("{}::{part}", module[0]),
        [top, ..] => (*top).to_owned(),
        [] => "crate".to_owned(),
    }
}

/// The node's actors: each may use the node's messages, the trainer contract and its own
/// submodules, and nothing of another actor.
const ACTORS: [&str; 3] = ["node::engine", "node::peers", "node::replica::driver"];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a source file: `src/node/engine.rs` is `node::engine`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let relative = file.strip_prefix(src).unwrap().with_extension("");
    let parts: Vec<String> = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    match parts.as_slice() {
        [only] if only == "lib" => Vec::new(),
        _ => parts,
    }
}

/// Every module path a line names with `crate::` or `super::`, braces expanded one level
/// (`use crate::{events, metrics}` names both), resolved against `module`.
fn paths_in(line: &str, module: &[String]) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    for (prefix, base) in [
        ("crate::", Vec::new()),
        ("super::", module[..module.len().saturating_sub(1)].to_vec()),
    ] {
        let mut rest = line;
        while let Some(at) = rest.find(prefix) {
            // `super::super::x` and `crate::` inside a longer name are not paths of their own.
            let before = &rest[..at];
            rest = &rest[at + prefix.len()..];
            if before.ends_with("::") || before.ends_with(|c: char| c.is_alphanumeric()) {
                continue;
            }
            let mut base = base.clone();
            while let Some(deeper) = rest.strip_prefix("super::") {
                base.pop();
                rest = deeper;
            }
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(rest.len());
            let path: Vec<String> = rest[..end]
                .split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect();
            let mut full = base.clone();
            full.extend(path);
            if rest[end..].starts_with('{') {
                let inner = &rest[end + 1..rest[end..].find('}').map_or(rest.len(), |i| end + i)];
                for item in inner.split(',') {
                    let head: Vec<String> = item
                        .trim()
                        .split(" as ")
                        .next()
                        .unwrap_or("")
                        .split("::")
                        .filter(|s| !s.is_empty() && *s != "self")
                        .map(str::to_owned)
                        .collect();
                    let mut item_path = full.clone();
                    item_path.extend(head);
                    found.push(item_path);
                }
            } else {
                found.push(full);
            }
        }
    }
    found
}

/// The module part of a path: the longest prefix whose segments are module names (lower case),
/// so `crate::readout::NodeState` is `readout`.
fn module_part(path: &[String]) -> Vec<&str> {
    path.iter()
        .map(String::as_str)
        .take_while(|s| s.chars().next().is_some_and(|c| c.is_lowercase()))
        .collect()
}

#[test]
fn every_import_points_down_and_modules_form_no_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut problems = Vec::new();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        if file.ends_with("main.rs") {
            continue; // the binary uses the library by its name, not `crate::`
        }
        // A unit test module in a file of its own (`mod tests;` under `#[cfg(test)]`): unit
        // tests may reach anything.
        let test_module = file
            .strip_prefix(&src)
            .unwrap()
            .components()
            .any(|c| c.as_os_str() == "tests" || c.as_os_str() == "tests.rs");
        if test_module {
            continue;
        }
        let module = module_of(&src, file);
        let here: Vec<&str> = module.iter().map(String::as_str).collect();
        let Some(own_layer) = layer(&here) else {
            problems.push(format!(
                "{}: module `{}` has no layer in tests/layers.rs",
                file.display(),
                here.join("::")
            ));
            continue;
        };
        let text = fs::read_to_string(file).unwrap();
        let mut in_tests = false;
        for (number, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            // Unit tests may reach anything; they are not part of the layering.
            if code.starts_with("#[cfg(test)]") {
                in_tests = true;
            }
            if in_tests {
                continue;
            }
            for path in paths_in(code, &module) {
                let target = module_part(&path);
                // A module may use its own submodules.
                if target.starts_with(&here) {
                    continue;
                }
                let at = format!("{}:{}", file.display(), number + 1);
                let Some(target_layer) = layer(&target) else {
                    problems.push(format!("{at}: `{}` has no layer", target.join("::")));
                    continue;
                };
                if target_layer > own_layer {
                    problems.push(format!(
                        "{at}: `{}` (layer {own_layer}) imports `{}` (layer {target_layer}), a higher layer",
                        here.join("::"),
                        target.join("::")
                    ));
                }
                let (from, to) = (unit(&here), unit(&target));
                if from != to && ACTORS.contains(&from.as_str()) && ACTORS.contains(&to.as_str()) {
                    problems.push(format!(
                        "{at}: the actor `{from}` uses `{to}`; actors share only `node::messages`, the trainer contract (`node::replica`) and the read side"
                    ));
                }
                if from != to {
                    graph.entry(from).or_default().insert(to);
                }
            }
        }
    }
    // A cycle: a unit that reaches itself.
    for start in graph.keys() {
        let mut stack: Vec<(String, Vec<String>)> = vec![(start.clone(), vec![start.clone()])];
        let mut seen = BTreeSet::new();
        while let Some((unit, trail)) = stack.pop() {
            for next in graph.get(&unit).into_iter().flatten() {
                if next == start {
                    problems.push(format!("import cycle: {} -> {start}", trail.join(" -> ")));
                } else if seen.insert(next.clone()) {
                    let mut longer = trail.clone();
                    longer.push(next.clone());
                    stack.push((next.clone(), longer));
                }
            }
        }
    }
    problems.sort();
    problems.dedup();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The node runs any trainer through the contract (decision 0070): Murmur's own trainer is one
/// adapter, `node/replica/native.rs` (with its tests, `native/`), and no other file of the
/// node names its crate.
#[test]
fn only_the_native_adapter_of_the_node_names_the_trainer_crate() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![src.join("node.rs")];
    rust_files(&src.join("node"), &mut files);
    let adapter = src.join("node/replica/native.rs");
    let mut naming: Vec<String> = files
        .iter()
        .filter(|file| **file != adapter && !file.starts_with(adapter.with_extension("")))
        .filter(|file| fs::read_to_string(file).unwrap().contains("murmur_trainer"))
        .map(|file| file.strip_prefix(&src).unwrap().display().to_string())
        .collect();
    naming.sort();
    assert!(
        naming.is_empty(),
        "these files of the node name `murmur_trainer`: {naming:?}; go through the trainer \
         contract (`node::replica::Replica`) instead"
    );
    assert!(
        fs::read_to_string(&adapter)
            .unwrap()
            .contains("murmur_trainer"),
        "the native adapter moved: update this test"
    );
}

/// The dependency rule between Murmur's crates (decision 0073): `protocol` and `trainer`
/// depend on none of the others; `sync` on the protocol's pure part only (not its `net`
/// feature, not tokio, not the trainer); the daemon on all three.
#[test]
fn the_crates_depend_on_each_other_by_the_rule() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let dependencies = |krate: &str| -> toml::Table {
        let manifest = fs::read_to_string(root.join(krate).join("Cargo.toml")).unwrap();
        let manifest: toml::Table = manifest.parse().unwrap();
        manifest
            .get("dependencies")
            .and_then(toml::Value::as_table)
            .cloned()
            .unwrap_or_default()
    };
    let ours = |table: &toml::Table| -> BTreeSet<String> {
        table
            .keys()
            .filter(|name| name.starts_with("murmur-"))
            .cloned()
            .collect()
    };
    let allowed: [(&str, &[&str]); 4] = [
        ("protocol", &[]),
        ("trainer", &[]),
        ("sync", &["murmur-protocol"]),
        (
            "daemon",
            &["murmur-protocol", "murmur-sync", "murmur-trainer"],
        ),
    ];
    for (krate, may) in allowed {
        let found = ours(&dependencies(krate));
        let may: BTreeSet<String> = may.iter().map(|s| (*s).to_owned()).collect();
        assert!(
            found.is_subset(&may),
            "{krate}/Cargo.toml depends on {:?}, which the rule does not allow (it may use \
             {may:?})",
            found.difference(&may).collect::<Vec<_>>()
        );
    }
    let sync = dependencies("sync");
    let protocol_features = sync["murmur-protocol"]
        .get("features")
        .and_then(toml::Value::as_array)
        .cloned()
        .unwrap_or_default();
    assert!(
        protocol_features.is_empty(),
        "sync/Cargo.toml enables {protocol_features:?} of murmur-protocol: the sync crate uses \
         the protocol's pure part only"
    );
    for io in ["tokio", "libp2p", "libp2p-stream", "tokio-util"] {
        assert!(
            !sync.contains_key(io),
            "sync/Cargo.toml depends on `{io}`: the sync crate does no I/O"
        );
    }
}

/// The sync crate takes the time as an input: outside its tests, none of its code reads a
/// clock, a file, a socket or spawns a thread.
#[test]
fn the_sync_crate_reads_no_clock_and_does_no_io() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .join("sync/src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut found = Vec::new();
    for file in files {
        let is_test = file.components().any(|c| c.as_os_str() == "tests")
            || file.file_name().is_some_and(|n| n == "tests.rs");
        if is_test {
            continue;
        }
        let text = fs::read_to_string(&file).unwrap();
        // Test modules sit at the end of a file.
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        let name = file.strip_prefix(&src).unwrap().display().to_string();
        for (at, line) in code.lines().enumerate() {
            // The simulator's virtual clock starts at a real `Instant` (it has no other
            // constructor); only the virtual time since then is ever read.
            if name == "sim.rs" && line.trim() == "let t0 = Instant::now();" {
                continue;
            }
            for io in [
                "Instant::now(",
                "SystemTime::now(",
                "std::fs",
                "std::thread",
                "tokio",
                "TcpStream",
            ] {
                if line.contains(io) && !line.trim_start().starts_with("//") {
                    found.push(format!("{name}:{}: {io}", at + 1));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "the sync crate does I/O or reads a clock: {found:?}; take the time or the data as an \
         input instead"
    );
}

#[test]
fn the_path_reader_resolves_groups_renames_and_super() {
    let module: Vec<String> = ["node", "engine", "ring"].map(str::to_owned).into();
    let names = |line: &str| -> Vec<String> {
        paths_in(line, &module)
            .iter()
            .map(|p| p.join("::"))
            .collect()
    };
    assert_eq!(
        names("use crate::{events, metrics::Format};"),
        ["events", "metrics::Format"]
    );
    assert_eq!(names("use crate::api::server as api;"), ["api::server"]);
    assert_eq!(
        names("use super::{Engine, within};"),
        ["node::engine::Engine", "node::engine::within"]
    );
    assert_eq!(
        names("use super::super::messages::Snapshot;"),
        ["node::messages::Snapshot"]
    );
    assert_eq!(
        names("let x = crate::readout::unix_now();"),
        ["readout::unix_now"]
    );
    assert!(names("let s = \"no path\";").is_empty());
    assert_eq!(layer(&["api", "server"]), Some(2));
    assert_eq!(layer(&["unknown"]), None);
}
