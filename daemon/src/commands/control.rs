//! `nodectl status | peers | wait | leave`: ask the running daemon over its control API.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::api::{self, PeerReport, StatusReport};
use crate::cli::{DataDirArgs, WaitArgs};

pub(super) fn status(args: &DataDirArgs) -> Result<()> {
    let addr = api::address(&args.data_dir())?;
    let s: StatusReport = api::get_json(&addr, "/status")?;
    if args.json {
        println!("{}", serde_json::to_string(&s)?);
        return Ok(());
    }
    println!("peer {} in run {} ({})", s.peer_id, s.run_id, s.state);
    println!(
        "step {} (epoch {}/{}), loss {:.4}, test accuracy {}",
        s.step,
        s.epoch,
        s.epochs,
        s.loss_ema,
        s.test_accuracy
            .map_or("-".to_owned(), |a| format!("{:.2}%", a * 100.0))
    );
    println!(
        "{} live peers, {} rejected messages, {} blocked peers, up {:.0}s",
        s.live_peers, s.rejected_messages, s.blocked_peers, s.uptime_s
    );
    Ok(())
}

pub(super) fn peers(args: &DataDirArgs) -> Result<()> {
    let addr = api::address(&args.data_dir())?;
    let peers: Vec<PeerReport> = api::get_json(&addr, "/peers")?;
    if args.json {
        println!("{}", serde_json::to_string(&peers)?);
        return Ok(());
    }
    println!(
        "{:<54} {:>8} {:>6} {:>8} {:>10}",
        "peer", "step", "epoch", "loss", "seen ms ago"
    );
    for p in &peers {
        println!(
            "{:<54} {:>8} {:>6} {:>8.4} {:>10}",
            p.peer_id, p.step, p.epoch, p.loss_ema, p.last_seen_ms
        );
    }
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
    let addr = api::address(&args.data_dir())?;
    api::post(&addr, "/leave")?;
    if args.json {
        println!("{}", serde_json::json!({"leaving": true}));
    } else {
        println!("the daemon is leaving the run");
    }
    Ok(())
}
