//! Writes the first corpus of every fuzz target into `fuzz/seeds/<target>/`: well-formed
//! inputs made by Murmur's own encoders, from which the fuzzers mutate. `fuzz/run.sh` starts
//! from them; run this again when an encoding changes:
//!
//! ```text
//! cargo run --manifest-path fuzz/Cargo.toml --example seeds
//! ```

use std::fs;
use std::path::{Path, PathBuf};

use futures::executor::block_on;
use murmur_daemon::config::{NodeConfig, RunConfig};
use murmur_protocol::codec::Codec;
use murmur_protocol::fuzzing;
use murmur_protocol::heartbeat::{HEARTBEAT_VERSION, Heartbeat, Role, SyncMode};
use murmur_protocol::wire::{self, MessageKind, TensorHeader};
use murmur_trainer::ModelSpec;
use murmur_trainer::checkpoint::Checkpoint;
use murmur_trainer::data::idx;

const RUN: &str = "fuzz";
const FINGERPRINT: &str = "fp";

fn main() -> std::io::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let seeds = root.join("seeds");
    let values: Vec<f32> = (0..64).map(|i| (i as f32 - 32.0) / 8.0).collect();

    let mut frames = Vec::new();
    let offer = TensorHeader::for_payload(MessageKind::Offer, RUN, FINGERPRINT, 3, &[]);
    frames.push(frame(&offer, &[]));
    let params = TensorHeader::for_payload(MessageKind::Params, RUN, FINGERPRINT, 9, &values);
    frames.push(frame(&params, &Codec::F32.encode(&values)));
    for codec in codecs() {
        let encoded = codec.encode(&values);
        let header = TensorHeader {
            reference: Some(2),
            accept: vec![Codec::F32, codec],
            ..TensorHeader::for_encoded(
                MessageKind::Delta,
                RUN,
                FINGERPRINT,
                9,
                codec,
                values.len(),
                &encoded,
            )
        };
        frames.push(frame(&header, &encoded));
    }
    frames.push(frames.concat());
    check_frames(&frames);
    write(&seeds, "frame", &frames)?;

    let codec_inputs: Vec<Vec<u8>> = [(0u8, 0u8), (1, 0), (2, 16), (3, 16), (4, 25)]
        .into_iter()
        .zip(std::iter::once(Codec::F32).chain(codecs()))
        .map(|((kind, parameter), codec)| {
            let mut input = vec![kind, parameter];
            input.extend((values.len() as u16).to_le_bytes());
            input.extend(codec.encode(&values));
            input
        })
        .collect();
    write(&seeds, "codec", &codec_inputs)?;

    let heartbeat = Heartbeat {
        version: HEARTBEAT_VERSION,
        run_id: RUN.into(),
        fingerprint: FINGERPRINT.into(),
        step: 1200,
        epoch: 2,
        loss_ema: 0.5,
        samples_seen: 76_800,
        mode: SyncMode::Gossip,
        role: Role::Worker,
        leaving: false,
        finished: false,
        client: false,
        sent_ms: 1_790_000_000_000,
    };
    let leaving = Heartbeat {
        leaving: true,
        mode: SyncMode::Elastic,
        role: Role::Center,
        ..heartbeat.clone()
    };
    for sample in [&heartbeat, &leaving] {
        let read = Heartbeat::decode(&sample.encode(), RUN, FINGERPRINT).expect("the seed reads");
        assert_eq!(&read, sample);
    }
    write(&seeds, "heartbeat", &[heartbeat.encode(), leaving.encode()])?;

    write(
        &seeds,
        "ring_header",
        &[fuzzing::sample_ring_round_header()],
    )?;
    let mut pieces = 16u16.to_le_bytes().to_vec();
    pieces.extend(fuzzing::sample_ring_pieces(&values, 16));
    write(&seeds, "ring_pieces", &[pieces])?;
    write(&seeds, "ring_control", &[fuzzing::sample_ring_control()])?;

    let mut configs = fs::read_dir(root.join("../configs"))?
        .map(|entry| entry.map(|e| e.path()))
        .collect::<Result<Vec<PathBuf>, _>>()?;
    configs.sort();
    let mut run_configs = Vec::new();
    for path in configs
        .iter()
        .filter(|p| p.extension() == Some("toml".as_ref()))
    {
        let text = fs::read_to_string(path)?;
        RunConfig::parse(path, &text).expect("every shipped config parses");
        run_configs.push(text.into_bytes());
    }
    write(&seeds, "run_config", &run_configs)?;
    write(
        &seeds,
        "node_config",
        &[NodeConfig::TEMPLATE.as_bytes().to_vec()],
    )?;

    // Three images of 2x2 pixels (the dimensions byte selects 3), and their labels (1).
    let images = [
        &[2u8][..],
        &[0, 0, 8, 3, 0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 2],
        &[9; 12],
    ]
    .concat();
    let labels = [&[0u8][..], &[0, 0, 8, 1, 0, 0, 0, 3], &[1, 2, 3]].concat();
    for seed in [&images, &labels] {
        let ndim = 1 + seed[0] % 4;
        idx::decode(Path::new("seed.idx"), seed[1..].to_vec(), ndim).expect("the seed reads");
    }
    write(&seeds, "idx", &[images, labels])?;

    let spec = ModelSpec {
        hidden: Some(vec![1]),
        ..ModelSpec::mlp()
    };
    let arch = spec.build().expect("a tiny MLP builds");
    let params = arch.init_params(1);
    let checkpoint = Checkpoint {
        step: 10,
        epoch: 1,
        config_hash: "abc".into(),
        fingerprint: arch.fingerprint(),
        optimizer_state: vec![params.iter().map(|v| v * 0.5).collect()],
        optimizer_state_names: vec!["velocity".into()],
        optimizer_updates: 10,
        params,
    };
    let bytes = checkpoint
        .to_bytes(arch.layout())
        .expect("a checkpoint serialises");
    let path = Path::new("seed.safetensors");
    let read = Checkpoint::from_bytes(path, &bytes, arch.layout()).expect("the seed reads");
    assert_eq!(read, checkpoint);
    write(&seeds, "checkpoint", &[bytes])?;
    Ok(())
}

/// The frames the `frame` target reads, each accepted as it would be by a node.
fn check_frames(frames: &[Vec<u8>]) {
    let expect = wire::Expect {
        run_id: RUN,
        fingerprint: FINGERPRINT,
        max_payload_bytes: 1 << 16,
    };
    for bytes in frames {
        let mut stream = bytes.as_slice();
        let mut buffer = Vec::new();
        while !stream.is_empty() {
            block_on(wire::read_frame(&mut stream, &expect, &mut buffer)).expect("a seed reads");
        }
    }
}

fn codecs() -> impl Iterator<Item = Codec> {
    [
        Codec::Bf16,
        Codec::Int8 { block: 16 },
        Codec::Int4 { block: 16 },
        Codec::TopK { per_mille: 100 },
    ]
    .into_iter()
}

fn frame(header: &TensorHeader, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    block_on(wire::write_encoded(&mut out, header, payload)).expect("a Vec takes any frame");
    out
}

fn write(seeds: &Path, target: &str, inputs: &[Vec<u8>]) -> std::io::Result<()> {
    let dir = seeds.join(target);
    fs::create_dir_all(&dir)?;
    for (i, input) in inputs.iter().enumerate() {
        fs::write(dir.join(format!("seed-{i:02}")), input)?;
    }
    println!("{}: {} seeds", dir.display(), inputs.len());
    Ok(())
}
