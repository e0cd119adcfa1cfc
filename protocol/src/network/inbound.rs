//! Inbound streams of Murmur's own protocols, queued for the application that accepts them.
//!
//! libp2p-stream, which opens this node's streams, can accept them too, but it holds one
//! inbound stream of a protocol at a time for the application and drops any other that comes
//! meanwhile: two peers whose requests arrived at the same moment lost one, unanswered (an
//! honest exchange failed, a joiner's state request went unserved). This behaviour queues a
//! burst instead ([`QUEUED_STREAMS`] per protocol); the application's own limits then decide,
//! and a flood beyond the queue is dropped here as it was there.
//!
//! A protocol accepted [`Over::Direct`] is not offered on connections through a relay: a peer
//! that opens such a stream over one finds the protocol unsupported before it sends a byte, so
//! parameters never cross a relay whose operator did not agree to carry them (decision 0066).

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::{Ready, ready};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use libp2p::core::transport::PortUse;
use libp2p::core::{Endpoint, InboundUpgrade, Multiaddr, UpgradeInfo, upgrade::DeniedUpgrade};
use libp2p::swarm::handler::{ConnectionEvent, FullyNegotiatedInbound};
use libp2p::swarm::{
    ConnectionDenied, ConnectionHandler, ConnectionHandlerEvent, ConnectionId, FromSwarm,
    NetworkBehaviour, SubstreamProtocol, THandler, THandlerInEvent, THandlerOutEvent, ToSwarm,
};
use libp2p::{PeerId, StreamProtocol};
use tokio::sync::mpsc;

use super::Stream;
use super::reachability::is_relayed;

/// Inbound streams of one protocol waiting for the application to take them.
pub const QUEUED_STREAMS: usize = 32;

/// The streams of one protocol, as they come: who opened each, and the stream.
#[derive(Debug)]
pub struct Incoming(mpsc::Receiver<(PeerId, Stream)>);

impl futures::Stream for Incoming {
    type Item = (PeerId, Stream);

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx)
    }
}

/// The protocol is accepted already, by an [`Incoming`] that is still alive.
#[derive(Debug, thiserror::Error)]
#[error("`{0}` streams are accepted already")]
pub struct AlreadyAccepted(pub StreamProtocol);

/// Over which connections a protocol's streams are taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Over {
    /// Direct connections only, hole-punched ones included: not through a relay.
    Direct,
    /// Any connection, through a relay too.
    Any,
}

/// Where a protocol's streams are put for its [`Incoming`], and over which connections.
#[derive(Debug)]
struct Queue {
    sender: mpsc::Sender<(PeerId, Stream)>,
    over: Over,
}

/// Where each accepted protocol's streams go; shared with every connection's handler.
#[derive(Clone, Debug, Default)]
pub(crate) struct Queues(Arc<Mutex<HashMap<StreamProtocol, Queue>>>);

impl Queues {
    fn lock(&self) -> MutexGuard<'_, HashMap<StreamProtocol, Queue>> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Starts accepting `protocol` over the connections `over` names: its streams go to the
    /// returned [`Incoming`] until it is dropped.
    pub(crate) fn accept(
        &self,
        protocol: StreamProtocol,
        over: Over,
    ) -> Result<Incoming, AlreadyAccepted> {
        let mut queues = self.lock();
        queues.retain(|_, queue| !queue.sender.is_closed());
        if queues.contains_key(&protocol) {
            return Err(AlreadyAccepted(protocol));
        }
        let (sender, incoming) = mpsc::channel(QUEUED_STREAMS);
        queues.insert(protocol, Queue { sender, over });
        Ok(Incoming(incoming))
    }

    /// The protocols accepted now over a connection that is `relayed` or not: what the
    /// connection offers its peer for a new stream.
    pub(crate) fn protocols(&self, relayed: bool) -> Vec<StreamProtocol> {
        let mut queues = self.lock();
        queues.retain(|_, queue| !queue.sender.is_closed());
        queues
            .iter()
            .filter(|(_, queue)| !relayed || queue.over == Over::Any)
            .map(|(protocol, _)| protocol.clone())
            .collect()
    }

    pub(crate) fn queue(&self, peer: PeerId, stream: Stream, protocol: StreamProtocol) {
        let mut queues = self.lock();
        let Some(queue) = queues.get(&protocol) else {
            return; // no longer accepted: the stream is dropped
        };
        match queue.sender.try_send((peer, stream)) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                tracing::debug!(%peer, %protocol, "inbound stream queue full: dropping a stream");
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                queues.remove(&protocol);
            }
        }
    }
}

