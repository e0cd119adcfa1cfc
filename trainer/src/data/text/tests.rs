use std::path::PathBuf;

use proptest::prelude::*;

use super::*;

/// The two excerpts kept in the repository (see their NOTICE).
fn sample_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata/shakespeare")
}

fn corpus(lengths: &[usize]) -> Corpus {
    Corpus::from_documents(
        lengths
            .iter()
            .enumerate()
            .map(|(i, &len)| Document {
                name: format!("doc-{i}"),
                tokens: (0..len).map(|t| (t % 251) as u8).collect(),
            })
            .collect(),
    )
}

fn range(document: usize, start: usize, end: usize) -> TokenRange {
    TokenRange {
        document,
        start,
        end,
    }
}

/// Every (document, token) pair the ranges hold, in order.
fn tokens_of(ranges: &[TokenRange]) -> Vec<(usize, usize)> {
    let mut all: Vec<_> = ranges
        .iter()
        .flat_map(|r| (r.start..r.end).map(move |t| (r.document, t)))
        .collect();
    all.sort();
    all
}

#[test]
fn text_round_trips_and_broken_utf8_decodes_without_a_panic() {
    let text = "Who's there?\nNay, answer me — stand.";
    assert_eq!(decode(&encode(text)), text);
    assert_eq!(encode("ab"), vec![b'a', b'b']);
    // A model can stop inside a character.
    assert_eq!(decode(&[b'a', 0xE2, 0x80]), "a\u{FFFD}");
}

#[test]
fn the_sample_loads_as_two_ascii_documents_in_name_order() {
    let corpus = Corpus::load(&sample_dir()).unwrap();
    let names: Vec<_> = corpus.documents().iter().map(|d| d.name.as_str()).collect();
    // NOTICE is not a `.txt` file, so it is not a document.
    assert_eq!(names, ["hamlet", "sonnets"]);
    assert!(
        corpus.documents()[0]
            .tokens
            .starts_with(b"HAMLET, PRINCE OF DENMARK")
    );
    assert!(corpus.documents().iter().all(|d| d.tokens.is_ascii()));
    assert!(corpus.len() > 10_000, "{} tokens", corpus.len());
}

#[test]
fn a_missing_or_empty_directory_says_how_to_get_text() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("README"), "not a document").unwrap();
    for missing in [dir.path().to_owned(), dir.path().join("nowhere")] {
        let err = Corpus::load(&missing).unwrap_err();
        assert!(matches!(err, DataError::MissingText { .. }), "{err}");
        let message = err.to_string();
        assert!(message.contains("data/fetch-shakespeare.sh"), "{message}");
        assert!(message.contains(".txt"), "{message}");
    }
}

#[test]
fn each_document_keeps_its_last_tenth_for_validation() {
    let corpus = corpus(&[100, 11, 0, 1]);
    let train = corpus.train_ranges(0.1);
    let validation = corpus.validation_ranges(0.1);
    // Rounded up: 10 of 100, 2 of 11, and the one token of the last document.
    assert_eq!(train, [range(0, 0, 90), range(1, 0, 9)]);
    assert_eq!(
        validation,
        [range(0, 90, 100), range(1, 9, 11), range(3, 0, 1)]
    );
    assert_eq!(corpus.tokens(range(0, 90, 93)), [90, 91, 92]);
}

#[test]
fn iid_blocks_are_dealt_whole_evenly_and_reproducibly() {
    let corpus = corpus(&[1000, 333, 70]);
    let train = corpus.train_ranges(DEFAULT_VALIDATION_SHARE);
    let shards = deal(&train, 3, TextPartition::Iid, 64, 7).unwrap();
    // Together the shards hold the training text exactly once.
    let dealt: Vec<_> = shards.iter().flatten().copied().collect();
    assert_eq!(tokens_of(&dealt), tokens_of(&train));
    let counts: Vec<_> = shards.iter().map(Vec::len).collect();
    assert!(counts.iter().max().unwrap() - counts.iter().min().unwrap() <= 1);
    assert!(dealt.iter().all(|b| b.len() <= 64 && b.start % 64 == 0));
    // Every shard has some of the longest document: the deal is not by document.
    assert!(shards.iter().all(|s| s.iter().any(|b| b.document == 0)));
    assert_eq!(shards, deal(&train, 3, TextPartition::Iid, 64, 7).unwrap());
    assert_ne!(shards, deal(&train, 3, TextPartition::Iid, 64, 8).unwrap());
}

