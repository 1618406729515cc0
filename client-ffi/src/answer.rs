//! Reading a GET's answer into the caller's buffers: a single GET's body
//! and a BATCH_GET answer's items, on either socket (conn.rs). Every reader
//! checks the page header and key against what was asked
//! ([`check_get_head`]) and moves payload bytes only into what
//! [`PayloadSink`] gives, so the segment walk and the CRC live here once;
//! the payload goes from the socket straight into the caller's buffers and
//! its CRC is taken as it lands (no page-sized buffer, no second pass).

use kv_common::driver::{self, Socket};
use kv_common::page::{Geometry, PageHeader, HEADER_LEN};
use kv_common::status::Status;
use kv_common::wire::{self, ItemHead, RspHeader, BATCH_ITEM_HEAD};

use crate::conn::Conn;
use crate::error::OpError;

/// Largest error/answer body read into memory (anything else is a record).
pub(crate) const MAX_SMALL_ANSWER: u32 = 1 << 20;

/// What a get produced.
#[derive(Debug)]
pub struct GetReply {
    /// Ok, or why not served.
    pub status: Status,
    /// Payload bytes written (Ok), or the size needed (TooSmall).
    pub len: usize,
    /// On a hit: the spread the node marked the key hot with (0: not hot;
    /// docs/PROTOCOL.md §2.3, §2.5).
    pub spread: u8,
}

/// Reads and discards `n` bytes (to keep a pipelined connection in step).
pub(crate) async fn drain<S: Socket>(conn: &mut Conn<S>, n: u64) -> Result<(), OpError> {
    Ok(conn.link.skip(n).await?)
}

/// What a batch item's answer leaves to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Follow {
    /// Nothing: the reply is the item's.
    Done,
    /// Ask for the item again on its own ([`wire::ITEM_AGAIN`]).
    Again,
    /// The payload placed in its named buffers failed its CRC: the names
    /// may be stale (forget them) and the item is asked again inline.
    Stale,
    /// Its buffers were named but the record came inline (the node's
    /// queue pair is gone): this connection names no more.
    Unplaced,
}

/// The header and key that answer a get whose payload the node placed in
/// the named buffers (or that found them too small): checked as a get's
/// are, against what was asked. Err: the reply.
pub(crate) fn check_placed_head(geo: &Geometry, key: &[u8], body: &[u8]) -> Result<PageHeader, GetReply> {
    let no = |status| Err(GetReply { status, len: 0, spread: 0 });
    let Ok(ph) = PageHeader::decode(body) else { return no(Status::Corrupt) };
    if body.len() != HEADER_LEN + key.len()
        || ph.key_len as usize != key.len()
        || ph.check_key(key).is_err()
        || &body[HEADER_LEN..] != key
        || !geo.matches(&ph)
    {
        return no(Status::Mismatch);
    }
    Ok(ph)
}

/// The payload the node placed in `bufs` for a page of header `ph`: a hit
/// when it fits and matches its CRC, else Corrupt (the names may be stale).
pub(crate) fn check_placed(bufs: &mut [&mut [u8]], ph: &PageHeader) -> GetReply {
    let need = ph.payload_len as usize;
    let corrupt = GetReply { status: Status::Corrupt, len: 0, spread: 0 };
    if need > bufs.iter().map(|b| b.len()).sum::<usize>() {
        return corrupt;
    }
    // The device wrote the buffers before the node answered; order this
    // thread's reads after that answer.
    std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
    if !PayloadSink::new(bufs, need).placed(ph.payload_crc) {
        return corrupt;
    }
    GetReply { status: Status::Ok, len: need, spread: 0 }
}