/// The behaviour: one [`Handler`] per connection, nothing of its own to do.
#[derive(Default)]
pub(crate) struct Behaviour {
    pub(crate) queues: Queues,
}

impl Behaviour {
    /// The handler of a connection to `peer`, whichever side dialled; `relayed` when it runs
    /// through a relay.
    fn handler(&self, peer: PeerId, relayed: bool) -> Handler {
        Handler {
            peer,
            relayed,
            queues: self.queues.clone(),
        }
    }
}

impl NetworkBehaviour for Behaviour {
    type ConnectionHandler = Handler;
    type ToSwarm = Infallible;

    fn handle_established_inbound_connection(
        &mut self,
        _: ConnectionId,
        peer: PeerId,
        local: &Multiaddr,
        _: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        // A connection through a relay comes in on the relayed address this node listens on.
        Ok(self.handler(peer, is_relayed(local)))
    }

    fn handle_established_outbound_connection(
        &mut self,
        _: ConnectionId,
        peer: PeerId,
        addr: &Multiaddr,
        _: Endpoint,
        _: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        Ok(self.handler(peer, is_relayed(addr)))
    }

    fn on_swarm_event(&mut self, _: FromSwarm<'_>) {}

    fn on_connection_handler_event(
        &mut self,
        _: PeerId,
        _: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        match event {}
    }

    fn poll(&mut self, _: &mut Context<'_>) -> Poll<ToSwarm<Self::ToSwarm, THandlerInEvent<Self>>> {
        Poll::Pending
    }
}

/// A connection's side: offers the accepted protocols to each new inbound stream and queues
/// the stream once one is agreed on. It never opens a stream.
pub(crate) struct Handler {
    peer: PeerId,
    /// Through a relay: only the protocols accepted [`Over::Any`] are offered.
    relayed: bool,
    queues: Queues,
}

impl ConnectionHandler for Handler {
    type FromBehaviour = Infallible;
    type ToBehaviour = Infallible;
    type InboundProtocol = Accepted;
    type OutboundProtocol = DeniedUpgrade;
    type InboundOpenInfo = ();
    type OutboundOpenInfo = ();

    fn listen_protocol(&self) -> SubstreamProtocol<Self::InboundProtocol> {
        SubstreamProtocol::new(Accepted(self.queues.protocols(self.relayed)), ())
    }

    fn poll(
        &mut self,
        _: &mut Context<'_>,
    ) -> Poll<ConnectionHandlerEvent<Self::OutboundProtocol, (), Self::ToBehaviour>> {
        Poll::Pending
    }

    fn on_behaviour_event(&mut self, event: Self::FromBehaviour) {
        match event {}
    }

    fn on_connection_event(
        &mut self,
        event: ConnectionEvent<'_, Self::InboundProtocol, Self::OutboundProtocol>,
    ) {
        if let ConnectionEvent::FullyNegotiatedInbound(FullyNegotiatedInbound {
            protocol: (stream, protocol),
            ..
        }) = event
        {
            self.queues.queue(self.peer, stream.into(), protocol);
        }
    }
}

/// The upgrade of an inbound stream: any protocol accepted, the stream as it is.
pub(crate) struct Accepted(Vec<StreamProtocol>);

impl UpgradeInfo for Accepted {
    type Info = StreamProtocol;
    type InfoIter = std::vec::IntoIter<StreamProtocol>;

    fn protocol_info(&self) -> Self::InfoIter {
        self.0.clone().into_iter()
    }
}

impl InboundUpgrade<libp2p::Stream> for Accepted {
    type Output = (libp2p::Stream, StreamProtocol);
    type Error = Infallible;
    type Future = Ready<Result<Self::Output, Self::Error>>;

    fn upgrade_inbound(self, stream: libp2p::Stream, protocol: Self::Info) -> Self::Future {
        ready(Ok((stream, protocol)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_protocol_taken_only_directly_is_not_offered_through_a_relay() {
        let queues = Queues::default();
        let params = StreamProtocol::new("/test/params/1");
        let control = StreamProtocol::new("/test/control/1");
        let _params_in = queues
            .accept(params.clone(), Over::Direct)
            .expect("accepted");
        let _control_in = queues.accept(control.clone(), Over::Any).expect("accepted");

        let direct = queues.protocols(false);
        assert_eq!(direct.len(), 2);
        assert!(direct.contains(&params) && direct.contains(&control));
        assert_eq!(queues.protocols(true), vec![control]);
    }
}
