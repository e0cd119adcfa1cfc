//! Measures a link end to end: `serve` on one peer, `rtt`, `throughput` or `loss` from another.
//! `mapping` and `punch` try what a NAT in the path does (testnet/nat.sh). Each client prints one
//! JSON line.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;

/// What the first byte of a TCP connection asks the server for.
const ECHO: u8 = b'e';
const SINK: u8 = b's';

/// Every read and write of a probe gives up after this long: a probe never hangs.
const IO_DEADLINE: Duration = Duration::from_secs(30);

/// A UDP datagram that asks the server for the address it came from (a loss probe's datagrams
/// are eight bytes, so they never read as this).
const WHO_AM_I: &[u8] = b"who am i?";
/// What two punching peers send each other.
const PUNCH: &[u8] = b"punch";

/// Serves probes on `listen` (TCP: echo and sink; UDP: echo) until killed.
pub fn serve(listen: SocketAddr) -> Result<()> {
    let tcp = TcpListener::bind(listen).with_context(|| format!("listening on {listen}"))?;
    let udp = UdpSocket::bind(listen).with_context(|| format!("binding UDP {listen}"))?;
    thread::spawn(move || {
        let mut buffer = [0u8; 2048];
        while let Ok((len, from)) = udp.recv_from(&mut buffer) {
            if &buffer[..len] == WHO_AM_I {
                let _ = udp.send_to(from.to_string().as_bytes(), from);
            } else {
                let _ = udp.send_to(&buffer[..len], from);
            }
        }
    });
    println!("serving on {listen}");
    for stream in tcp.incoming() {
        let Ok(stream) = stream else { continue };
        thread::spawn(move || {
            if let Err(e) = answer(stream) {
                eprintln!("wanlink probe: {e:#}");
            }
        });
    }
    Ok(())
}

fn answer(mut stream: TcpStream) -> Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(IO_DEADLINE))?;
    let mut mode = [0u8];
    stream.read_exact(&mut mode)?;
    match mode[0] {
        ECHO => {
            let mut byte = [0u8];
            while stream.read(&mut byte)? == 1 {
                stream.write_all(&byte)?;
            }
        }
        SINK => {
            let mut buffer = vec![0u8; 64 * 1024];
            let mut total = 0u64;
            loop {
                let n = stream.read(&mut buffer)?;
                if n == 0 {
                    break;
                }
                total += n as u64;
            }
            stream.write_all(&total.to_le_bytes())?;
        }
        other => bail!("unknown probe mode {other}"),
    }
    Ok(())
}

fn connect(to: SocketAddr, mode: u8) -> Result<TcpStream> {
    let mut stream = TcpStream::connect_timeout(&to, IO_DEADLINE)
        .with_context(|| format!("connecting to the probe server at {to}"))?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(IO_DEADLINE))?;
    stream.set_write_timeout(Some(IO_DEADLINE))?;
    stream.write_all(&[mode])?;
    Ok(stream)
}

/// Round trips of one byte over TCP.
#[derive(Debug, Serialize)]
pub struct Rtt {
    pub samples: usize,
    pub median_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
}

