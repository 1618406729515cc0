//! `kv-rdma`: the RDMA transport (docs/ARCHITECTURE.md, "Transports"). The
//! node and the client reach it through the engine ([`engine::Runtime`],
//! [`engine::Link`]) and the bootstrap ([`bootstrap`]); nothing else of the
//! workspace depends on it, and it depends on nothing of the workspace.
//!
//! The parts that need no device: device names, rail and NUMA choice from sysfs
//! ([`sysfs`]), the queue-pair bootstrap carried as an op on an accepted data
//! connection ([`bootstrap`]), the memory registration cache ([`regcache`]),
//! completion matching with timeouts ([`completion`]), the counters both ends
//! export, and the fallback decision ([`decide`]).
//!
//! The verbs themselves ([`verbs`], cargo feature `rdma`) come from the
//! `sideway` crate, which loads `libibverbs.so.1` at run time: one binary
//! runs with or without rdma-core installed, and RDMA is tried only when
//! devices are named. Everything here is compiled into every build, so every
//! build accepts the option keys and says why it serves over TCP.

pub mod bootstrap;
pub mod completion;
pub mod engine;
pub mod regcache;
pub mod sysfs;
#[cfg(feature = "rdma")]
pub mod verbs;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Whether this build carries the RDMA transport (cargo feature `rdma`).
pub const BUILT_WITH_RDMA: bool = cfg!(feature = "rdma");

/// The transports this build carries, for `build_info{transport}`.
pub fn build_transports() -> &'static str {
    if BUILT_WITH_RDMA {
        "tcp+rdma"
    } else {
        "tcp"
    }
}

/// Longest device name taken (Linux's IB_DEVICE_NAME_MAX is 64).
pub const MAX_DEVICE_NAME: usize = 64;

/// Parses a `:`-separated device list (`mlx5_0:mlx5_1`; options are
/// comma-separated, so the list is not). Empty means "no RDMA".
pub fn parse_devices(s: &str) -> Result<Vec<String>, String> {
    let mut out: Vec<String> = Vec::new();
    for name in s.split(':').map(str::trim) {
        if name.is_empty() {
            if s.trim().is_empty() {
                continue;
            }
            return Err(format!("RDMA device list {s:?} has an empty name (names are separated by ':')"));
        }
        if name.len() > MAX_DEVICE_NAME
            || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
        {
            return Err(format!("RDMA device name {name:?} is not a device name (letters, digits, '_', '-', '.')"));
        }
        if out.iter().any(|n| n == name) {
            return Err(format!("RDMA device {name:?} is named twice"));
        }
        out.push(name.to_string());
    }
    Ok(out)
}

/// RDMA settings shared by the client's options and the node's flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Devices to use, one rail each (empty: TCP only, RDMA never tried).
    pub devices: Vec<String>,
    /// Work requests in flight per queue pair.
    pub depth: u32,
    /// Prefer rails on the calling thread's NUMA node.
    pub numa_local: bool,
}

/// Default work requests in flight per queue pair.
pub const DEFAULT_DEPTH: u32 = 32;
/// Most work requests in flight per queue pair.
pub const MAX_DEPTH: u32 = 1024;

impl Default for Settings {
    fn default() -> Self {
        Settings { devices: Vec::new(), depth: DEFAULT_DEPTH, numa_local: true }
    }
}

/// Byte counts of one rail.
#[derive(Debug, Default)]
pub struct RailCounters {
    pub device: String,
    /// Payload bytes this side read from its peer by RDMA READ.
    pub read_bytes: AtomicU64,
    /// Payload bytes this side wrote to its peer by RDMA WRITE.
    pub written_bytes: AtomicU64,
    /// Queue pairs connected on this rail.
    pub qps_connected: AtomicU64,
}

