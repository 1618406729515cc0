//! One blocking connection to a node: hello, then request/response frames.
//! Requests may also be pipelined with [`Conn::send`] / [`Conn::recv`].

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use kv_common::page::{parse_record, Geometry, PageHeader, HEADER_LEN};
use kv_common::stats::NodeStats;
use kv_common::status::Status;
use kv_common::wire::{self, KeyRequest, Op, ReqHeader, RspHeader, FLAG_CHECK_GEOMETRY};
use kv_common::wire::{FRAME_HEADER_LEN, RSP_FLAG_DUPLICATE, WIRE_VERSION};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to {addr}: {source}")]
    Connect { addr: String, source: std::io::Error },
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("protocol: {0}")]
    Protocol(String),
    #[error("node answered {status:?}: {msg}")]
    Refused { status: Status, msg: String },
    #[error("{addr} refused the auth token (missing or wrong for its group)")]
    Denied { addr: String },
}

/// A response: header and body.
#[derive(Debug)]
pub struct Reply {
    pub header: RspHeader,
    pub body: Vec<u8>,
}

/// Outcome of a get: a status and, on hit, the payload.
#[derive(Debug, PartialEq, Eq)]
pub enum GetResult {
    Hit(Vec<u8>),
    NotServed(Status),
}

pub struct Conn {
    stream: TcpStream,
    next_id: u64,
    max_record: u64,
}

impl Conn {
    /// Connects and exchanges hellos, with no auth token. `timeout` bounds
    /// connect and each I/O.
    pub fn connect(addr: &str, timeout: Duration) -> Result<Conn, ClientError> {
        Conn::connect_with(addr, timeout, None)
    }

    /// Connects, agrees on a protocol version and presents `token`.
    pub fn connect_with(
        addr: &str,
        timeout: Duration,
        token: Option<&kv_common::auth::Token>,
    ) -> Result<Conn, ClientError> {
        let err = |source| ClientError::Connect { addr: addr.to_string(), source };
        let sa = addr.to_socket_addrs().map_err(err)?.next().ok_or_else(|| err(std::io::Error::other("no address")))?;
        let mut version = WIRE_VERSION;
        for _ in 0..crate::hello::MAX_TRIES {
            let mut stream = TcpStream::connect_timeout(&sa, timeout).map_err(err)?;
            stream.set_nodelay(true)?;
            stream.set_read_timeout(Some(timeout))?;
            stream.set_write_timeout(Some(timeout))?;
            let step = crate::hello::say_sync(&mut stream, version, token).map_err(|e| match e {
                crate::error::OpError::Denied => ClientError::Denied { addr: addr.to_string() },
                crate::error::OpError::Io(e) => ClientError::Io(e),
                crate::error::OpError::Protocol(m) => ClientError::Protocol(m),
                e => ClientError::Protocol(e.to_string()),
            })?;
            match step {
                crate::hello::Step::Done { max_record, .. } => return Ok(Conn { stream, next_id: 1, max_record }),
                crate::hello::Step::Again(v) => version = v,
            }
        }
        Err(ClientError::Protocol(crate::hello::unsettled().to_string()))
    }

    /// Largest record the node accepts.
    pub fn max_record(&self) -> u64 {
        self.max_record
    }

    /// Sends one request frame (header, then each body part); returns its id.
    pub fn send(&mut self, op: Op, flags: u8, body: &[&[u8]]) -> Result<u64, ClientError> {
        let len: usize = body.iter().map(|b| b.len()).sum();
        let req_id = self.next_id;
        self.next_id += 1;
        let h = ReqHeader { op, flags, body_len: len as u32, req_id };
        self.stream.write_all(&h.encode())?;
        for part in body {
            self.stream.write_all(part)?;
        }
        Ok(req_id)
    }

    /// Reads the next response frame.
    pub fn recv(&mut self) -> Result<Reply, ClientError> {
        let mut hb = [0u8; FRAME_HEADER_LEN];
        self.stream.read_exact(&mut hb)?;
        let header = RspHeader::decode(&hb);
        if header.body_len as u64 > self.max_record.max(16 << 20) {
            return Err(ClientError::Protocol(format!("response body of {} bytes", header.body_len)));
        }
        let mut body = vec![0u8; header.body_len as usize];
        self.stream.read_exact(&mut body)?;
        Ok(Reply { header, body })
    }

    fn call(&mut self, op: Op, flags: u8, body: &[&[u8]]) -> Result<Reply, ClientError> {
        let id = self.send(op, flags, body)?;
        let r = self.recv()?;
        if r.header.req_id != id {
            return Err(ClientError::Protocol(format!("answer to request {} while waiting for {id}", r.header.req_id)));
        }
        Ok(r)
    }

