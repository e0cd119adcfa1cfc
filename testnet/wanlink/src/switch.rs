//! The switch: the hub of the testnet's star, one port per peer. Frames are forwarded like a
//! learning bridge does (to the port a MAC was last seen on; broadcast, multicast and unknown
//! destinations to every other port), each after its path's delay and loss.

use std::collections::HashMap;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use pnet_datalink::{Channel, Config, DataLinkSender, NetworkInterface};

use crate::delay_line::DelayLine;
use crate::profile::Profile;

/// A port of the switch: the hub's end of one peer's veth pair, and that peer's link profile.
#[derive(Clone, Debug)]
pub struct Port {
    pub interface: String,
    pub profile: Profile,
}

type Mac = [u8; 6];

/// Where frames go: the port each source MAC was last seen on.
#[derive(Debug, Default)]
pub struct Forwarding {
    learned: HashMap<Mac, usize>,
}

impl Forwarding {
    /// The ports a frame that came in on `from` goes out of (none for a runt).
    pub fn route(&mut self, from: usize, frame: &[u8], ports: usize) -> Vec<usize> {
        if frame.len() < 14 {
            return Vec::new();
        }
        let mut destination: Mac = [0; 6];
        let mut source: Mac = [0; 6];
        destination.copy_from_slice(&frame[0..6]);
        source.copy_from_slice(&frame[6..12]);
        // Group addresses (broadcast, multicast) have the low bit of the first octet set.
        if source[0] & 1 == 0 {
            self.learned.insert(source, from);
        }
        match self.learned.get(&destination) {
            Some(&to) if destination[0] & 1 == 0 => {
                if to == from {
                    Vec::new()
                } else {
                    vec![to]
                }
            }
            _ => (0..ports).filter(|&p| p != from).collect(),
        }
    }
}

/// A frame taken off a port.
struct Received {
    port: usize,
    at: Instant,
    frame: Vec<u8>,
}

/// Opens every port, prints `ready`, and forwards until the process is killed. Frames larger
/// than `max_frame` bytes are dropped (the links' offloads must be off: see testnet/netns.sh).
pub fn run(ports: &[Port], seed: u64, max_frame: usize) -> Result<()> {
    if ports.len() < 2 {
        bail!("a switch needs at least two ports, got {}", ports.len());
    }
    let interfaces = pnet_datalink::interfaces();
    let (to_line, from_ports) = mpsc::sync_channel::<Received>(4096);
    let mut senders: Vec<Box<dyn DataLinkSender>> = Vec::new();
    for (index, port) in ports.iter().enumerate() {
        let interface = find(&interfaces, &port.interface)?;
        let config = Config {
            read_buffer_size: max_frame + 64,
            write_buffer_size: max_frame + 64,
            promiscuous: true,
            ..Config::default()
        };
        let (tx, mut rx) = match pnet_datalink::channel(interface, config)
            .with_context(|| format!("opening a raw socket on {} (root needed)", port.interface))?
        {
            Channel::Ethernet(tx, rx) => (tx, rx),
            _ => bail!("{} is not an Ethernet link", port.interface),
        };
        senders.push(tx);
        let to_line = to_line.clone();
        thread::Builder::new()
            .name(format!("port-{}", port.interface))
            .spawn(move || {
                loop {
                    match rx.next() {
                        Ok(frame) if frame.len() <= max_frame => {
                            let received = Received {
                                port: index,
                                at: Instant::now(),
                                frame: frame.to_vec(),
                            };
                            if to_line.send(received).is_err() {
                                return;
                            }
                        }
                        Ok(_) => {}
                        Err(e) => {
                            eprintln!("wanlink: reading port {index}: {e}");
                            return;
                        }
                    }
                }
            })?;
    }
    drop(to_line);
    println!("ready: {} ports", ports.len());
    forward(ports, seed, &from_ports, &mut senders)
}

fn find<'a>(interfaces: &'a [NetworkInterface], name: &str) -> Result<&'a NetworkInterface> {
    interfaces
        .iter()
        .find(|i| i.name == name)
        .with_context(|| format!("no interface named {name} in this network namespace"))
}

/// The switch's loop: takes frames in, lets them out when due.
fn forward(
    ports: &[Port],
    seed: u64,
    from_ports: &mpsc::Receiver<Received>,
    senders: &mut [Box<dyn DataLinkSender>],
) -> Result<()> {
    let mut forwarding = Forwarding::default();
    let mut line = DelayLine::new(seed);
    loop {
        let now = Instant::now();
        while let Some(due) = line.pop_due(now) {
            // A full queue on the port's rate limiter drops the frame, as a router would.
            let _ = senders[due.port].send_to(&due.frame, None);
        }
        let wait = line.next_due().map_or(Duration::from_secs(1), |due| {
            due.saturating_duration_since(now)
        });
        match from_ports.recv_timeout(wait) {
            Ok(received) => {
                for to in forwarding.route(received.port, &received.frame, ports.len()) {
                    let (from, to_profile) = (&ports[received.port].profile, &ports[to].profile);
                    let delay = Duration::from_secs_f64(from.path_delay_ms(to_profile) / 1000.0);
                    line.send(
                        received.at,
                        to,
                        received.frame.clone(),
                        delay,
                        from.path_loss(to_profile),
                    );
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => bail!("every port stopped reading"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(to: Mac, from: Mac) -> Vec<u8> {
        let mut f = to.to_vec();
        f.extend_from_slice(&from);
        f.extend_from_slice(&[0x08, 0x00, 0, 0]);
        f
    }

    #[test]
    fn learned_macs_get_unicast_and_the_rest_is_flooded() {
        let (a, b, c) = ([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2], [2, 0, 0, 0, 0, 3]);
        let broadcast = [0xff; 6];
        let mut fw = Forwarding::default();
        // Nothing learned yet: an unknown destination goes everywhere but back.
        assert_eq!(fw.route(0, &frame(b, a), 3), vec![1, 2]);
        // b answers a: a was learned on port 0.
        assert_eq!(fw.route(1, &frame(a, b), 3), vec![0]);
        assert_eq!(fw.route(0, &frame(b, a), 3), vec![1]);
        assert_eq!(fw.route(2, &frame(broadcast, c), 3), vec![0, 1]);
        let multicast = [0x01, 0x00, 0x5e, 0, 0, 0xfb];
        assert_eq!(fw.route(1, &frame(multicast, b), 3), vec![0, 2]);
        // A frame for a MAC on its own port goes nowhere; a runt too.
        assert_eq!(fw.route(1, &frame(b, c), 3), Vec::<usize>::new());
        assert_eq!(fw.route(1, &[0; 10], 3), Vec::<usize>::new());
    }
}