pub fn rtt(to: SocketAddr, count: usize) -> Result<Rtt> {
    let mut stream = connect(to, ECHO)?;
    let mut samples = Vec::with_capacity(count);
    let mut byte = [0u8];
    for i in 0..count {
        let started = Instant::now();
        stream.write_all(&[i as u8])?;
        stream
            .read_exact(&mut byte)
            .context("waiting for an echo")?;
        samples.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    samples.sort_by(f64::total_cmp);
    Ok(Rtt {
        samples: count,
        median_ms: samples[count / 2],
        min_ms: samples[0],
        max_ms: samples[count - 1],
    })
}

/// A bulk TCP transfer, timed until the server has counted every byte.
#[derive(Debug, Serialize)]
pub struct Throughput {
    pub bytes: u64,
    pub seconds: f64,
    pub mbit_per_s: f64,
}

pub fn throughput(to: SocketAddr, bytes: u64) -> Result<Throughput> {
    let mut stream = connect(to, SINK)?;
    let chunk = vec![0x5au8; 64 * 1024];
    let started = Instant::now();
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        stream.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    stream.shutdown(std::net::Shutdown::Write)?;
    let mut counted = [0u8; 8];
    stream
        .read_exact(&mut counted)
        .context("waiting for the server's count")?;
    let seconds = started.elapsed().as_secs_f64();
    let counted = u64::from_le_bytes(counted);
    if counted != bytes {
        bail!("the server counted {counted} bytes of {bytes}");
    }
    Ok(Throughput {
        bytes,
        seconds,
        mbit_per_s: bytes as f64 * 8.0 / seconds / 1e6,
    })
}

/// UDP datagrams echoed: each crosses the link twice, so `1 - (1 - p)^2` of them are lost on
/// a path that loses `p` each way.
#[derive(Debug, Serialize)]
pub struct Loss {
    pub sent: usize,
    pub echoed: usize,
    /// The one-way loss that explains the echoes: `1 - sqrt(echoed / sent)`.
    pub one_way_loss_pct: f64,
}

pub fn loss(to: SocketAddr, count: usize, gap: Duration) -> Result<Loss> {
    let socket = UdpSocket::bind(if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" })?;
    socket.connect(to)?;
    let receiver = socket.try_clone()?;
    // Echoes are counted until none has come for this long after the last datagram went out.
    receiver.set_read_timeout(Some(Duration::from_secs(2)))?;
    let counter = thread::spawn(move || {
        let mut seen = std::collections::HashSet::new();
        let mut buffer = [0u8; 64];
        while let Ok(n) = receiver.recv(&mut buffer) {
            if n == 8 {
                seen.insert(u64::from_le_bytes(
                    buffer[..8].try_into().unwrap_or_default(),
                ));
            }
        }
        seen.len()
    });
    for i in 0..count as u64 {
        socket.send(&i.to_le_bytes())?;
        thread::sleep(gap);
    }
    let echoed = counter
        .join()
        .map_err(|_| anyhow::anyhow!("the echo counter panicked"))?;
    Ok(Loss {
        sent: count,
        echoed,
        one_way_loss_pct: (1.0 - (echoed as f64 / count as f64).sqrt()) * 100.0,
    })
}

/// The public addresses one UDP socket is seen from by two servers. A NAT that maps a socket to
/// one public port whatever it sends to (endpoint-independent, as home routers do) shows the
/// same address to both; a symmetric one shows two.
#[derive(Debug, Serialize)]
pub struct Mapping {
    pub local_port: u16,
    pub seen_as: Vec<String>,
    pub endpoint_independent: bool,
}

pub fn mapping(servers: &[SocketAddr], port: u16) -> Result<Mapping> {
    let socket =
        UdpSocket::bind(("0.0.0.0", port)).with_context(|| format!("binding UDP port {port}"))?;
    socket.set_read_timeout(Some(Duration::from_millis(200)))?;
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut seen_as = Vec::new();
    let mut buffer = [0u8; 128];
    for &server in servers {
        // UDP may lose the question or the answer: ask again until the deadline.
        let seen = loop {
            if Instant::now() > deadline {
                bail!("no answer from the probe server at {server} within 5 s");
            }
            socket.send_to(WHO_AM_I, server)?;
            match socket.recv_from(&mut buffer) {
                Ok((len, from)) if from == server => {
                    break String::from_utf8_lossy(&buffer[..len]).into_owned();
                }
                _ => continue,
            }
        };
        seen_as.push(seen);
    }
    let endpoint_independent = seen_as.windows(2).all(|pair| pair[0] == pair[1]);
    Ok(Mapping {
        local_port: socket.local_addr()?.port(),
        seen_as,
        endpoint_independent,
    })
}

/// A UDP hole punch: both peers send to each other's public address from their own port at
/// the same time, each packet out opening the sender's NAT for the other's.
#[derive(Debug, Serialize)]
pub struct Punch {
    pub reached: bool,
    /// From the first packet out to the first packet in from the peer.
    pub after_ms: Option<f64>,
}

/// Punches towards `peer` from `port` for up to `within`. Once a packet has come through, a few
/// more go out, so that the peer, whose first packets may have hit this side's NAT before it
/// was open, gets one through too.
pub fn punch(peer: SocketAddr, port: u16, within: Duration) -> Result<Punch> {
    let socket =
        UdpSocket::bind(("0.0.0.0", port)).with_context(|| format!("binding UDP port {port}"))?;
    socket.set_read_timeout(Some(Duration::from_millis(50)))?;
    let started = Instant::now();
    let mut buffer = [0u8; 64];
    while started.elapsed() < within {
        socket.send_to(PUNCH, peer)?;
        if let Ok((len, from)) = socket.recv_from(&mut buffer)
            && from == peer
            && &buffer[..len] == PUNCH
        {
            let after_ms = started.elapsed().as_secs_f64() * 1000.0;
            for _ in 0..5 {
                socket.send_to(PUNCH, peer)?;
                thread::sleep(Duration::from_millis(20));
            }
            return Ok(Punch {
                reached: true,
                after_ms: Some(after_ms),
            });
        }
    }
    Ok(Punch {
        reached: false,
        after_ms: None,
    })
}