    /// Stores `payload` under `key`. Returns Ok(true) when newly stored,
    /// Ok(false) when the key was already there (write-once).
    pub fn put(&mut self, geo: &Geometry, key: &[u8], payload: &[u8]) -> Result<bool, ClientError> {
        let h = PageHeader::new(*geo, key, payload.len() as u64, crc32fast::hash(payload));
        self.put_parts(&[&h.encode(), key, payload])
    }

    /// Sends a record given as parts (header, key, payload) without joining them.
    pub fn put_parts(&mut self, parts: &[&[u8]]) -> Result<bool, ClientError> {
        let len: u64 = parts.iter().map(|p| p.len() as u64).sum();
        if len > self.max_record {
            // The node would close the connection on such a frame: refuse here.
            return Err(ClientError::Refused {
                status: Status::Rejected,
                msg: format!("record of {len} bytes exceeds the node's limit of {}", self.max_record),
            });
        }
        let r = self.call(Op::Put, 0, parts)?;
        match r.header.status {
            Status::Ok => Ok(r.header.flags & RSP_FLAG_DUPLICATE == 0),
            status => Err(ClientError::Refused { status, msg: String::from_utf8_lossy(&r.body).into() }),
        }
    }

    /// The raw record for `key` (no checks beyond the node's).
    pub fn get_record(&mut self, geo: Option<&Geometry>, key: &[u8]) -> Result<(Status, Vec<u8>), ClientError> {
        let g = geo.copied().unwrap_or_default();
        let flags = if geo.is_some() { FLAG_CHECK_GEOMETRY } else { 0 };
        let r = self.call(Op::Get, flags, &[&KeyRequest::encode(&g, key)])?;
        Ok((r.header.status, r.body))
    }

    /// Gets and verifies a page (docs/PROTOCOL.md §3): header, key, geometry, payload CRC.
    pub fn get(&mut self, geo: &Geometry, key: &[u8]) -> Result<GetResult, ClientError> {
        let (st, rec) = self.get_record(Some(geo), key)?;
        if st != Status::Ok {
            return Ok(GetResult::NotServed(st));
        }
        Ok(verify(geo, key, &rec))
    }

    pub fn exist(&mut self, geo: Option<&Geometry>, key: &[u8]) -> Result<Status, ClientError> {
        let g = geo.copied().unwrap_or_default();
        let flags = if geo.is_some() { FLAG_CHECK_GEOMETRY } else { 0 };
        Ok(self.call(Op::Exist, flags, &[&KeyRequest::encode(&g, key)])?.header.status)
    }

    pub fn batch_exist<K: AsRef<[u8]>>(&mut self, geo: &Geometry, keys: &[K]) -> Result<Vec<Status>, ClientError> {
        let r = self.call(Op::BatchExist, FLAG_CHECK_GEOMETRY, &[&wire::encode_batch_exist(geo, keys)])?;
        if r.header.status != Status::Ok {
            return Err(ClientError::Refused { status: r.header.status, msg: String::from_utf8_lossy(&r.body).into() });
        }
        let st = wire::decode_batch_status(&r.body).map_err(|e| ClientError::Protocol(e.to_string()))?;
        if st.len() != keys.len() {
            return Err(ClientError::Protocol("batch answer has the wrong count".into()));
        }
        Ok(st)
    }

    pub fn delete(&mut self, key: &[u8]) -> Result<Status, ClientError> {
        Ok(self.call(Op::Delete, 0, &[key])?.header.status)
    }

    pub fn stats(&mut self) -> Result<NodeStats, ClientError> {
        let r = self.call(Op::Stats, 0, &[])?;
        serde_json::from_slice(&r.body).map_err(|e| ClientError::Protocol(format!("stats: {e}")))
    }

    pub fn ping(&mut self, data: &[u8]) -> Result<Vec<u8>, ClientError> {
        Ok(self.call(Op::Ping, 0, &[data])?.body)
    }

    /// Direct access for tests that write raw bytes.
    pub fn stream(&mut self) -> &mut TcpStream {
        &mut self.stream
    }
}

/// Checks a served record against the request (docs/PROTOCOL.md §3).
pub fn verify(geo: &Geometry, key: &[u8], rec: &[u8]) -> GetResult {
    let Ok((h, k)) = parse_record(rec) else {
        return GetResult::NotServed(Status::Corrupt);
    };
    if k != key || !geo.matches(&h) {
        return GetResult::NotServed(Status::Mismatch);
    }
    let payload = &rec[HEADER_LEN + k.len()..];
    if crc32fast::hash(payload) != h.payload_crc {
        return GetResult::NotServed(Status::Corrupt);
    }
    GetResult::Hit(payload.to_vec())
}
