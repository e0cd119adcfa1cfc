//! Splitting a dataset into one shard per peer, and writing the shards with a manifest.
//!
//! A shard directory holds a training split in IDX format, so a peer loads it exactly like a
//! full dataset, plus `shard.json` ([`ShardInfo`]): which shard of how large a set it is, so
//! that a shard copied to another machine still knows the swarm's epoch length. The manifest
//! records, for every shard, how many samples of each label it got.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use rand::SeedableRng;
use rand::rngs::ChaCha8Rng;
use rand::seq::SliceRandom;
use rand_distr::Distribution;
use rand_distr::multi::Dirichlet;
use serde::{Deserialize, Serialize};

use super::Dataset;
use super::text::{self, Corpus, DEFAULT_VALIDATION_SHARE, TextPartition, TokenRange};
use crate::model::CLASSES;

/// How samples are dealt to peers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Partition {
    /// Uniformly at random; shard sizes differ by at most one.
    Iid,
    /// For each label, the peers' shares are drawn from Dirichlet(alpha): small alpha, skewed.
    Dirichlet { alpha: f64 },
    /// Each peer gets `per_peer` labels and the samples of a label are split among its holders.
    Labels { per_peer: usize },
}

/// Why shards could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShardError {
    #[error(
        "unknown partition `{0}`: use `iid`, `dirichlet:ALPHA` (e.g. dirichlet:0.5) or \
         `labels:K` (e.g. labels:2)"
    )]
    UnknownPartition(String),
    #[error("partition `{spec}`: {problem}")]
    BadPartition { spec: String, problem: String },
    #[error("cannot make shards for 0 peers: pass `--peers 1` or more")]
    NoPeers,
    #[error(
        "cannot split {samples} samples into {peers} shards: every shard needs at least one \
         sample, so use `--peers {samples}` or fewer"
    )]
    TooManyShards { peers: usize, samples: usize },
    #[error("unknown text partition `{0}`: use `iid` (blocks of every document) or `documents`")]
    UnknownTextPartition(String),
    #[error(
        "cannot deal {pieces} {what} to {peers} peers: every peer needs at least one, so use \
         `--peers {pieces}` or fewer"
    )]
    TooFewPieces {
        peers: usize,
        pieces: usize,
        what: &'static str,
    },
    #[error("`{partition}` left shard {shard} empty: use a larger ALPHA or K, or fewer peers")]
    EmptyShard { partition: String, shard: usize },
    #[error(
        "`{}` already holds shards (manifest.json): choose another `--out`, or pass `--force` \
         to replace them",
        dir.display()
    )]
    OutputExists { dir: PathBuf },
    #[error(
        "`{}` is not a valid shard description ({problem}): re-create the shards with \
         `nodectl shard`, or delete the file to use the shard on its own",
        path.display()
    )]
    BadInfo { path: PathBuf, problem: String },
    #[error("cannot access `{}`: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl FromStr for Partition {
    type Err = ShardError;

    fn from_str(s: &str) -> Result<Self, ShardError> {
        let bad = |problem: &str| ShardError::BadPartition {
            spec: s.to_owned(),
            problem: problem.to_owned(),
        };
        match s.split_once(':') {
            None if s == "iid" => Ok(Partition::Iid),
            Some(("dirichlet", alpha)) => match alpha.parse::<f64>() {
                Ok(alpha) if alpha.is_finite() && alpha > 0.0 => Ok(Partition::Dirichlet { alpha }),
                _ => Err(bad("ALPHA must be a positive number, e.g. dirichlet:0.5")),
            },
            Some(("labels", k)) => match k.parse::<usize>() {
                Ok(k) if (1..=CLASSES).contains(&k) => Ok(Partition::Labels { per_peer: k }),
                _ => Err(bad("K must be a whole number from 1 to 10, e.g. labels:2")),
            },
            _ => Err(ShardError::UnknownPartition(s.to_owned())),
        }
    }
}

impl fmt::Display for Partition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Partition::Iid => write!(f, "iid"),
            Partition::Dirichlet { alpha } => write!(f, "dirichlet:{alpha}"),
            Partition::Labels { per_peer } => write!(f, "labels:{per_peer}"),
        }
    }
}

