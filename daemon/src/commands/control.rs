//! `nodectl status | peers | wait | leave`: ask the running daemon over its control API.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::api::client as api;
use crate::api::types::{PeerReport, StatusReport};
use crate::cli::{DataDirArgs, StatusArgs, WaitArgs};
use crate::report;

pub(super) fn status(args: &StatusArgs) -> Result<()> {
    let addr = api::address(&args.node.data_dir())?;
    if !args.watch {
        let s: StatusReport = api::get_json(&addr, "/status")?;
        return print_status(&s, args.node.json);
    }
    if !(args.interval > 0.0 && args.interval.is_finite()) {
        bail!(
            "--interval {} is not a positive number of seconds",
            args.interval
        );
    }
    let in_place = std::io::stdout().is_terminal() && !args.node.json;
    loop {
        let s: StatusReport = api::get_json(&addr, "/status")?;
        if in_place {
            // Home the cursor and clear the screen, so the report replaces the last one.
            print!("\x1b[H\x1b[2J");
        }
        print_status(&s, args.node.json)?;
        if !in_place && !args.node.json {
            println!();
        }
        std::io::stdout().flush()?;
        std::thread::sleep(Duration::from_secs_f64(args.interval));
    }
}

fn print_status(s: &StatusReport, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(s)?);
        return Ok(());
    }
    let sync = &s.sync;
    println!("peer {} in run {} ({})", s.peer_id, s.run_id, s.state);
    println!(
        "mode {}, role {}, device {}, model {}",
        sync.mode, sync.role, s.device, s.model
    );
    println!(
        "step {} (epoch {}/{}), loss {:.4}, test accuracy {}, test loss {}",
        s.step,
        s.epoch,
        s.epochs,
        s.loss_ema,
        s.test_accuracy
            .map_or("-".to_owned(), |a| format!("{:.2}%", a * 100.0)),
        s.test_loss.map_or("-".to_owned(), |l| format!("{l:.4}"))
    );
    println!(
        "exchanges {} ok, {} busy, {} stale, {} rejected, {} failed; {} served",
        sync.exchanges, sync.busy, sync.stale, sync.rejected, sync.failed, sync.served
    );
    let relayed = if sync.relayed_bytes_out + s.relayed_bytes_in > 0 {
        format!(
            " (through relays: out {}, in {})",
            report::bytes(sync.relayed_bytes_out),
            report::bytes(s.relayed_bytes_in)
        )
    } else {
        String::new()
    };
    println!(
        "bytes out {}, in {}{relayed}; {:.1}s at the staleness gate, largest lead {} steps",
        report::bytes(sync.bytes_out),
        report::bytes(s.tensor_bytes_in),
        sync.gate_wait_s,
        sync.max_lead
    );
    println!(
        "{} live peers, {} rejected messages, {} blocked peers, up {:.0}s",
        s.live_peers, s.rejected_messages, s.blocked_peers, s.uptime_s
    );
    println!("{}", reachability_line(s));
    if let Some(m) = s.memory {
        let allocated = m
            .allocated_bytes
            .map(|held| format!(", {} allocated", report::bytes(held)))
            .unwrap_or_default();
        let heap = match (m.heap_in_use_bytes, m.heap_free_bytes) {
            (Some(held), Some(kept)) => format!(
                " (heap: {} held, {} free in the allocator)",
                report::bytes(held),
                report::bytes(kept)
            ),
            _ => String::new(),
        };
        let peak = match (m.peak_resident_bytes, m.peak_allocated_bytes) {
            (Some(resident), Some(held)) => format!(
                "; peak {} resident, {} allocated",
                report::bytes(resident),
                report::bytes(held)
            ),
            (Some(resident), None) => format!("; peak {} resident", report::bytes(resident)),
            _ => String::new(),
        };
        println!(
            "memory {} resident{allocated}{heap}{peak}",
            report::bytes(m.resident_bytes)
        );
    }
    let copies = sync.pair_copies;
    if copies.partners > 0 || copies.dropped > 0 {
        println!(
            "pair copies {} of {} for {} partners, {} pairs dropped to keep within [memory]",
            report::bytes(copies.bytes),
            report::bytes(copies.budget_bytes),
            copies.partners,
            copies.dropped
        );
    }
    if !s.peers.is_empty() {
        println!();
        print_peers(&s.peers);
    }
    Ok(())
}