/// The RDMA counters of one client handle or one node process.
#[derive(Debug, Default)]
pub struct Counters {
    /// Work completions taken (successful).
    pub completions: AtomicU64,
    /// Work completions with an error status, and posts that failed.
    pub errors: AtomicU64,
    /// Work requests that were not completed in time.
    pub timeouts: AtomicU64,
    /// Queue pairs torn down after an error or a timeout.
    pub qp_broken: AtomicU64,
    /// Memory registrations made, and dropped.
    pub registrations: AtomicU64,
    pub deregistrations: AtomicU64,
    /// Bytes registered now.
    pub registered_bytes: AtomicU64,
    /// Times RDMA was asked for and TCP used instead: at most 1 per client
    /// handle and per node process for the devices; a peer that cannot do
    /// RDMA is counted in `peer_fallbacks`.
    pub fallbacks: AtomicU64,
    /// Connections to a peer that answered the bootstrap without RDMA.
    pub peer_fallbacks: AtomicU64,
    /// Why the last fallback happened (for stats and logs).
    pub fallback_reason: Mutex<Option<String>>,
    /// One entry per rail in use, in device order.
    pub rails: Mutex<Vec<Arc<RailCounters>>>,
}

impl Counters {
    pub fn rail(&self, device: &str) -> Arc<RailCounters> {
        let mut g = self.rails.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = g.iter().find(|r| r.device == device) {
            return r.clone();
        }
        let r = Arc::new(RailCounters { device: device.to_string(), ..Default::default() });
        g.push(r.clone());
        r
    }