/// Deals the samples with these `labels` to `peers` shards. Returns each shard's sample indices
/// in ascending order. Deterministic in `seed`.
pub fn assign(
    labels: &[u8],
    peers: usize,
    partition: Partition,
    seed: u64,
) -> Result<Vec<Vec<usize>>, ShardError> {
    if peers == 0 {
        return Err(ShardError::NoPeers);
    }
    if peers > labels.len() {
        return Err(ShardError::TooManyShards {
            peers,
            samples: labels.len(),
        });
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut by_label: Vec<Vec<usize>> = vec![Vec::new(); CLASSES];
    for (i, &l) in labels.iter().enumerate() {
        by_label[usize::from(l)].push(i);
    }
    for indices in &mut by_label {
        indices.shuffle(&mut rng);
    }
    let mut shards = match partition {
        Partition::Iid => {
            let mut all: Vec<usize> = (0..labels.len()).collect();
            all.shuffle(&mut rng);
            let mut shards = vec![Vec::new(); peers];
            for (k, i) in all.into_iter().enumerate() {
                shards[k % peers].push(i);
            }
            shards
        }
        Partition::Dirichlet { alpha } => dirichlet(&by_label, peers, alpha, &mut rng)?,
        Partition::Labels { per_peer } => {
            let mut holders: Vec<Vec<usize>> = vec![Vec::new(); CLASSES];
            for peer in 0..peers {
                for j in 0..per_peer {
                    holders[(peer * per_peer + j) % CLASSES].push(peer);
                }
            }
            let mut shards = vec![Vec::new(); peers];
            for (label, indices) in by_label.iter().enumerate() {
                let owners = &holders[label];
                for (k, &i) in indices.iter().enumerate() {
                    if !owners.is_empty() {
                        shards[owners[k * owners.len() / indices.len()]].push(i);
                    }
                }
            }
            shards
        }
    };
    if let Some(shard) = shards.iter().position(Vec::is_empty) {
        return Err(ShardError::EmptyShard {
            partition: partition.to_string(),
            shard,
        });
    }
    for shard in &mut shards {
        shard.sort_unstable();
    }
    Ok(shards)
}

/// Draws per-label shares until no shard is empty (small alpha with many peers can starve one).
fn dirichlet(
    by_label: &[Vec<usize>],
    peers: usize,
    alpha: f64,
    rng: &mut ChaCha8Rng,
) -> Result<Vec<Vec<usize>>, ShardError> {
    const ATTEMPTS: usize = 100;
    if peers == 1 {
        return Ok(vec![by_label.concat()]);
    }
    let dist = Dirichlet::new(&vec![alpha; peers]).map_err(|e| ShardError::BadPartition {
        spec: format!("dirichlet:{alpha}"),
        problem: e.to_string(),
    })?;
    let mut shards = vec![Vec::new(); peers];
    for _ in 0..ATTEMPTS {
        shards = vec![Vec::new(); peers];
        for indices in by_label {
            let shares: Vec<f64> = dist.sample(rng);
            let mut cumulative = 0.0;
            let mut start = 0;
            for (peer, share) in shares.iter().enumerate() {
                cumulative += share;
                let end = if peer + 1 == peers {
                    indices.len()
                } else {
                    ((cumulative * indices.len() as f64).round() as usize).min(indices.len())
                };
                shards[peer].extend_from_slice(&indices[start..end.max(start)]);
                start = end.max(start);
            }
        }
        if shards.iter().all(|s| !s.is_empty()) {
            break;
        }
    }
    Ok(shards)
}

/// What `nodectl shard` wrote: enough to check a shard set without reading the shards.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub source: String,
    pub partition: String,
    pub seed: u64,
    pub peers: usize,
    pub total_samples: usize,
    /// Samples that no shard got (only `labels:K` with fewer than 10 labels covered).
    pub unassigned_samples: usize,
    pub shards: Vec<ShardEntry>,
}

/// One shard in a [`Manifest`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardEntry {
    pub index: usize,
    /// Directory relative to the manifest.
    pub dir: String,
    /// Samples in the shard; tokens for text.
    pub samples: usize,
    /// Samples of each label (images only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label_counts: Option<[usize; CLASSES]>,
}

/// The file name of the manifest inside an output directory.
pub const MANIFEST_FILE: &str = "manifest.json";

/// The file name of [`ShardInfo`] inside a shard directory.
pub const SHARD_INFO_FILE: &str = "shard.json";

/// What a shard knows of the set it came from (`shard.json` in the shard directory).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardInfo {
    pub format: String,
    pub index: usize,
    pub peers: usize,
    pub partition: String,
    /// Samples in this shard.
    pub samples: usize,
    /// Samples in all shards of the set together.
    pub set_samples: usize,
}

impl ShardInfo {
    /// The mean shard size: the epoch length at which every peer takes the same number of steps
    /// and the swarm together passes over the whole set once per epoch.
    pub fn mean_samples(&self) -> usize {
        self.set_samples.div_ceil(self.peers.max(1))
    }