/// Whether peers can dial this node, and where: its confirmed addresses, else its relayed ones.
fn reachability_line(s: &StatusReport) -> String {
    let reachability = if s.reachability.is_empty() {
        "unknown"
    } else {
        &s.reachability
    };
    let mut line = format!("reachability {reachability}");
    if !s.external_addrs.is_empty() {
        line += &format!(", dialled back at {}", s.external_addrs.join(" "));
    }
    if !s.relayed_addrs.is_empty() {
        line += &format!(", through relays at {}", s.relayed_addrs.join(" "));
    }
    if !s.nat_mapping.is_empty() && s.nat_mapping != "unknown" {
        line += &format!("; NAT mapping {}", s.nat_mapping.replace('_', "-"));
    }
    if s.hole_punches + s.hole_punches_failed > 0 {
        line += &format!(
            "; hole punches {} direct, {} failed",
            s.hole_punches, s.hole_punches_failed
        );
    }
    if s.client {
        line += "; running as a client (exchanges only with peers it dialled)";
    }
    line
}

/// The peer table of `status` and `peers`.
fn print_peers(peers: &[PeerReport]) {
    println!(
        "{:<54} {:>8} {:>6} {:>9} {:>8} {:>12} {:>7} {:>8} {:>5} {:<12}",
        "peer",
        "step",
        "epoch",
        "staleness",
        "loss",
        "seen ms ago",
        "rtt ms",
        "Mbit/s",
        "link",
        "connection"
    );
    let figure = |value: Option<f64>| value.map_or("-".to_owned(), |v| format!("{v:.1}"));
    for p in peers {
        println!(
            "{:<54} {:>8} {:>6} {:>9} {:>8.4} {:>12} {:>7} {:>8} {:>5} {:<12}",
            p.peer_id,
            p.step,
            p.epoch,
            p.staleness,
            p.loss_ema,
            p.last_seen_ms,
            figure(p.rtt_ms),
            figure(p.throughput_mbit_s),
            if p.slow_link { "slow" } else { "-" },
            connection_cell(p)
        );
    }
}

/// How this node is connected to the peer, and whether the peer is a client.
fn connection_cell(p: &PeerReport) -> String {
    let connection = p.connection.as_deref().unwrap_or("-").replace('_', "-");
    if p.client {
        format!("{connection} (client)")
    } else {
        connection
    }
}

pub(super) fn peers(args: &DataDirArgs) -> Result<()> {
    let addr = api::address(&args.data_dir())?;
    let peers: Vec<PeerReport> = api::get_json(&addr, "/peers")?;
    if args.json {
        println!("{}", serde_json::to_string(&peers)?);
        return Ok(());
    }
    print_peers(&peers);
    Ok(())
}

pub(super) fn wait(args: &WaitArgs) -> Result<()> {
    let data = args.node.data_dir();
    let deadline = Instant::now() + Duration::from_secs_f64(args.timeout.max(0.0));
    loop {
        // The daemon may still be starting: a missing api file or a refused call is retried.
        let seen = api::address(&data)
            .and_then(|addr| api::get_json::<Vec<PeerReport>>(&addr, "/peers"))
            .map(|peers| peers.len());
        if let Ok(n) = seen
            && n >= args.min_peers
        {
            if args.node.json {
                println!("{}", serde_json::json!({"live_peers": n}));
            } else {
                println!("{n} live peers");
            }
            return Ok(());
        }
        if Instant::now() >= deadline {
            let detail = match seen {
                Ok(n) => format!("{n} live peers"),
                Err(e) => format!("{e:#}"),
            };
            bail!(
                "timed out after {}s waiting for {} live peers ({detail}); check the daemon's \
                 log and its bootstrap addresses",
                args.timeout,
                args.min_peers
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

pub(super) fn leave(args: &DataDirArgs) -> Result<()> {
    let data = args.data_dir();
    let addr = api::address(&data)?;
    api::post(&addr, "/leave", &api::token(&data)?)?;
    if args.json {
        println!("{}", serde_json::json!({"leaving": true}));
    } else {
        println!("the daemon is leaving the run");
    }
    Ok(())
}