    pub fn rails(&self) -> Vec<Arc<RailCounters>> {
        self.rails.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn fallback_reason(&self) -> Option<String> {
        self.fallback_reason.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Counts a fallback to TCP and keeps its reason.
    pub fn fell_back(&self, reason: &str) {
        self.fallbacks.fetch_add(1, Ordering::Relaxed);
        *self.fallback_reason.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason.to_string());
    }
}

/// Labels and value of one series.
pub type Series = Vec<(Vec<(&'static str, String)>, u64)>;

/// One metric family of the RDMA counters, read at one moment, for an
/// exposition with its own prefix (`kvcellar_`, `kvclient_`).
#[derive(Debug)]
pub struct Family {
    pub name: &'static str,
    pub help: &'static str,
    /// Counter (else gauge).
    pub counter: bool,
    pub series: Series,
}

impl Counters {
    /// Every RDMA family (docs/METRICS.md). The per-rail ones have a series
    /// per rail in use, none when RDMA is off.
    pub fn families(&self) -> Vec<Family> {
        let v = |a: &AtomicU64| vec![(vec![], a.load(Ordering::Relaxed))];
        let per_rail = |f: fn(&RailCounters) -> &AtomicU64| -> Series {
            self.rails().iter().map(|r| (vec![("rail", r.device.clone())], f(r).load(Ordering::Relaxed))).collect()
        };
        let c = |name, help, series| Family { name, help, counter: true, series };
        vec![
            c("rdma_fallbacks", "Times RDMA was asked for (devices named) and TCP used instead; the log says why", v(&self.fallbacks)),
            c(
                "rdma_peer_fallbacks",
                "Connections whose peer could not do RDMA (answered RDMA_CONNECT without a queue pair), served over TCP",
                v(&self.peer_fallbacks),
            ),
            c("rdma_completions", "RDMA work requests completed successfully", v(&self.completions)),
            c("rdma_errors", "RDMA work requests that failed (error completion or failed post) and failed registrations", v(&self.errors)),
            c("rdma_timeouts", "RDMA work requests not completed in time", v(&self.timeouts)),
            c("rdma_qp_broken", "RDMA queue pairs torn down after an error or a timeout", v(&self.qp_broken)),
            c("rdma_registrations", "Memory registrations made", v(&self.registrations)),
            c("rdma_deregistrations", "Memory registrations dropped", v(&self.deregistrations)),
            Family {
                name: "rdma_registered_bytes",
                help: "Bytes of memory registered now",
                counter: false,
                series: v(&self.registered_bytes),
            },
            c("rdma_read_bytes", "Payload bytes moved by RDMA READ, per rail", per_rail(|r| &r.read_bytes)),
            c("rdma_written_bytes", "Payload bytes moved by RDMA WRITE, per rail", per_rail(|r| &r.written_bytes)),
            c("rdma_qps_connected", "RDMA queue pairs connected, per rail", per_rail(|r| &r.qps_connected)),
        ]
    }
}

/// One usable device: its name, the port and GID index to use, and its
/// NUMA node (None: unknown).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RailSpec {
    pub device: String,
    pub port: u8,
    pub gid_index: u8,
    pub numa_node: Option<u32>,
    /// "InfiniBand" or "Ethernet" (RoCE).
    pub link_layer: String,
}

/// What to carry the bytes with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// No device named: TCP, RDMA never tried, nothing logged.
    Off,
    /// RDMA asked for but not possible: TCP, with the reason (logged once
    /// and counted in `fallbacks`).
    Tcp { reason: String },
    /// RDMA over these rails. `dropped` names devices left out, with why.
    Rdma { rails: Vec<RailSpec>, dropped: Vec<String> },
}

/// Where a decision can go wrong, in the order it is checked: the build,
/// libibverbs, sysfs, then opening each device. `open` opens a device (in
/// the `rdma` build, the verbs; in tests, a stand-in).
pub fn decide(
    settings: &Settings,
    built_with_rdma: bool,
    verbs_loadable: impl FnOnce() -> Result<(), String>,
    sysfs: &sysfs::Sysfs,
    mut open: impl FnMut(&RailSpec) -> Result<(), String>,
) -> Decision {
    if settings.devices.is_empty() {
        return Decision::Off;
    }
    let named = settings.devices.join(":");
    if !built_with_rdma {
        return Decision::Tcp {
            reason: format!(
                "RDMA devices {named} named, but this build has no RDMA (built without the `rdma` feature)"
            ),
        };
    }
    if let Err(e) = verbs_loadable() {
        return Decision::Tcp { reason: format!("RDMA devices {named} named, but {e}") };
    }
    let mut rails = Vec::new();
    let mut dropped = Vec::new();
    for dev in &settings.devices {
        match sysfs.rail(dev).and_then(|r| open(&r).map(|()| r)) {
            Ok(r) => rails.push(r),
            Err(e) => dropped.push(format!("{dev}: {e}")),
        }
    }
    if rails.is_empty() {
        return Decision::Tcp {
            reason: format!("RDMA devices {named} named, but none is usable ({})", dropped.join("; ")),
        };
    }
    Decision::Rdma { rails, dropped }
}

/// Applies a decision's side effects: one log line through `log` when RDMA
/// was asked for and is not used (or a device was left out), and the
/// fallback counter. Returns the rails to use (empty: TCP).
pub fn settle(decision: Decision, counters: &Counters, mut log: impl FnMut(&str)) -> Vec<RailSpec> {
    match decision {
        Decision::Off => Vec::new(),
        Decision::Tcp { reason } => {
            counters.fell_back(&reason);
            log(&format!("using TCP: {reason}"));
            Vec::new()
        }
        Decision::Rdma { rails, dropped } => {
            if !dropped.is_empty() {
                log(&format!("RDMA devices left out: {}", dropped.join("; ")));
            }
            for r in &rails {
                counters.rail(&r.device);
            }
            rails
        }
    }
}

/// Which end a process is: a client's memory is written and read by the
/// node, a node's memory is reached by nobody else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Client,
    Node,
}

/// Starts RDMA as `settings` ask: None means TCP (no device named, or RDMA
/// not possible: then one line through `log` says why, and the fallback
/// counter is 1). `cache_cap`: bytes of cached registrations per rail;
/// `timeout`: per work request.
pub fn start(
    settings: &Settings,
    role: Role,
    counters: &Arc<Counters>,
    cache_cap: usize,
    timeout: std::time::Duration,
    mut log: impl FnMut(&str),
) -> Option<Arc<engine::Runtime>> {
    #[cfg(feature = "rdma")]
    {
        let mut verbs = verbs::Verbs::new(role == Role::Client);
        let d = decide(settings, true, libibverbs_loadable, &sysfs::Sysfs::default(), |r| verbs.open(r));
        let rails = settle(d, counters, &mut log);
        if rails.is_empty() {
            return None;
        }
        let backend = Arc::new(verbs);
        match engine::Runtime::with_backend(backend, rails, settings.clone(), counters.clone(), cache_cap, timeout) {
            Ok(rt) => Some(rt),
            Err(e) => {
                settle(Decision::Tcp { reason: e }, counters, log);
                None
            }
        }
    }
    #[cfg(not(feature = "rdma"))]
    {
        let _ = (cache_cap, timeout, role);
        let d = decide(settings, false, || Ok(()), &sysfs::Sysfs::default(), |_| Ok(()));
        settle(d, counters, &mut log);
        None
    }
}