    /// Reads `dir/shard.json`; `Ok(None)` when `dir` is not a shard made by `nodectl shard`.
    pub fn read(dir: &Path) -> Result<Option<Self>, ShardError> {
        let path = dir.join(SHARD_INFO_FILE);
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(ShardError::Io { path, source }),
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| ShardError::BadInfo {
                path,
                problem: e.to_string(),
            })
    }
}

/// Name of shard `index`'s directory.
pub fn shard_dir_name(index: usize) -> String {
    format!("shard-{index:03}")
}

/// The directory a shard set is written to. The manifest is written last, so its presence
/// means the set is complete; a complete set is replaced only with `force`.
struct SetDir {
    out: PathBuf,
    manifest: PathBuf,
}

impl SetDir {
    fn new(out: &Path, force: bool) -> Result<Self, ShardError> {
        let manifest = out.join(MANIFEST_FILE);
        if manifest.exists() && !force {
            return Err(ShardError::OutputExists {
                dir: out.to_owned(),
            });
        }
        Ok(SetDir {
            out: out.to_owned(),
            manifest,
        })
    }

    /// Creates the directory and removes an earlier set's manifest: from here on the set in
    /// it is incomplete until [`SetDir::finish`].
    fn open(&self) -> Result<(), ShardError> {
        fs::create_dir_all(&self.out).map_err(io_error(&self.out))?;
        let _ = fs::remove_file(&self.manifest);
        Ok(())
    }

    /// Creates the directory of shard `index`, emptied first with `clear`; returns its name
    /// (relative to the set) and path.
    fn shard(&self, index: usize, clear: bool) -> Result<(String, PathBuf), ShardError> {
        let name = shard_dir_name(index);
        let dir = self.out.join(&name);
        if clear && dir.exists() {
            fs::remove_dir_all(&dir).map_err(io_error(&dir))?;
        }
        fs::create_dir_all(&dir).map_err(io_error(&dir))?;
        Ok((name, dir))
    }

    fn write_info(dir: &Path, info: &ShardInfo) -> Result<(), ShardError> {
        let path = dir.join(SHARD_INFO_FILE);
        let json = serde_json::to_vec_pretty(info).expect("invariant: shard info serialises");
        crate::checkpoint::write_atomic(&path, &json).map_err(io_error(&path))
    }

    fn finish(self, manifest: Manifest) -> Result<Manifest, ShardError> {
        let json = serde_json::to_vec_pretty(&manifest).expect("invariant: a manifest serialises");
        crate::checkpoint::write_atomic(&self.manifest, &json).map_err(io_error(&self.manifest))?;
        Ok(manifest)
    }
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> ShardError {
    let path = path.to_owned();
    move |source| ShardError::Io { path, source }
}

/// Splits `data` and writes one shard directory per peer plus `manifest.json` into `out`.
/// The manifest is written last, so its presence means the set is complete.
pub fn write_shards(
    data: &Dataset,
    source: &str,
    peers: usize,
    partition: Partition,
    seed: u64,
    out: &Path,
    force: bool,
) -> Result<Manifest, ShardError> {
    let set = SetDir::new(out, force)?;
    let assignment = assign(data.labels(), peers, partition, seed)?;
    set.open()?;
    let set_samples: usize = assignment.iter().map(Vec::len).sum();
    let mut shards = Vec::with_capacity(peers);
    for (index, indices) in assignment.iter().enumerate() {
        let (name, dir) = set.shard(index, false)?;
        let shard = data.subset(indices);
        shard
            .write_split(&dir, super::Split::Train)
            .map_err(io_error(&dir))?;
        let info = ShardInfo {
            format: "murmur-shard/1".to_owned(),
            index,
            peers,
            partition: partition.to_string(),
            samples: shard.len(),
            set_samples,
        };
        SetDir::write_info(&dir, &info)?;
        shards.push(ShardEntry {
            index,
            dir: name,
            samples: shard.len(),
            label_counts: Some(shard.label_counts()),
        });
    }
    set.finish(Manifest {
        format: "murmur-shards/1".to_owned(),
        source: source.to_owned(),
        partition: partition.to_string(),
        seed,
        peers,
        total_samples: data.len(),
        unassigned_samples: data.len() - set_samples,
        shards,
    })
}

/// Tokens per block of an IID text deal: enough that few windows straddle a block's end
/// (a window of 65 tokens loses 64 of 8,192 positions), small enough that every document is
/// spread over many peers.
pub const TEXT_BLOCK: usize = 8_192;

/// Deals the training text of `corpus` (all but each document's last tenth, kept for
/// validation) to `peers` shards, as [`write_shards`] does for images: each shard a directory
/// of `.txt` files, one per piece (a block of [`TEXT_BLOCK`] tokens, or a whole document's
/// training part), named after its document and first token.
pub fn write_text_shards(
    corpus: &Corpus,
    source: &str,
    peers: usize,
    partition: TextPartition,
    seed: u64,
    out: &Path,
    force: bool,
) -> Result<Manifest, ShardError> {
    let set = SetDir::new(out, force)?;
    let training = corpus.train_ranges(DEFAULT_VALIDATION_SHARE);
    let deal = text::deal(&training, peers, partition, TEXT_BLOCK, seed)?;
    set.open()?;
    let set_tokens: usize = training.iter().map(TokenRange::len).sum();
    let mut shards = Vec::with_capacity(peers);
    for (index, pieces) in deal.iter().enumerate() {
        // A shard of an earlier deal may hold other pieces.
        let (name, dir) = set.shard(index, true)?;
        for piece in pieces {
            let document = &corpus.documents()[piece.document].name;
            let path = dir.join(format!("{document}-{:08}.txt", piece.start));
            fs::write(&path, corpus.tokens(*piece)).map_err(io_error(&path))?;
        }
        let tokens = pieces.iter().map(TokenRange::len).sum();
        let info = ShardInfo {
            format: "murmur-text-shard/1".to_owned(),
            index,
            peers,
            partition: partition.to_string(),
            samples: tokens,
            set_samples: set_tokens,
        };
        SetDir::write_info(&dir, &info)?;
        shards.push(ShardEntry {
            index,
            dir: name,
            samples: tokens,
            label_counts: None,
        });
    }
    set.finish(Manifest {
        format: "murmur-text-shards/1".to_owned(),
        source: source.to_owned(),
        partition: partition.to_string(),
        seed,
        peers,
        total_samples: set_tokens,
        unassigned_samples: 0,
        shards,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 % CLASSES) as u8).collect()
    }

