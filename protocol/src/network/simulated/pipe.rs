//! A stream of the simulated network: two directions, each a queue of chunks that become
//! readable once the wire has carried them (the link's bandwidth, one chunk after another) and
//! the link's latency has passed. A writer runs at most [`WINDOW`] bytes ahead of the wire, as
//! a TCP sender runs ahead by its window, so that writing takes about as long as sending.

use std::collections::VecDeque;
use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures::io::{AsyncRead, AsyncWrite};
use libp2p::PeerId;
use tokio::time::{Instant, Sleep};

use super::{Port, World};

/// How many bytes a writer may have on the way that the wire has not carried yet.
pub(super) const WINDOW: usize = 256 * 1024;
/// The largest piece one write takes: what lets a reader start on a long message early.
const LARGEST_CHUNK: usize = 64 * 1024;

/// One direction of a stream.
#[derive(Debug)]
pub(crate) struct Channel {
    chunks: VecDeque<Chunk>,
    /// When the wire is free to carry the next byte.
    wire_free: Instant,
    /// When the reader sees the end, once the writer closed.
    end: Option<Instant>,
    /// The pair parted: what was on the way is lost.
    broken: bool,
    /// The reading end was dropped: writing is pointless.
    reader_gone: bool,
    reader: Option<Waker>,
}

#[derive(Debug)]
struct Chunk {
    readable: Instant,
    bytes: Vec<u8>,
    read: usize,
}

impl Channel {
    fn new() -> Arc<Mutex<Channel>> {
        Arc::new(Mutex::new(Channel {
            chunks: VecDeque::new(),
            wire_free: Instant::now(),
            end: None,
            broken: false,
            reader_gone: false,
            reader: None,
        }))
    }

    fn wake_reader(&mut self) {
        if let Some(waker) = self.reader.take() {
            waker.wake();
        }
    }
}

fn lock(channel: &Mutex<Channel>) -> MutexGuard<'_, Channel> {
    channel
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Breaks one direction of a stream whose pair parted: its reader gets an error.
pub(super) fn break_channel(channel: &Mutex<Channel>) {
    let mut channel = lock(channel);
    channel.broken = true;
    channel.wake_reader();
}

fn reset() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionReset, "the simulated link broke")
}

/// One end of a stream of the simulated network.
#[derive(Debug)]
pub(crate) struct Pipe {
    world: Weak<Mutex<World>>,
    me: PeerId,
    peer: PeerId,
    /// The link's latency when the stream opened: what an end's close takes to arrive.
    latency: Duration,
    outgoing: Arc<Mutex<Channel>>,
    incoming: Arc<Mutex<Channel>>,
    read_wait: Option<Pin<Box<Sleep>>>,
    write_wait: Option<Pin<Box<Sleep>>>,
}

impl Pipe {
    /// Both ends of a new stream between `a` and `b`, and its two directions, for the network
    /// to break if the pair parts.
    pub(super) fn pair(
        world: Weak<Mutex<World>>,
        a: PeerId,
        b: PeerId,
        latency: Duration,
    ) -> (Pipe, Pipe, [Weak<Mutex<Channel>>; 2]) {
        let (a_to_b, b_to_a) = (Channel::new(), Channel::new());
        let directions = [Arc::downgrade(&a_to_b), Arc::downgrade(&b_to_a)];
        let end = |me, peer, outgoing, incoming| Pipe {
            world: world.clone(),
            me,
            peer,
            latency,
            outgoing,
            incoming,
            read_wait: None,
            write_wait: None,
        };
        let a_end = end(a, b, Arc::clone(&a_to_b), Arc::clone(&b_to_a));
        let b_end = end(b, a, b_to_a, a_to_b);
        (a_end, b_end, directions)
    }
}

/// Waits on `sleep` (made or moved to `until`): ready once `until` has passed.
fn wait_until(sleep: &mut Option<Pin<Box<Sleep>>>, until: Instant, cx: &mut Context<'_>) -> bool {
    let sleep = match sleep {
        Some(sleep) => {
            if sleep.deadline() != until {
                sleep.as_mut().reset(until);
            }
            sleep
        }
        None => sleep.insert(Box::pin(tokio::time::sleep_until(until))),
    };
    sleep.as_mut().poll(cx).is_ready()
}

impl AsyncRead for Pipe {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        loop {
            let next = {
                let mut channel = lock(&this.incoming);
                if channel.broken {
                    return Poll::Ready(Err(reset()));
                }
                let now = Instant::now();
                let next = match channel.chunks.front_mut() {
                    Some(chunk) if chunk.readable <= now => {
                        let n = buf.len().min(chunk.bytes.len() - chunk.read);
                        buf[..n].copy_from_slice(&chunk.bytes[chunk.read..chunk.read + n]);
                        chunk.read += n;
                        if chunk.read == chunk.bytes.len() {
                            channel.chunks.pop_front();
                        }
                        return Poll::Ready(Ok(n));
                    }
                    Some(chunk) => Some(chunk.readable),
                    None => match channel.end {
                        Some(end) if end <= now => return Poll::Ready(Ok(0)),
                        end => end,
                    },
                };
                // A break, or new bytes while nothing is on the way, wakes the reader.
                channel.reader = Some(cx.waker().clone());
                next
            };
            match next {
                Some(at) if wait_until(&mut this.read_wait, at, cx) => continue,
                _ => return Poll::Pending,
            }
        }
    }
}

impl AsyncWrite for Pipe {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let Some(link) = Port::link_now(&this.world, this.me, this.peer) else {
            break_channel(&this.outgoing);
            return Poll::Ready(Err(reset()));
        };
        let per_byte = Duration::from_secs_f64(1.0 / link.bytes_per_second.max(1.0));
        loop {
            let mut channel = lock(&this.outgoing);
            if channel.broken || channel.reader_gone {
                return Poll::Ready(Err(reset()));
            }
            let now = Instant::now();
            let ahead = per_byte.mul_f64(WINDOW as f64);
            if channel.wire_free > now + ahead {
                let until = channel.wire_free - ahead;
                drop(channel);
                if wait_until(&mut this.write_wait, until, cx) {
                    continue;
                }
                return Poll::Pending;
            }
            let n = buf.len().min(LARGEST_CHUNK);
            let sent = channel.wire_free.max(now) + per_byte.mul_f64(n as f64);
            channel.wire_free = sent;
            channel.chunks.push_back(Chunk {
                readable: sent + link.latency,
                bytes: buf[..n].to_vec(),
                read: 0,
            });
            channel.wake_reader();
            return Poll::Ready(Ok(n));
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        if lock(&self.outgoing).broken {
            return Poll::Ready(Err(reset()));
        }
        Poll::Ready(Ok(()))
    }

    fn poll_close(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.close_outgoing();
        Poll::Ready(Ok(()))
    }
}

impl Pipe {
    /// Ends what this end writes: the reader sees the end once the wire has carried the rest.
    fn close_outgoing(&self) {
        let mut channel = lock(&self.outgoing);
        if channel.end.is_none() {
            channel.end = Some(channel.wire_free.max(Instant::now()) + self.latency);
            channel.wake_reader();
        }
    }
}

impl Drop for Pipe {
    /// Dropping an end closes what it wrote, and tells the other end's writes that no one
    /// reads them.
    /// (It never takes the network's lock: a pipe may be dropped while the network holds it.)
    fn drop(&mut self) {
        self.close_outgoing();
        lock(&self.incoming).reader_gone = true;
    }
}