/// One item of a BATCH_GET answer, leaving `rd` at the next item, and what
/// it leaves to do. `named`: the item named its buffers for the node
/// ([`wire::ITEM_RDMA`]).
pub(crate) async fn read_item<S: Socket>(
    rd: &mut FrameReader<'_, S>,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
    named: bool,
) -> Result<(GetReply, Follow), OpError> {
    let done = |status, len| Ok((GetReply { status, len, spread: 0 }, Follow::Done));
    let head = HEADER_LEN + key.len();
    // The item's head and, for a hit, the page header and key: one read
    // when the socket has them (a miss leaves the next items' bytes
    // buffered, never more than this).
    rd.fill(BATCH_ITEM_HEAD + head).await?;
    let mut ib = [0u8; BATCH_ITEM_HEAD];
    rd.exact(&mut ib).await?;
    let ih = ItemHead::decode(&ib);
    if named && ih.flags & wire::ITEM_PLACED != 0 && matches!(ih.status, Status::Ok | Status::TooSmall) {
        // The payload is in the buffers (or they are too small for it):
        // the item's bytes are the header and key.
        if ih.len as usize != head {
            return Err(OpError::Protocol(format!("placed batch item of {} bytes", ih.len)));
        }
        let mut hk = [0u8; HEADER_LEN + kv_common::page::MAX_KEY_LEN];
        rd.exact(&mut hk[..head]).await?;
        let ph = match check_placed_head(geo, key, &hk[..head]) {
            Ok(ph) => ph,
            Err(r) => return Ok((r, Follow::Done)),
        };
        if ih.status == Status::TooSmall {
            return done(Status::TooSmall, ph.payload_len as usize);
        }
        let mut r = check_placed(bufs, &ph);
        let follow = if r.status == Status::Ok { Follow::Done } else { Follow::Stale };
        r.spread = item_spread(&ih, r.status);
        return Ok((r, follow));
    }
    if ih.status != Status::Ok {
        if ih.len > MAX_SMALL_ANSWER {
            return Err(OpError::Protocol(format!("unexpected {}-byte item answer", ih.len)));
        }
        let mut msg = vec![0u8; ih.len as usize];
        rd.exact(&mut msg).await?;
        if ih.status == Status::Rejected && ih.flags & wire::ITEM_AGAIN != 0 {
            return Ok((GetReply { status: Status::Rejected, len: 0, spread: 0 }, Follow::Again));
        }
        return match ih.status {
            Status::Miss | Status::Mismatch => done(ih.status, 0),
            s => done(OpError::refused(s, &msg).status(), 0),
        };
    }
    let len = u64::from(ih.len);
    if len < head as u64 {
        rd.skip(len).await?;
        return done(Status::Corrupt, 0);
    }
    let mut hk = [0u8; HEADER_LEN + kv_common::page::MAX_KEY_LEN];
    rd.exact(&mut hk[..head]).await?;
    let cap: usize = bufs.iter().map(|b| b.len()).sum();
    // Named buffers answered with the record inline: the node's queue
    // pair for this connection is gone.
    let follow = if named { Follow::Unplaced } else { Follow::Done };
    let ph = match check_get_head(geo, key, len, &hk[..head], cap) {
        Ok(ph) => ph,
        Err(r) => {
            rd.skip(len - head as u64).await?;
            return Ok((r, follow));
        }
    };
    let need = ph.payload_len as usize;
    let mut sink = PayloadSink::new(bufs, need);
    while let Some(dst) = sink.next() {
        let n = rd.some(dst).await?;
        sink.filled(n);
    }
    if !sink.verify(ph.payload_crc) {
        return Ok((GetReply { status: Status::Corrupt, len: 0, spread: 0 }, follow));
    }
    Ok((GetReply { status: Status::Ok, len: need, spread: item_spread(&ih, Status::Ok) }, follow))
}

/// The spread a BATCH_GET answer's item marks its key hot with (0: not).
fn item_spread(ih: &ItemHead, status: Status) -> u8 {
    if status == Status::Ok && ih.flags & wire::ITEM_HOT != 0 {
        ih.spread
    } else {
        0
    }
}

/// The body of one answer frame on its way in, through the connection's
/// buffer (kv_common::driver): an item's heads (its own, the page header,
/// the key) come with one read when the socket has them, and a payload
/// goes from the socket straight into its buffers. It never takes past
/// the frame's end (the next frame may answer another request).
pub(crate) struct FrameReader<'s, S> {
    pub(crate) link: &'s mut driver::Conn<S>,
    /// Bytes of the frame not yet taken.
    pub(crate) left: u64,
}

impl<S: Socket> FrameReader<'_, S> {
    /// Whether the whole frame was taken.
    pub(crate) fn done(&self) -> bool {
        self.left == 0
    }

    fn short() -> OpError {
        OpError::Protocol("batch answer shorter than its items".into())
    }

    /// Has the connection's buffer hold the frame's next `n` bytes (at most
    /// what the frame has left), reading no more than that takes.
    pub(crate) async fn fill(&mut self, n: usize) -> Result<(), OpError> {
        let n = n.min(usize::try_from(self.left).unwrap_or(usize::MAX));
        Ok(self.link.fill(n, n).await?)
    }

    /// Some bytes into `dst`: from the buffer if it holds any, else one
    /// read straight from the socket.
    async fn some(&mut self, dst: &mut [u8]) -> Result<usize, OpError> {
        let n = dst.len().min(usize::try_from(self.left).unwrap_or(usize::MAX));
        if n == 0 {
            return Err(Self::short());
        }
        let got = self.link.some(&mut dst[..n]).await?;
        self.left -= got as u64;
        Ok(got)
    }

    /// Fills all of `dst`.
    pub(crate) async fn exact(&mut self, dst: &mut [u8]) -> Result<(), OpError> {
        if dst.len() as u64 > self.left {
            return Err(Self::short());
        }
        self.link.exact(dst).await?;
        self.left -= dst.len() as u64;
        Ok(())
    }

    /// Reads and drops `n` bytes.
    async fn skip(&mut self, n: u64) -> Result<(), OpError> {
        if n > self.left {
            return Err(Self::short());
        }
        self.link.skip(n).await?;
        self.left -= n;
        Ok(())
    }
}

