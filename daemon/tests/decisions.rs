//! The decision records as a specification (`docs/decisions/`): the index lists every record
//! with its status, and every citation of a record in the code, the docs, the configs and the
//! scripts ("decision 0039", "decisions 0030 and 0035", a link to `decisions/0018-....md`)
//! names a record that exists and is not superseded whole. A failure names the file and line.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

fn decisions_dir() -> PathBuf {
    root().join("docs/decisions")
}

/// The records on disk: number to file name.
fn records() -> BTreeMap<u32, String> {
    let mut records = BTreeMap::new();
    for entry in fs::read_dir(decisions_dir()).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if let Some(number) = record_number(&name) {
            let earlier = records.insert(number, name.clone());
            assert!(
                earlier.is_none(),
                "two records numbered {number:04}: {name}"
            );
        }
    }
    records
}

/// `0018` of `0018-actors-and-a-sans-io-engine.md`.
fn record_number(file_name: &str) -> Option<u32> {
    let (digits, rest) = file_name.split_at_checked(4)?;
    let is_record = digits.bytes().all(|b| b.is_ascii_digit())
        && rest.starts_with('-')
        && rest.ends_with(".md");
    is_record.then(|| digits.parse().unwrap())
}

/// The index's status of each record it lists: the third cell of its row.
fn index() -> BTreeMap<u32, String> {
    let text = fs::read_to_string(decisions_dir().join("README.md")).unwrap();
    let mut rows = BTreeMap::new();
    for line in text.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // | [NNNN](NNNN-slug.md) | decision | status |
        let [_, record, _, status, _] = cells[..] else {
            continue;
        };
        let Some(link) = record.strip_prefix('[') else {
            continue;
        };
        let (number, target) = link.split_once("](").unwrap();
        let target = target.trim_end_matches(')');
        let number: u32 = number.parse().unwrap();
        assert_eq!(
            record_number(target),
            Some(number),
            "docs/decisions/README.md: the row of {number:04} links {target}"
        );
        assert!(
            decisions_dir().join(target).is_file(),
            "docs/decisions/README.md: the row of {number:04} links {target}, which is not there"
        );
        rows.insert(number, status.to_owned());
    }
    rows
}

/// The numbers cited on `line`: after "decision" or "decisions" (any case), a list of
/// four-digit numbers joined by commas, "and", "or" or slashes; and the number of every
/// `decisions/NNNN-` path.
fn citations(line: &str) -> Vec<u32> {
    let lower = line.to_lowercase();
    let mut found = Vec::new();
    let mut rest = lower.as_str();
    while let Some(at) = rest.find("decision") {
        rest = &rest[at + "decision".len()..];
        if let Some(path) = rest.strip_prefix("s/") {
            found.extend(leading_number(path));
            continue;
        }
        let mut list = rest.strip_prefix('s').unwrap_or(rest);
        loop {
            let trimmed = list.trim_start_matches([' ', ',', '/']);
            let trimmed = ["and ", "or "]
                .iter()
                .find_map(|word| trimmed.strip_prefix(word))
                .unwrap_or(trimmed);
            match leading_number(trimmed) {
                Some(number) => {
                    found.push(number);
                    list = &trimmed[4..];
                }
                None => break,
            }
        }
    }
    found
}

/// A four-digit number at the start of `text`, not followed by another digit.
fn leading_number(text: &str) -> Option<u32> {
    let bytes = text.as_bytes();
    let digits = bytes.len() >= 4 && bytes[..4].iter().all(u8::is_ascii_digit);
    let ends = bytes.get(4).is_none_or(|b| !b.is_ascii_digit());
    (digits && ends).then(|| text[..4].parse().unwrap())
}

/// The project's own text files: sources, docs, configs, scripts.
fn text_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            // Build outputs, vendored crates (their own texts), the testnet's runs.
            let skip = ["target", "vendor", "node_modules", "run"];
            if !name.starts_with('.') && !skip.contains(&name.as_str()) {
                text_files(&path, out);
            }
        } else if ["rs", "md", "toml", "py", "sh", "pyi"]
            .iter()
            .any(|ext| name.ends_with(&format!(".{ext}")))
        {
            out.push(path);
        }
    }
}

#[test]
fn the_index_lists_every_record_with_its_status() {
    let records = records();
    let index = index();
    let unlisted: Vec<&String> = (records.iter())
        .filter(|(number, _)| !index.contains_key(number))
        .map(|(_, name)| name)
        .collect();
    assert!(
        unlisted.is_empty(),
        "records missing from docs/decisions/README.md (add a row with the status): {unlisted:?}"
    );
    for (number, status) in &index {
        assert!(
            ["accepted", "amended", "partly superseded", "superseded"]
                .iter()
                .any(|s| status.starts_with(s)),
            "docs/decisions/README.md: the status of {number:04} is {status:?}; it is one of \
             accepted, amended ..., partly superseded by ..., superseded by ..."
        );
    }
}

#[test]
fn every_cited_record_exists_and_still_holds() {
    let records = records();
    let index = index();
    let mut files = Vec::new();
    text_files(&root(), &mut files);
    let mut wrong = Vec::new();
    let mut cited = 0;
    for file in &files {
        let Ok(text) = fs::read_to_string(file) else {
            continue;
        };
        let shown = file.strip_prefix(root()).unwrap().display().to_string();
        for (at, line) in text.lines().enumerate() {
            for number in citations(line) {
                cited += 1;
                let status = index.get(&number).map(String::as_str).unwrap_or("");
                if !records.contains_key(&number) {
                    wrong.push(format!(
                        "{shown}:{}: decision {number:04} does not exist",
                        at + 1
                    ));
                } else if status.starts_with("superseded") && !shown.starts_with("docs/decisions/")
                {
                    wrong.push(format!(
                        "{shown}:{}: decision {number:04} is {status}; cite the record that holds",
                        at + 1
                    ));
                }
            }
        }
    }
    // The scan finds the citations there are: a scanner that found none would pass anything.
    assert!(cited > 100, "only {cited} citations found");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn citations_are_read_in_every_form_the_docs_use() {
    assert_eq!(citations("(decision 0039)"), [39]);
    assert_eq!(citations("Decisions 0030, 0035 and 0041 say"), [30, 35, 41]);
    assert_eq!(citations("decisions 0021/0029"), [21, 29]);
    assert_eq!(
        citations("see [decision 0018](decisions/0018-actors.md)"),
        [18, 18]
    );
    assert_eq!(
        citations("a decision 12345 is no record"),
        Vec::<u32>::new()
    );
    assert_eq!(citations("decision-making"), Vec::<u32>::new());
}
