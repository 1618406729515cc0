//! The client's RDMA transport over the `kv-rdma` engine: the rest of the
//! library sees it through [`Fabric`] (the handle's engine and counters),
//! [`Offer`] (whether a node is asked for RDMA), [`Setup`] (a connection's
//! queue pair, docs/PROTOCOL.md §2.8) and [`Remote`], the connection's
//! `remote::RemoteMemory` (the caller's buffers named as segments of the
//! frame, for the node to fill or read).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kv_common::status::Status;
use kv_common::wire::{encode_segments, Segment, MAX_SEGMENTS};
use kv_rdma::bootstrap::{Answer, Endpoint};
use kv_rdma::engine::{Link, PeerAccess, Registration, Runtime};
use kv_rdma::Counters;

use crate::error::OpError;
use crate::options::Options;
use crate::remote::{self, Access, RemoteMemory};

/// Payloads smaller than this go inline even on a connection with a queue
/// pair: a small record costs less over TCP than a registration lookup and
/// a remote write.
pub const RDMA_MIN_PAYLOAD: usize = 16 << 10;

/// A handle's RDMA: the engine when `rdma_devices` named usable devices
/// (else TCP), and its counters (a fallback counts even without an engine).
pub struct Fabric {
    rt: Option<Arc<Runtime>>,
    counters: Arc<Counters>,
}

impl Fabric {
    /// Starts the engine `opts` ask for (none named: TCP, quietly).
    pub fn start(opts: &Options) -> Fabric {
        let counters = Arc::new(Counters::default());
        let rt =
            kv_rdma::start(&opts.rdma, kv_rdma::Role::Client, &counters, opts.rdma_cache_bytes, opts.io_timeout, |l| {
                eprintln!("kvcellar: RDMA: {l}")
            });
        if let Some(rt) = &rt {
            rt.set_logger(Box::new(|l| eprintln!("kvcellar: RDMA: {l}")));
        }
        Fabric { rt, counters }
    }

    /// Over an engine the caller started (its counters are the engine's).
    pub fn over(rt: Arc<Runtime>) -> Fabric {
        Fabric { counters: rt.counters().clone(), rt: Some(rt) }
    }

    /// Whether the handle has an engine (its requests may go by RDMA).
    pub fn is_on(&self) -> bool {
        self.rt.is_some()
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// A node's offer, asked on its first connection.
    pub fn offer(&self) -> Offer {
        Offer { offered: AtomicBool::new(self.rt.is_some()), rt: self.rt.clone() }
    }

    /// Registers `[base, base+len)` with every rail once (a no-op on TCP).
    pub fn pin(&self, base: usize, len: usize) -> Result<(), String> {
        match (&self.rt, len) {
            (Some(rt), 1..) => rt.pin(base, len).map_err(|e| format!("cannot register memory for RDMA: {e}")),
            _ => Ok(()),
        }
    }

    /// Drops what [`Fabric::pin`] registered at `base`: false when nothing
    /// was (always true on TCP).
    pub fn unpin(&self, base: usize) -> bool {
        self.rt.as_ref().is_none_or(|rt| rt.unpin(base))
    }
}

/// Whether one node is asked for RDMA: until it says it offers none.
pub struct Offer {
    rt: Option<Arc<Runtime>>,
    offered: AtomicBool,
}

impl Offer {
    /// The engine to set a connection's queue pair up with, unless the node
    /// offers none or RDMA went off.
    fn asking(&self) -> Option<&Arc<Runtime>> {
        self.rt.as_ref().filter(|rt| self.offered.load(Ordering::Relaxed) && !rt.is_off())
    }

    /// The node answered without RDMA: count it; when `for_good` (it offers
    /// none, or speaks no bootstrap we know) say so once and stop asking;
    /// else (a queue pair could not be set up) only this connection is TCP.
    fn declined(&self, node: &str, why: &str, for_good: bool) {
        if let Some(rt) = &self.rt {
            rt.counters().peer_fallbacks.fetch_add(1, Ordering::Relaxed);
            if for_good && self.offered.swap(false, Ordering::Relaxed) {
                eprintln!("kvcellar: RDMA: node {node} is served over TCP: {why}");
            }
        }
    }
}

impl Offer {
    /// Starts setting up a new connection's queue pair when this node is
    /// asked for RDMA (`node` names it in the log). None: the connection
    /// stays TCP (not asked, or no local queue pair: counted).
    pub fn start(&self, node: &str) -> Option<Setup<'_>> {
        let rt = self.asking()?;
        match rt.link(rt.next_rail(), rt.settings().depth) {
            Ok(link) => Some(Setup { offer: self, mine: link.local().clone(), link: Some(link) }),
            Err(e) => {
                self.declined(node, &format!("no local queue pair: {e}"), false);
                None
            }
        }
    }
}

/// A connection's queue pair being set up: the RDMA_CONNECT exchange
/// (docs/PROTOCOL.md §2.8), whose frames the caller sends and reads.
pub struct Setup<'a> {
    offer: &'a Offer,
    /// The queue pair (taken once connected).
    link: Option<Link>,
    mine: Endpoint,
}