#[test]
fn documents_are_dealt_whole_to_the_lightest_peer() {
    let corpus = corpus(&[50, 400, 100, 300, 200]);
    let train = corpus.train_ranges(0.0);
    let shards = deal(&train, 2, TextPartition::Documents, 64, 0).unwrap();
    let held: Vec<usize> = shards
        .iter()
        .map(|s| s.iter().map(TokenRange::len).sum())
        .collect();
    // 400 and 100 then 50 to one peer; 300 and 200 to the other.
    assert_eq!(held, [550, 500]);
    assert!(shards.iter().flatten().all(|r| r.start == 0));
    let documents: Vec<Vec<usize>> = shards
        .iter()
        .map(|s| s.iter().map(|r| r.document).collect())
        .collect();
    assert_eq!(documents, [vec![0, 1, 2], vec![3, 4]]);
}

#[test]
fn too_few_documents_or_blocks_for_the_peers_name_the_most_peers() {
    let corpus = corpus(&[100, 100]);
    let train = corpus.train_ranges(0.0);
    let err = deal(&train, 3, TextPartition::Documents, 64, 0).unwrap_err();
    assert!(err.to_string().contains("`--peers 2` or fewer"), "{err}");
    let err = deal(&train, 5, TextPartition::Iid, 64, 0).unwrap_err();
    assert!(err.to_string().contains("4 blocks of text"), "{err}");
    assert!(matches!(
        deal(&train, 0, TextPartition::Iid, 64, 0),
        Err(ShardError::NoPeers)
    ));
}

#[test]
fn partitions_parse_and_print_back() {
    for spec in ["iid", "documents"] {
        assert_eq!(spec.parse::<TextPartition>().unwrap().to_string(), spec);
    }
    let err = "plays".parse::<TextPartition>().unwrap_err();
    assert!(err.to_string().contains("`documents`"), "{err}");
}

#[test]
fn held_out_windows_are_back_to_back_bounded_and_spread() {
    let ranges = vec![range(0, 0, 100), range(1, 10, 15), range(2, 0, 40)];
    // 10 windows of 10 in the first range, none in the second, 4 in the third.
    let all = Windows::held_out(ranges.clone(), 10, usize::MAX);
    assert_eq!(all.len(), 14);
    assert_eq!(all[9], range(0, 90, 100));
    assert_eq!(all[10], range(2, 0, 10));
    let some = Windows::held_out(ranges.clone(), 10, 7);
    assert_eq!(some.len(), 7);
    assert_eq!(some, (0..7).map(|i| all[i * 2]).collect::<Vec<_>>());
    assert!(Windows::held_out(ranges, 200, 7).is_empty());
}

proptest! {
    #[test]
    fn windows_are_every_fitting_position_in_order(
        lengths in prop::collection::vec(0usize..40, 0..6),
        len in 1usize..12,
        stride in 1usize..5,
    ) {
        let ranges: Vec<_> = lengths
            .iter()
            .enumerate()
            .map(|(i, &n)| range(i, 3, 3 + n))
            .collect();
        let expected: Vec<_> = ranges
            .iter()
            .flat_map(|r| {
                (r.start..r.end)
                    .step_by(stride)
                    .filter(move |s| s + len <= r.end)
                    .map(move |s| range(r.document, s, s + len))
            })
            .collect();
        let windows = Windows::new(ranges, len, stride);
        prop_assert_eq!(windows.count(), expected.len());
        prop_assert_eq!(windows.window_len(), len);
        let got: Vec<_> = (0..windows.count()).map(|i| windows.get(i)).collect();
        prop_assert_eq!(got, expected);
    }
}