    fn check_disjoint_cover(shards: &[Vec<usize>], n: usize) {
        let mut all: Vec<usize> = shards.concat();
        all.sort_unstable();
        assert_eq!(all, (0..n).collect::<Vec<_>>());
    }

    #[test]
    fn partitions_parse_and_print() {
        assert_eq!("iid".parse::<Partition>().unwrap(), Partition::Iid);
        assert_eq!(
            "dirichlet:0.5".parse::<Partition>().unwrap(),
            Partition::Dirichlet { alpha: 0.5 }
        );
        assert_eq!(
            "labels:2".parse::<Partition>().unwrap(),
            Partition::Labels { per_peer: 2 }
        );
        assert_eq!(
            Partition::Dirichlet { alpha: 0.5 }.to_string(),
            "dirichlet:0.5"
        );
        for bad in [
            "dirichlet:-1",
            "dirichlet:x",
            "labels:0",
            "labels:11",
            "random",
            "iid:3",
        ] {
            let err = bad.parse::<Partition>().unwrap_err().to_string();
            assert!(err.contains(bad.split(':').next().unwrap()), "{bad}: {err}");
        }
    }

    #[test]
    fn iid_shards_are_balanced_disjoint_and_deterministic() {
        let l = labels(1003);
        let shards = assign(&l, 4, Partition::Iid, 9).unwrap();
        check_disjoint_cover(&shards, 1003);
        let sizes: Vec<_> = shards.iter().map(Vec::len).collect();
        assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
        assert_eq!(shards, assign(&l, 4, Partition::Iid, 9).unwrap());
        assert_ne!(shards, assign(&l, 4, Partition::Iid, 10).unwrap());
    }

    #[test]
    fn dirichlet_shards_cover_everything_and_skew_with_small_alpha() {
        let l = labels(5000);
        let skewed = assign(&l, 4, Partition::Dirichlet { alpha: 0.1 }, 1).unwrap();
        check_disjoint_cover(&skewed, 5000);
        let even = assign(&l, 4, Partition::Dirichlet { alpha: 1000.0 }, 1).unwrap();
        let spread = |shards: &[Vec<usize>]| {
            let sizes: Vec<_> = shards.iter().map(Vec::len).collect();
            sizes.iter().max().unwrap() - sizes.iter().min().unwrap()
        };
        assert!(
            spread(&skewed) > spread(&even),
            "{} vs {}",
            spread(&skewed),
            spread(&even)
        );
        assert_eq!(
            skewed,
            assign(&l, 4, Partition::Dirichlet { alpha: 0.1 }, 1).unwrap()
        );
    }