/// Checks the page header and key that open a get's answer of `body_len`
/// bytes (`hk`: the header, then as many bytes as `key` has) against what
/// was asked: Ok(header) when its payload fits in `cap` bytes, else the
/// reply the item gets (the caller drains the rest of the body).
pub(crate) fn check_get_head(
    geo: &Geometry,
    key: &[u8],
    body_len: u64,
    hk: &[u8],
    cap: usize,
) -> Result<PageHeader, GetReply> {
    let no = |status, len| Err(GetReply { status, len, spread: 0 });
    let mut hb = [0u8; HEADER_LEN];
    hb.copy_from_slice(&hk[..HEADER_LEN]);
    let ph = match PageHeader::decode(&hb) {
        Ok(ph) if ph.record_len() == body_len => ph,
        _ => return no(Status::Corrupt, 0),
    };
    if ph.key_len as usize != key.len() || ph.check_key(key).is_err() || !geo.matches(&ph) || &hk[HEADER_LEN..] != key {
        return no(Status::Mismatch, 0);
    }
    if ph.payload_len as usize > cap {
        return no(Status::TooSmall, ph.payload_len as usize);
    }
    Ok(ph)
}

/// A GET's payload on its way into the caller's segments: `need` bytes
/// (at most the segments' room: [`check_get_head`] made sure), in order,
/// its CRC taken as the bytes arrive. Every reader of a GET answer (the
/// async core's, the caller-thread path's, the RDMA check of bytes already
/// placed) moves bytes only into what [`PayloadSink::next`] gives, so the
/// segment walk and the CRC live here once.
pub(crate) struct PayloadSink<'s, 'b> {
    bufs: &'s mut [&'b mut [u8]],
    seg: usize,
    at: usize,
    left: usize,
    crc: crc32fast::Hasher,
}

impl<'s, 'b> PayloadSink<'s, 'b> {
    pub(crate) fn new(bufs: &'s mut [&'b mut [u8]], need: usize) -> PayloadSink<'s, 'b> {
        PayloadSink { bufs, seg: 0, at: 0, left: need, crc: crc32fast::Hasher::new() }
    }

    /// Where the next bytes of the payload go (None: all of it is in).
    pub(crate) fn next(&mut self) -> Option<&mut [u8]> {
        if self.left == 0 {
            return None;
        }
        while self.at >= self.bufs.get(self.seg)?.len() {
            self.seg += 1;
            self.at = 0;
        }
        let seg = &mut self.bufs[self.seg];
        let end = seg.len().min(self.at + self.left);
        Some(&mut seg[self.at..end])
    }

    /// `n` bytes were written at the start of what [`PayloadSink::next`] gave.
    pub(crate) fn filled(&mut self, n: usize) {
        let seg = &self.bufs[self.seg];
        self.crc.update(&seg[self.at..self.at + n]);
        self.at += n;
        self.left -= n;
    }

    /// Whether the whole payload came and matches the page header's CRC.
    pub(crate) fn verify(self, crc: u32) -> bool {
        self.left == 0 && self.crc.finalize() == crc
    }

    /// The payload is already in the segments (RDMA placed it): whether it
    /// matches the page header's CRC.
    pub(crate) fn placed(mut self, crc: u32) -> bool {
        while let Some(n) = self.next().map(|d| d.len()) {
            self.filled(n);
        }
        self.verify(crc)
    }
}

/// A payload's reads into one segment are at most this long, so its CRC
/// is taken over bytes that just landed (still in the cache).
const PAYLOAD_CHUNK: usize = 256 << 10;

