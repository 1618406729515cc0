//! The client's transport seam (docs/ARCHITECTURE.md, "Transports"): what
//! a connection's reach into the node's memory must do, one call, "name
//! these buffers for the node to read or write". A connection holds one
//! ([`RemoteMemory`], conn.rs), transport.rs runs the remote way of an
//! exchange through it, and RDMA (rdma.rs) is the one implementation; a
//! second transport adds another implementation of these traits, not a
//! branch in exchange.rs.

/// What the node does with named buffers.
#[derive(Clone, Copy)]
pub enum Access {
    /// Reads them (a put's payload: read-only memory may be sent).
    NodeReads,
    /// Writes them (a get's payload).
    NodeWrites,
}

/// One connection's reach into the node for payloads.
pub trait RemoteMemory: Send + Sync {
    /// Names buffers `(address, length)` for the node, registering them as
    /// needed. None: this request goes inline (a small payload, too many
    /// pieces, or a registration that failed).
    fn name(&self, bufs: Vec<(usize, usize)>, access: Access) -> Option<Box<dyn Named>>;
    /// Whether the node takes named buffers in batch items (BATCH_GET and
    /// BATCH_PUT with `ITEM_RDMA`); if not, a batch on this connection goes
    /// as single requests, each naming its own.
    fn batches(&self) -> bool;
}

/// Buffers named for one request, held until it is answered.
pub trait Named: Send {
    /// The names, as the frame carries them (appended to `out`).
    fn encode(&self, out: &mut Vec<u8>);
    /// How many pieces the names are (a batch item names at most
    /// `kv_common::wire::MAX_ITEM_SEGMENTS`).
    fn count(&self) -> usize;
    /// A payload moved through them failed its check: what this transport
    /// remembers of these buffers may be stale (forget it).
    fn stale(self: Box<Self>);
}