/// Checks that `libibverbs.so.1` can be loaded (the verbs are resolved from
/// it at run time), without keeping it loaded.
pub fn libibverbs_loadable() -> Result<(), String> {
    let name = c"libibverbs.so.1";
    // SAFETY: dlopen with a NUL-terminated constant name and RTLD_LAZY; the
    // handle, when one is returned, is closed at once and not used.
    let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
    if h.is_null() {
        // SAFETY: dlerror returns NULL or a NUL-terminated string owned by
        // libc, valid until the next dl call on this thread; copied at once.
        let msg = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "unknown error".to_string()
            } else {
                std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(format!("libibverbs.so.1 cannot be loaded ({msg}); install rdma-core (libibverbs1)"));
    }
    // SAFETY: `h` is a live handle returned by dlopen above.
    unsafe { libc::dlclose(h) };
    Ok(())
}

/// The NUMA node the calling thread runs on now (None: unknown).
pub fn current_numa_node() -> Option<u32> {
    let mut cpu: libc::c_uint = 0;
    let mut node: libc::c_uint = 0;
    // SAFETY: getcpu(2) writes two unsigned ints through the pointers given,
    // both to live locals; the third argument is unused and may be NULL. The
    // raw syscall keeps the glibc 2.28 floor (glibc wraps getcpu from 2.29).
    let r = unsafe {
        libc::syscall(
            libc::SYS_getcpu,
            &mut cpu as *mut libc::c_uint,
            &mut node as *mut libc::c_uint,
            std::ptr::null_mut::<libc::c_void>(),
        )
    };
    (r == 0).then_some(node)
}

