//! A stand-in fabric for tests: registrations are entries in a table, and
//! a work request copies memory between them in-process after checking
//! the keys and bounds a NIC checks. Completions come back through `poll`
//! like a device's. Not compiled into release builds' public surface for
//! use: only tests (here and in other crates, through `testing`) build it.

use super::*;
use crate::bootstrap::ReadLimits;
use std::collections::HashMap;

/// A registration: the range, the "old pages" the device still reaches
/// once the caller's memory was replaced under it (a copy), and what a
/// peer may do with it (None: a node's registration, out of peers' reach).
type FakeMr = (usize, usize, Option<Box<[u8]>>, Option<PeerAccess>);

#[derive(Default)]
struct Fabric {
    /// Registrations of clients (true) or of nodes (false) fail, as
    /// when pinned memory is exhausted.
    refuse_registrations: Option<bool>,
    /// Destroying a queue pair fails (the verbs layer panics).
    fail_destroys: bool,
    /// Read limits of devices by name (16 and 16 when not set).
    read_limits: HashMap<String, ReadLimits>,
    mrs: HashMap<u32, FakeMr>,
    next_key: u32,
    qps: HashMap<u32, Arc<Mutex<FakeQpState>>>,
    next_qpn: u32,
}

#[derive(Default)]
struct FakeQpState {
    peer: Option<u32>,
    done: Vec<Wc>,
    /// Fail every work request from now on with this status.
    fail_with: Option<u32>,
    /// Never complete (a lost completion).
    swallow: bool,
    /// The READs it may issue at once, set when connected.
    read_depth: Option<u8>,
}

/// One in-process fabric; each [`FakeBackend`] on it is a host.
#[derive(Default, Clone)]
pub struct FakeNet(Arc<Mutex<Fabric>>);

impl FakeNet {
    /// Makes every queue pair fail its next work requests with `status`.
    pub fn fail_all(&self, status: u32) {
        for q in self.0.lock().unwrap().qps.values() {
            q.lock().unwrap().fail_with = Some(status);
        }
    }

    /// Makes every queue pair stop completing anything.
    pub fn swallow_all(&self) {
        for q in self.0.lock().unwrap().qps.values() {
            q.lock().unwrap().swallow = true;
        }
    }

    /// Makes the clients' (`of_clients`) or the nodes' registrations fail
    /// from now on (as with RLIMIT_MEMLOCK spent).
    pub fn refuse_registrations(&self, of_clients: bool) {
        self.0.lock().unwrap().refuse_registrations = Some(of_clients);
    }

    /// Sets the outstanding-read limits of the devices named `device`.
    pub fn set_read_limits(&self, device: &str, responder: u8, initiator: u8) {
        self.0.lock().unwrap().read_limits.insert(device.into(), ReadLimits { responder, initiator });
    }

    /// The READs the queue pair numbered `qpn` may issue (once connected).
    pub fn read_depth(&self, qpn: u32) -> Option<u8> {
        let f = self.0.lock().unwrap_or_else(|e| e.into_inner());
        f.qps.get(&qpn).and_then(|q| q.lock().unwrap().read_depth)
    }

    pub fn read_limits(&self, device: &str) -> ReadLimits {
        let f = self.0.lock().unwrap_or_else(|e| e.into_inner());
        f.read_limits.get(device).copied().unwrap_or(ReadLimits { responder: 16, initiator: 16 })
    }

    /// Makes destroying a queue pair fail from now on (it stays live).
    pub fn fail_destroys(&self) {
        self.0.lock().unwrap().fail_destroys = true;
    }

    pub fn registrations(&self) -> usize {
        self.0.lock().unwrap().mrs.len()
    }

    /// Models a caller that freed the memory at `addr` and got new memory
    /// mapped there: registrations covering it keep reaching the old
    /// pages (here zeroed: whatever the old pages hold), not what is
    /// there now.
    pub fn replace_memory_under(&self, addr: usize) {
        for (a, l, shadow, _) in self.0.lock().unwrap().mrs.values_mut() {
            if addr >= *a && addr < *a + *l && shadow.is_none() {
                *shadow = Some(vec![0u8; *l].into_boxed_slice());
            }
        }
    }
}

pub struct FakeBackend {
    pub net: FakeNet,
    pub devices: Vec<String>,
    /// A client's (true) or a node's (false) registrations.
    pub remote_access: bool,
}

struct FakeMrKeep(FakeNet, u32);
impl Drop for FakeMrKeep {
    fn drop(&mut self) {
        self.0 .0.lock().unwrap().mrs.remove(&self.1);
    }
}

struct FakeQp {
    net: FakeNet,
    qpn: u32,
    state: Arc<Mutex<FakeQpState>>,
    device: String,
    depth: u32,
}

impl Drop for FakeQp {
    fn drop(&mut self) {
        let mut f = self.net.0.lock().unwrap_or_else(|e| e.into_inner());
        if f.fail_destroys {
            drop(f);
            panic!("ibv_destroy_qp failed (stand-in)");
        }
        f.qps.remove(&self.qpn);
    }
}