/// What an answer to RDMA_CONNECT settled.
pub enum Answered {
    /// The queue pair is connected: the connection's remote transport.
    Connected(Remote),
    /// Send [`Setup::request`] again (in the older bootstrap version).
    Again,
    /// The connection goes on over TCP (counted, and said once when the
    /// node offers no RDMA at all).
    Tcp,
}

impl Setup<'_> {
    /// The RDMA_CONNECT request's body.
    pub fn request(&self) -> Vec<u8> {
        self.mine.encode_request()
    }

    /// Takes the node's answer (its status and body).
    pub fn answered(&mut self, status: Status, body: &[u8], node: &str) -> Answered {
        if status != Status::Ok {
            let why = format!("RDMA_CONNECT refused: {}", String::from_utf8_lossy(body));
            self.offer.declined(node, &why, true);
            return Answered::Tcp;
        }
        let (why, for_good) = match Answer::decode(body) {
            Ok(Answer::Accepted(theirs)) => match self.link.take() {
                Some(link) => match accept(&link, &theirs) {
                    Ok(()) => return Answered::Connected(Remote { link, batches: theirs.batches }),
                    Err(e) => (e, false),
                },
                None => ("a second answer to RDMA_CONNECT".to_string(), false),
            },
            Ok(Answer::NotOffered(why)) => (why, true),
            Ok(Answer::SetupFailed(why)) => (format!("the node could not set up a queue pair: {why}"), false),
            // A node of an older release: say it again in its version, 2
            // without batch segments (its batches name none), 1 without
            // the read limits either (the queue pair then issues no more
            // READs than the smaller of its own limits).
            Ok(Answer::VersionRefused(v @ (1 | 2))) if v < self.mine.version() => {
                self.mine.batches = false;
                if v == 1 {
                    self.mine.reads = None;
                }
                return Answered::Again;
            }
            Ok(Answer::VersionRefused(v)) => (format!("the node speaks RDMA bootstrap version {v}"), true),
            Err(e) => (e.to_string(), true),
        };
        self.offer.declined(node, &why, for_good);
        Answered::Tcp
    }

    /// The node closed the connection on RDMA_CONNECT (a node from before
    /// RDMA): it is not asked again; the caller connects anew.
    pub fn closed(self, node: &str, e: &OpError) {
        let why = format!("it closed the connection on RDMA_CONNECT ({e}); an older node?");
        self.offer.declined(node, &why, true);
    }
}

fn accept(link: &Link, theirs: &Endpoint) -> Result<(), String> {
    link.connect(theirs).map_err(|e| format!("cannot connect the queue pair: {e}"))
}

/// A connection's queue pair: its reach into the node for payloads, and
/// whether the node takes segments in batch items (bootstrap version 3).
pub struct Remote {
    link: Link,
    batches: bool,
}

impl RemoteMemory for Remote {
    /// Names buffers as segments for the node, registering them as needed
    /// (cached). None: this request goes inline (a small payload, too many
    /// pieces, or a registration that failed).
    fn name(&self, bufs: Vec<(usize, usize)>, access: Access) -> Option<Box<dyn remote::Named>> {
        let total: usize = bufs.iter().map(|b| b.1).sum();
        if total < RDMA_MIN_PAYLOAD || bufs.len() > MAX_SEGMENTS {
            return None;
        }
        let access = match access {
            Access::NodeReads => PeerAccess::Reads,
            Access::NodeWrites => PeerAccess::Writes,
        };
        let rt = self.link.runtime();
        let mut segs = Vec::with_capacity(bufs.len());
        let mut regs = Vec::with_capacity(bufs.len());
        for &(addr, len) in bufs.iter().filter(|b| b.1 > 0) {
            let (s, r) = rt.segment_for(self.link.rail(), addr, len, access).ok()?;
            segs.push(s);
            regs.push(r);
        }
        Some(Box::new(Named { segs, _regs: regs, rt: rt.clone(), ranges: bufs }))
    }

    fn batches(&self) -> bool {
        self.batches
    }
}

/// Buffers named for one request; their registrations are held until it
/// is answered.
struct Named {
    segs: Vec<Segment>,
    _regs: Vec<Registration>,
    rt: Arc<Runtime>,
    ranges: Vec<(usize, usize)>,
}

impl remote::Named for Named {
    /// The segment list, as the frame carries it.
    fn encode(&self, out: &mut Vec<u8>) {
        encode_segments(&self.segs, out);
    }

    fn count(&self) -> usize {
        self.segs.len()
    }

    /// A payload moved through them failed its check: a cached registration
    /// may be stale (the caller freed a buffer and new memory was mapped at
    /// the same address, so the device used the old pages). Forget the
    /// cached ones for these buffers; the retry, inline, and later requests
    /// use the memory there now. Pinned regions (`kv_register_memory`) are
    /// the caller's word.
    fn stale(self: Box<Self>) {
        for &(a, l) in &self.ranges {
            self.rt.invalidate(a, l);
        }
    }
}