    #[test]
    fn label_shards_hold_exactly_k_labels() {
        let l = labels(1000);
        let shards = assign(&l, 5, Partition::Labels { per_peer: 2 }, 3).unwrap();
        check_disjoint_cover(&shards, 1000);
        for shard in &shards {
            let mut seen: Vec<u8> = shard.iter().map(|&i| l[i]).collect();
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len(), 2);
        }
    }

    #[test]
    fn more_shards_than_samples_is_an_error_that_says_what_to_do() {
        let err = assign(&labels(3), 4, Partition::Iid, 0).unwrap_err();
        assert!(err.to_string().contains("--peers 3"), "{err}");
        assert!(matches!(
            assign(&labels(3), 0, Partition::Iid, 0),
            Err(ShardError::NoPeers)
        ));
    }

    #[test]
    fn written_shards_load_back_and_match_the_manifest() {
        let data = Dataset::synthetic(200, 4);
        let out = tempfile::tempdir().unwrap();
        let m = write_shards(&data, "synthetic", 3, Partition::Iid, 0, out.path(), false).unwrap();
        assert_eq!(m.shards.len(), 3);
        assert_eq!(m.shards.iter().map(|s| s.samples).sum::<usize>(), 200);
        for entry in &m.shards {
            let shard =
                Dataset::load(&out.path().join(&entry.dir), super::super::Split::Train).unwrap();
            assert_eq!(shard.len(), entry.samples);
            assert_eq!(Some(shard.label_counts()), entry.label_counts);
            let info = ShardInfo::read(&out.path().join(&entry.dir))
                .unwrap()
                .unwrap();
            assert_eq!((info.index, info.peers), (entry.index, 3));
            assert_eq!((info.samples, info.set_samples), (entry.samples, 200));
            assert_eq!(info.mean_samples(), 67);
        }
        assert_eq!(ShardInfo::read(out.path()).unwrap(), None);
        fs::write(out.path().join(SHARD_INFO_FILE), "{").unwrap();
        let err = ShardInfo::read(out.path()).unwrap_err();
        assert!(err.to_string().contains("nodectl shard"), "{err}");
        let on_disk: Manifest =
            serde_json::from_slice(&fs::read(out.path().join(MANIFEST_FILE)).unwrap()).unwrap();
        assert_eq!(on_disk, m);
        let again = write_shards(&data, "synthetic", 3, Partition::Iid, 0, out.path(), false);
        assert!(matches!(again, Err(ShardError::OutputExists { .. })));
        assert!(write_shards(&data, "synthetic", 3, Partition::Iid, 0, out.path(), true).is_ok());
    }

    #[test]
    fn text_shards_hold_the_training_text_once_and_nothing_held_out() {
        let document = |name: &str, len: usize, salt: u8| text::Document {
            name: name.to_owned(),
            tokens: (0..len)
                .map(|i| b'a' + ((i * 7 + usize::from(salt)) % 26) as u8)
                .collect(),
        };
        let corpus = Corpus::from_documents(vec![
            document("one", 30_000, 1),
            document("two", 20_000, 2),
            document("three", 9_000, 3),
        ]);
        let training: usize = corpus
            .train_ranges(DEFAULT_VALIDATION_SHARE)
            .iter()
            .map(TokenRange::len)
            .sum();
        for partition in [TextPartition::Iid, TextPartition::Documents] {
            let out = tempfile::tempdir().unwrap();
            let manifest =
                write_text_shards(&corpus, "t", 3, partition, 5, out.path(), false).unwrap();
            let mut held = 0;
            for entry in &manifest.shards {
                let dir = out.path().join(&entry.dir);
                let shard = Corpus::load(&dir).unwrap();
                assert_eq!(shard.len(), entry.samples, "{partition}");
                assert!(ShardInfo::read(&dir).unwrap().is_some());
                held += shard.len();
                // Every piece is text of its document's training part.
                for piece in shard.documents() {
                    let (name, start) = piece.name.rsplit_once('-').unwrap();
                    let start: usize = start.parse().unwrap();
                    let source = corpus.documents().iter().find(|d| d.name == name).unwrap();
                    let cut = source.tokens.len() - source.tokens.len().div_ceil(10);
                    assert!(
                        start + piece.tokens.len() <= cut,
                        "{partition}: held-out text"
                    );
                    assert_eq!(
                        piece.tokens,
                        &source.tokens[start..start + piece.tokens.len()]
                    );
                }
            }
            assert_eq!(held, training, "{partition}");
            assert_eq!(manifest.total_samples, training);
        }
    }
}