/// Whether every page of `[addr, addr+len)` is mapped writable (read
/// from /proc/self/maps, as the kernel checks a registration asking for
/// write access).
fn writable(addr: usize, len: usize) -> bool {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return true };
    let end = addr.saturating_add(len);
    let mut at = addr;
    let mut spans: Vec<(usize, usize, bool)> = maps
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (range, perms) = (f.next()?, f.next()?);
            let (a, b) = range.split_once('-')?;
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
                perms.as_bytes().get(1) == Some(&b'w'),
            ))
        })
        .collect();
    spans.sort_unstable();
    for (a, b, w) in spans {
        if b <= at || a > at {
            continue;
        }
        if !w {
            return false;
        }
        at = b;
        if at >= end {
            return true;
        }
    }
    at >= end
}

impl Backend for FakeBackend {
    fn register(&self, _rail: usize, addr: usize, len: usize, access: PeerAccess) -> Result<Mr, String> {
        let mut f = self.net.0.lock().unwrap();
        if f.refuse_registrations == Some(self.remote_access) {
            return Err("Cannot allocate memory (os error 12)".into());
        }
        // As the kernel: write access (a client's for a peer's writes,
        // a node's local write) needs memory mapped writable.
        let writes = !self.remote_access || access == PeerAccess::Writes;
        if writes && !writable(addr, len) {
            return Err("Bad address (os error 14)".into());
        }
        f.next_key += 1;
        let key = f.next_key;
        f.mrs.insert(key, (addr, len, None, self.remote_access.then_some(access)));
        Ok(Mr { lkey: key, rkey: key, keep: Box::new(FakeMrKeep(self.net.clone(), key)) })
    }

    fn create_qp(&self, rail: usize, depth: u32) -> Result<Box<dyn QueuePair>, String> {
        let mut f = self.net.0.lock().unwrap();
        f.next_qpn += 1;
        let qpn = f.next_qpn;
        let state = Arc::new(Mutex::new(FakeQpState::default()));
        f.qps.insert(qpn, state.clone());
        Ok(Box::new(FakeQp { net: self.net.clone(), qpn, state, device: self.devices[rail].clone(), depth }))
    }

    fn gid(&self, _rail: usize) -> [u8; 16] {
        [0; 16]
    }
}

impl QueuePair for FakeQp {
    fn local(&self) -> Endpoint {
        Endpoint {
            depth: self.depth as u16,
            port: 1,
            mtu: 5,
            lid: 1,
            gid: [0; 16],
            qpn: self.qpn,
            psn: (self.qpn * 7) & 0xff_ffff,
            device: self.device.clone(),
            reads: Some(self.net.read_limits(&self.device)),
            batches: true,
        }
    }

    fn connect(&self, remote: &Endpoint) -> Result<(), String> {
        if !self.net.0.lock().unwrap().qps.contains_key(&remote.qpn) {
            return Err(format!("no queue pair {} on the fabric", remote.qpn));
        }
        let depth = self.net.read_limits(&self.device).initiator_depth(remote.reads);
        let mut st = self.state.lock().unwrap();
        st.peer = Some(remote.qpn);
        st.read_depth = Some(depth);
        Ok(())
    }

    fn read_depth(&self) -> Option<u8> {
        self.state.lock().unwrap().read_depth
    }

    fn post(&self, wrs: &[Wr]) -> Result<(), String> {
        let mut f = self.net.0.lock().unwrap();
        let mut st = self.state.lock().unwrap();
        if st.peer.is_none() {
            return Err("queue pair not connected".into());
        }
        for wr in wrs {
            if st.swallow {
                continue;
            }
            if let Some(s) = st.fail_with {
                st.done.push(Wc { wr_id: wr.wr_id, status: s, bytes: 0 });
                continue;
            }
            // Where the device reaches `addr` through registration `key`
            // (the old pages if the memory was replaced), None when the
            // key does not cover the range.
            let mut reach = |key: u32, addr: u64, remote: bool| -> Option<u64> {
                let (a, l, shadow, peer) = f.mrs.get_mut(&key)?;
                let (a, l) = (*a, *l);
                // A remote write needs the peer's write access; a remote
                // read either.
                let allowed = match (wr.op, *peer) {
                    (_, None) => false,
                    (WrOp::Write, Some(p)) => p == PeerAccess::Writes,
                    (WrOp::Read, Some(_)) => true,
                };
                if remote && !allowed {
                    return None;
                }
                if (addr as usize) < a || (addr as usize).saturating_add(wr.len as usize) > a + l {
                    return None;
                }
                Some(match shadow {
                    Some(s) => s.as_mut_ptr() as u64 + (addr - a as u64),
                    None => addr,
                })
            };
            let (local, remote) = (reach(wr.lkey, wr.laddr, false), reach(wr.rkey, wr.raddr, true));
            // IBV_WC_LOC_PROT_ERR (4) / IBV_WC_REM_ACCESS_ERR (10).
            let status = if local.is_none() {
                4
            } else if remote.is_none() {
                10
            } else {
                let (l, r) = (local.unwrap_or_default(), remote.unwrap_or_default());
                let (src, dst) = match wr.op {
                    WrOp::Write => (l, r),
                    WrOp::Read => (r, l),
                };
                // SAFETY: both ranges lie inside live registrations (checked
                // just above) or their old-pages copies, which live as long
                // as the registration; owners keep registered memory mapped
                // until the registration is dropped; `copy` allows overlap.
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, wr.len as usize) };
                0
            };
            st.done.push(Wc { wr_id: wr.wr_id, status, bytes: wr.len });
        }
        Ok(())
    }

    fn poll(&self, out: &mut Vec<Wc>) -> Result<(), String> {
        out.append(&mut self.state.lock().unwrap().done);
        Ok(())
    }
}