/// The body of one GET answer (its header `h` read), into `bufs`, leaving
/// the connection at the next frame.
pub(crate) async fn read_get_body<S: Socket>(
    conn: &mut Conn<S>,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
    h: &RspHeader,
) -> Result<GetReply, OpError> {
    let done = |status, len| Ok(GetReply { status, len, spread: 0 });
    if h.status != Status::Ok {
        let body = conn.answer_body(h, MAX_SMALL_ANSWER).await?;
        return match h.status {
            Status::Miss | Status::Mismatch => done(h.status, 0),
            // The answer was read whole: this item alone is not served (a
            // node's internal failure reads as unavailable, never negative).
            s => done(OpError::refused(s, &body).status(), 0),
        };
    }
    let body_len = h.body_len as u64;
    let head = HEADER_LEN + key.len();
    if body_len < head as u64 {
        drain(conn, body_len).await?;
        return done(Status::Corrupt, 0);
    }
    // The page header and the key in one read (the key's length is the
    // one asked for; a body at least that long holds both).
    let mut hk = [0u8; HEADER_LEN + kv_common::page::MAX_KEY_LEN];
    conn.link.exact(&mut hk[..head]).await?;
    let cap: usize = bufs.iter().map(|b| b.len()).sum();
    let ph = match check_get_head(geo, key, body_len, &hk[..head], cap) {
        Ok(ph) => ph,
        Err(r) => {
            drain(conn, body_len - head as u64).await?;
            return Ok(r);
        }
    };
    let need = ph.payload_len as usize;
    let mut sink = PayloadSink::new(bufs, need);
    while let Some(dst) = sink.next() {
        let k = dst.len().min(PAYLOAD_CHUNK);
        let dst = &mut dst[..k];
        // The bytes that came with the heads, then the rest straight from
        // the socket (on a blocking socket one call a chunk, MSG_WAITALL).
        let n = if conn.link.buffered() > 0 {
            conn.link.some(dst).await?
        } else {
            conn.link.exact(dst).await?;
            k
        };
        sink.filled(n);
    }
    if !sink.verify(ph.payload_crc) {
        return done(Status::Corrupt, 0);
    }
    Ok(GetReply { status: Status::Ok, len: need, spread: wire::spread_of_flags(h.flags) })
}

#[cfg(test)]
mod tests {
    use super::PayloadSink;

    /// Writes `payload` through a sink over segments of `sizes` bytes, `chunk`
    /// bytes a read at most: (the segments, whether the CRC matched).
    fn through(sizes: &[usize], payload: &[u8], chunk: usize, crc: u32) -> (Vec<Vec<u8>>, bool) {
        let mut segs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
        let mut bufs: Vec<&mut [u8]> = segs.iter_mut().map(|s| s.as_mut_slice()).collect();
        let mut sink = PayloadSink::new(&mut bufs, payload.len());
        let mut at = 0;
        while let Some(dst) = sink.next() {
            let n = dst.len().min(chunk);
            dst[..n].copy_from_slice(&payload[at..at + n]);
            at += n;
            sink.filled(n);
        }
        assert_eq!(at, payload.len(), "every byte asked for");
        let ok = sink.verify(crc);
        (segs, ok)
    }

    #[test]
    fn a_payload_fills_the_segments_in_order_across_empty_ones_and_reads_of_any_size() {
        let payload: Vec<u8> = (1..=9).collect();
        let crc = crc32fast::hash(&payload);
        for chunk in [1, 2, 4, 64] {
            let (segs, ok) = through(&[3, 0, 4, 5], &payload, chunk, crc);
            assert!(ok, "chunk {chunk}");
            assert_eq!(segs, vec![vec![1, 2, 3], vec![], vec![4, 5, 6, 7], vec![8, 9, 0, 0, 0]], "chunk {chunk}");
        }
        assert!(!through(&[9], &payload, 4, crc ^ 1).1, "another CRC is refused");
        assert!(through(&[4], &[], 4, 0).1, "an empty payload");
    }

    #[test]
    fn bytes_already_placed_are_checked_and_a_short_room_never_passes() {
        let payload: Vec<u8> = (1..=6).collect();
        let crc = crc32fast::hash(&payload);
        let (mut a, mut b) = (payload[..2].to_vec(), [payload[2..].to_vec(), vec![7, 7]].concat());
        let mut bufs: Vec<&mut [u8]> = vec![&mut a, &mut b];
        assert!(PayloadSink::new(&mut bufs, 6).placed(crc), "the room's tail is not part of the payload");
        let mut short = [0u8; 4];
        let mut bufs: Vec<&mut [u8]> = vec![&mut short];
        assert!(!PayloadSink::new(&mut bufs, 6).placed(crc32fast::hash(&[0u8; 4])), "4 bytes of room for 6");
    }
}