/// Picks the rail for the `n`-th connection: round-robin over the rails,
/// over those on `local_node` only when `numa_local` is set and some are
/// (a rail whose node is unknown counts as local to none).
pub fn pick_rail(rails: &[RailSpec], n: usize, local_node: Option<u32>, numa_local: bool) -> Option<usize> {
    if rails.is_empty() {
        return None;
    }
    if numa_local {
        if let Some(node) = local_node {
            let local: Vec<usize> = (0..rails.len()).filter(|&i| rails[i].numa_node == Some(node)).collect();
            if !local.is_empty() {
                return Some(local[n % local.len()]);
            }
        }
    }
    Some(n % rails.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(d: &str, numa: Option<u32>) -> RailSpec {
        RailSpec { device: d.into(), port: 1, gid_index: 0, numa_node: numa, link_layer: "InfiniBand".into() }
    }

    #[test]
    fn device_lists_are_colon_separated_and_checked() {
        assert_eq!(parse_devices("").unwrap(), Vec::<String>::new());
        assert_eq!(parse_devices("mlx5_0:mlx5_1").unwrap(), vec!["mlx5_0", "mlx5_1"]);
        assert!(parse_devices("mlx5_0::mlx5_1").unwrap_err().contains("empty name"));
        assert!(parse_devices("mlx5_0:mlx5_0").unwrap_err().contains("twice"));
        assert!(parse_devices("../etc").unwrap_err().contains("not a device name"));
        assert!(parse_devices(&"x".repeat(65)).is_err());
    }

    #[test]
    fn the_fallback_decision_says_why_in_order() {
        let d = tempfile::tempdir().unwrap();
        let fs = sysfs::Sysfs::at(d.path());
        sysfs::tests::fake_device(d.path(), "mlx5_0", 0, "InfiniBand", "4: ACTIVE");
        sysfs::tests::fake_device(d.path(), "mlx5_1", 1, "InfiniBand", "1: DOWN");
        let s = |devs: &str| Settings { devices: parse_devices(devs).unwrap(), ..Settings::default() };
        let ok = || Ok(());
        assert_eq!(decide(&s(""), true, ok, &fs, |_| Ok(())), Decision::Off);
        let Decision::Tcp { reason } = decide(&s("mlx5_0"), false, ok, &fs, |_| Ok(())) else { panic!() };
        assert!(reason.contains("without the `rdma` feature"), "{reason}");
        let Decision::Tcp { reason } =
            decide(&s("mlx5_0"), true, || Err("libibverbs.so.1 cannot be loaded".into()), &fs, |_| Ok(()))
        else {
            panic!()
        };
        assert!(reason.contains("libibverbs.so.1"), "{reason}");
        let Decision::Tcp { reason } = decide(&s("mlx9_9"), true, ok, &fs, |_| Ok(())) else { panic!() };
        assert!(reason.contains("mlx9_9: no such RDMA device"), "{reason}");
        let Decision::Tcp { reason } = decide(&s("mlx5_1"), true, ok, &fs, |_| Ok(())) else { panic!() };
        assert!(reason.contains("no active port"), "{reason}");
        let Decision::Tcp { reason } = decide(&s("mlx5_0"), true, ok, &fs, |_| Err("cannot allocate a PD".into()))
        else {
            panic!()
        };
        assert!(reason.contains("mlx5_0: cannot allocate a PD"), "{reason}");
        let Decision::Rdma { rails, dropped } = decide(&s("mlx5_0:mlx5_1"), true, ok, &fs, |_| Ok(())) else {
            panic!()
        };
        assert_eq!(rails.len(), 1);
        assert_eq!(rails[0].numa_node, Some(0));
        assert_eq!(dropped.len(), 1);

        // Settling: one log line, the counter at 1, the reason kept.
        let c = Counters::default();
        let mut lines = Vec::new();
        let rails = settle(decide(&s("mlx9_9"), true, ok, &fs, |_| Ok(())), &c, |l| lines.push(l.to_string()));
        assert!(rails.is_empty());
        assert_eq!(lines.len(), 1);
        assert!(lines[0].starts_with("using TCP: "), "{}", lines[0]);
        assert_eq!(c.fallbacks.load(Ordering::Relaxed), 1);
        assert!(c.fallback_reason().unwrap().contains("mlx9_9"));
        let mut quiet = 0;
        assert!(settle(Decision::Off, &c, |_| quiet += 1).is_empty());
        assert_eq!((quiet, c.fallbacks.load(Ordering::Relaxed)), (0, 1));
    }

    #[test]
    fn rails_spread_and_prefer_the_local_numa_node() {
        let rails = [spec("a", Some(0)), spec("b", Some(1)), spec("c", Some(0)), spec("d", None)];
        let picks: Vec<usize> = (0..4).map(|n| pick_rail(&rails, n, None, true).unwrap()).collect();
        assert_eq!(picks, [0, 1, 2, 3]);
        let picks: Vec<usize> = (0..4).map(|n| pick_rail(&rails, n, Some(0), true).unwrap()).collect();
        assert_eq!(picks, [0, 2, 0, 2]);
        let picks: Vec<usize> = (0..2).map(|n| pick_rail(&rails, n, Some(1), true).unwrap()).collect();
        assert_eq!(picks, [1, 1]);
        // No rail on that node, or NUMA choice off: all rails.
        assert_eq!(pick_rail(&rails, 5, Some(7), true), Some(1));
        assert_eq!(pick_rail(&rails, 1, Some(0), false), Some(1));
        assert_eq!(pick_rail(&[], 0, None, true), None);
        assert!(current_numa_node().is_some());
    }

    #[test]
    fn libibverbs_absence_is_a_reason_not_a_crash() {
        match libibverbs_loadable() {
            Ok(()) => {}
            Err(e) => assert!(e.contains("libibverbs.so.1") && e.contains("rdma-core"), "{e}"),
        }
    }
}
