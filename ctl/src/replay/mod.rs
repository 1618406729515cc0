//! `kvctl replay`: replays a request trace against a group the way an
//! inference engine's L3 tier (SGLang HiCache) calls it, and reports what it
//! got beside what the trace allows (docs/BENCHMARKS.md, "Trace replay").
//!
//! Per request: one batch exist over the request's page chain; the leading
//! hits are the pages before the first status that is not ok; a batch get
//! of those into caller buffers, each page compared byte for byte with the
//! payload its key implies; then a batch put of the pages after the hits.

mod model;
mod report;
mod trace;

use std::collections::{BTreeMap, HashSet};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use clap::Args;
use kv_common::page::{Geometry, HEADER_LEN};
use kv_common::size::{format_size, parse_size};
use kv_common::status::Status;
use kvclient::BlockingClient;

use crate::target::{Cluster, Target};
use trace::{PageId, Paging, Request};

/// The default payload of a page: the shipped trace's 170,899 distinct full
/// pages are 2.6 GiB of payload, 3.3 GiB on the nodes' disks.
const DEFAULT_PAGE_BYTES: &str = "16K";
/// The largest page payload kvctl replay accepts.
const MAX_PAGE_BYTES: u64 = 64 << 20;
/// Records are stored in 4 KiB-aligned extents (docs/ARCHITECTURE.md,
/// "Store layout"): the disk footprint of a page.
const EXTENT_ALIGN: u64 = 4096;
/// Buffers a stream holds for one batch get or put, at most.
const BATCH_BUFFER_BYTES: u64 = 64 << 20;
/// Wrong pages printed one by one before only the count goes on.
const WRONG_PAGES_PRINTED: u64 = 10;

#[derive(Args, Debug)]
pub struct ReplayArgs {
    #[command(flatten)]
    pub target: Target,
    /// The trace: JSON lines with `timestamp` (ms from the trace's start), `input_length` (tokens) and
    /// `hash_ids` (the prompt's chain of 512-token blocks), as traces/README.md describes.
    #[arg(value_name = "TRACE")]
    pub trace: PathBuf,
    /// Run tag in every key, `replay/TAG/HASH_ID/PAGE` (default: a new tag from the time and the
    /// process id, printed at the start, so that runs share no pages).
    #[arg(long)]
    pub tag: Option<String>,
    /// Pages per 512-token block, K (it must divide 512; a page holds 512/K tokens), as an engine
    /// with a smaller page size. Only full pages are stored: a partial last block gives
    /// floor(its tokens / page tokens) pages.
    #[arg(long, default_value_t = 1)]
    pub pages_per_block: u32,
    /// Payload bytes per page, such as 16K or 1M. The default, 16K, puts the shipped trace's whole
    /// working set (170,899 distinct pages) at 2.6 GiB of payload, 3.3 GiB on disk.
    #[arg(long, default_value = DEFAULT_PAGE_BYTES)]
    pub page_bytes: String,
    /// Concurrent engine streams (threads): request i goes to stream i % E, each stream in trace order.
    #[arg(long, default_value_t = 1)]
    pub engines: usize,
    /// Time compression: a request at trace time t (counted from the first request replayed) is
    /// issued t/S after the start; 0 issues requests as fast as the group answers.
    #[arg(long, default_value_t = 0.0)]
    pub speed: f64,
    /// With --speed: issue the requests before trace time SECS as fast as possible (filling the
    /// group), then, once every stream is past them, the rest at --speed counted from SECS. Measures
    /// a membership event at a real pace without replaying the hour before it at that pace.
    #[arg(long, value_name = "SECS")]
    pub warm_until: Option<String>,
    /// Replay the first N requests only (after --skip).
    #[arg(long)]
    pub limit: Option<usize>,
    /// Pass over the first N requests of the trace.
    #[arg(long, default_value_t = 0)]
    pub skip: usize,
    /// Stop issuing requests after this many seconds of wall time.
    #[arg(long)]
    pub duration: Option<f64>,
    /// When the replay reaches trace time SECS (seconds from the trace's start, on the trace's
    /// clock), run COMMAND with `sh -c` on a thread of its own (repeatable); the replay goes on,
    /// the command's output goes to stderr and the report sums up the span after it.
    #[arg(long = "event", value_name = "SECS=COMMAND")]
    pub events: Vec<String>,
    /// Trace time after each --event that the report sums up (requests, pages, leading hits), such as 60s or 2m.
    #[arg(long, default_value = "60s")]
    pub event_span: String,
    /// Width of the hit-rate windows, such as 10s, 500ms or 1m; the clock is the trace's timestamps,
    /// not wall time.
    #[arg(long, default_value = "10s")]
    pub window: String,
    /// Group capacity for the LRU simulation, such as 3G (default: the sum of the members' disk
    /// capacity from their statistics).
    #[arg(long)]
    pub capacity_bytes: Option<String>,
    /// Prefill throughput of the engine in tokens per second: also report the prefill time the hits
    /// saved, net of the time spent loading them (docs/BENCHMARKS.md, "Trace replay", has a figure).
    #[arg(long)]
    pub prefill_tokens_per_s: Option<f64>,
}

/// The options, checked.
struct Plan {
    paging: Paging,
    page_bytes: usize,
    tag: String,
    engines: usize,
    speed: f64,
    /// Trace time (ms from the trace's start) before which requests go as fast as possible.
    warm_until_ms: Option<u64>,
    duration: Option<Duration>,
    window_ms: u64,
    event_span_ms: u64,
    events: Vec<Event>,
    capacity: Option<u64>,
    prefill: Option<f64>,
}

#[derive(Clone, Debug, PartialEq)]
struct Event {
    at_ms: u64,
    command: String,
}

/// A time such as `10s`, `500ms`, `1.5m`, `1h` or a bare number of seconds, in ms.
fn parse_time_ms(flag: &str, s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult = match unit.trim() {
        "" | "s" => 1000.0,
        "ms" => 1.0,
        "m" | "min" => 60_000.0,
        "h" => 3_600_000.0,
        _ => return Err(format!("{flag} {s:?}: unknown unit (use ms, s, m or h)")),
    };
    let v: f64 = num.parse().map_err(|_| format!("{flag} {s:?}: expected a time such as 10s"))?;
    let ms = v * mult;
    if !ms.is_finite() || ms > 1e15 {
        return Err(format!("{flag} {s:?}: too large"));
    }
    Ok(ms.round() as u64)
}

/// `SECS=COMMAND`.
fn parse_event(s: &str) -> Result<Event, String> {
    let (at, cmd) = s.split_once('=').ok_or_else(|| format!("--event {s:?}: expected SECS=COMMAND"))?;
    let at_ms = parse_time_ms("--event", at)?;
    if cmd.trim().is_empty() {
        return Err(format!("--event {s:?}: the command is empty"));
    }
    Ok(Event { at_ms, command: cmd.to_string() })
}

fn default_tag() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    format!("{secs}-{}", std::process::id())
}

fn plan(a: &ReplayArgs) -> Result<Plan, String> {
    let paging = Paging::new(a.pages_per_block)?;
    let page_bytes = parse_size(&a.page_bytes).map_err(|e| format!("--page-bytes: {e}"))?;
    if page_bytes == 0 || page_bytes > MAX_PAGE_BYTES {
        return Err(format!("--page-bytes {}: give 1 byte to {}", a.page_bytes, format_size(MAX_PAGE_BYTES)));
    }
    let tag = a.tag.clone().unwrap_or_else(default_tag);
    if tag.is_empty() || tag.len() > 128 || tag.contains(['/', '\0']) {
        return Err(format!("--tag {tag:?}: give 1-128 bytes without '/' or NUL"));
    }
    if a.engines == 0 || a.engines > 4096 {
        return Err(format!("--engines {}: give 1 to 4096", a.engines));
    }
    if !a.speed.is_finite() || a.speed < 0.0 {
        return Err(format!("--speed {}: give 0 (as fast as possible) or a positive factor", a.speed));
    }
    let warm_until_ms = a.warm_until.as_deref().map(|w| parse_time_ms("--warm-until", w)).transpose()?;
    if warm_until_ms.is_some() && a.speed == 0.0 {
        return Err("--warm-until: give a --speed too (without one every request goes as fast as possible)".into());
    }
    let duration = match a.duration {
        Some(d) if !(d.is_finite() && d > 0.0 && d < 1e9) => {
            return Err(format!("--duration {d}: give a positive number of seconds"))
        }
        Some(d) => Some(Duration::from_secs_f64(d)),
        None => None,
    };
    let window_ms = parse_time_ms("--window", &a.window)?;
    if window_ms == 0 {
        return Err(format!("--window {:?}: must be at least 1ms", a.window));
    }
    let event_span_ms = parse_time_ms("--event-span", &a.event_span)?;
    let mut events = a.events.iter().map(|e| parse_event(e)).collect::<Result<Vec<_>, _>>()?;
    events.sort_by_key(|e| e.at_ms);
    let capacity =
        a.capacity_bytes.as_deref().map(|c| parse_size(c).map_err(|e| format!("--capacity-bytes: {e}"))).transpose()?;
    let prefill = match a.prefill_tokens_per_s {
        Some(r) if !(r.is_finite() && r > 0.0) => {
            return Err(format!("--prefill-tokens-per-s {r}: give a positive rate"));
        }
        r => r,
    };
    Ok(Plan {
        paging,
        page_bytes: page_bytes as usize,
        tag,
        engines: a.engines,
        speed: a.speed,
        warm_until_ms,
        duration,
        window_ms,
        event_span_ms,
        events,
        capacity,
        prefill,
    })
}

/// What one request got.
#[derive(Clone, Debug, Default)]
struct Outcome {
    issued: bool,
    /// Pages served and verified before the first that was not.
    hits: u64,
    /// Why the chain of leading hits ended (a status name, or "wrong").
    end: Option<&'static str>,
    /// Pages exist said were there whose get did not serve them (from
    /// the first such page on).
    get_missed: u64,
    wrong: u64,
    /// Exist + get, the time the engine waits on L3 before it can prefill.
    l3_ns: u64,
    get_ns: u64,
    bytes_in: u64,
    bytes_out: u64,
    failed_puts: BTreeMap<&'static str, u64>,
}

/// The events and the commands they started.
struct Events {
    list: Vec<Event>,
    next: AtomicUsize,
    runs: Mutex<Vec<(usize, std::thread::JoinHandle<EventRun>)>>,
    /// Events whose thread could not be started, and why.
    failed: Mutex<Vec<(usize, String)>>,
    t0: Instant,
}

/// How an event's command went.
#[derive(Clone, Debug)]
pub struct EventRun {
    /// Wall seconds from the start of the replay.
    pub started_s: f64,
    pub ended_s: f64,
    /// `exit 0`, `exit 3`, `signal 9`, `not started: ...`.
    pub status: String,
}

impl Events {
    /// The replay reached trace time `ts_ms`: start every event due.
    fn reach(&self, ts_ms: u64) {
        loop {
            let k = self.next.load(Ordering::SeqCst);
            if k >= self.list.len() || self.list[k].at_ms > ts_ms {
                return;
            }
            if self.next.compare_exchange(k, k + 1, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
                self.fire(k);
            }
        }
    }

    fn fire(&self, k: usize) {
        let ev = self.list[k].clone();
        let t0 = self.t0;
        let at = ev.at_ms as f64 / 1000.0;
        eprintln!("kvctl replay: event at trace time {at} s: starting `{}`", ev.command);
        let command = ev.command.clone();
        let spawned = std::thread::Builder::new().name("replay-event".into()).spawn(move || {
            let started_s = t0.elapsed().as_secs_f64();
            let status = Command::new("sh")
                .arg("-c")
                .arg(&ev.command)
                .stdin(Stdio::null())
                .stdout(Stdio::from(std::io::stderr()))
                .status();
            let status = match status {
                Ok(s) => match (s.code(), std::os::unix::process::ExitStatusExt::signal(&s)) {
                    (Some(c), _) => format!("exit {c}"),
                    (None, Some(sig)) => format!("signal {sig}"),
                    (None, None) => "ended".to_string(),
                },
                Err(e) => format!("not started: {e}"),
            };
            let ended_s = t0.elapsed().as_secs_f64();
            eprintln!(
                "kvctl replay: event at trace time {at} s: `{}` ended ({status}) after {:.2} s",
                ev.command,
                ended_s - started_s
            );
            EventRun { started_s, ended_s, status }
        });
        match spawned {
            Ok(h) => self.runs.lock().unwrap_or_else(|e| e.into_inner()).push((k, h)),
            Err(e) => {
                eprintln!("kvctl replay: event at trace time {at} s: `{command}` not started: {e}");
                self.failed.lock().unwrap_or_else(|e| e.into_inner()).push((k, format!("not started: {e}")));
            }
        }
    }

    /// Waits for the commands started; one entry per event (None: not reached).
    fn finish(&self) -> Vec<Option<EventRun>> {
        let runs = std::mem::take(&mut *self.runs.lock().unwrap_or_else(|e| e.into_inner()));
        let running = runs.iter().filter(|(_, h)| !h.is_finished()).count();
        if running > 0 {
            eprintln!("kvctl replay: waiting for {running} event command(s) to end");
        }
        let mut out = vec![None; self.list.len()];
        let now = self.t0.elapsed().as_secs_f64();
        for (k, why) in std::mem::take(&mut *self.failed.lock().unwrap_or_else(|e| e.into_inner())) {
            out[k] = Some(EventRun { started_s: now, ended_s: now, status: why });
        }
        for (k, h) in runs {
            out[k] = Some(h.join().unwrap_or_else(|_| EventRun {
                started_s: 0.0,
                ended_s: 0.0,
                status: "the event thread failed".into(),
            }));
        }
        out
    }
}

/// The group as the replay found it: its members in view order, the ring
/// that places keys on them, and each member's capacity and gets served so
/// far (None for a member that did not answer).
struct Layout {
    ids: Vec<String>,
    members: Vec<kv_common::mds::MemberRecord>,
    ring: kv_common::ring::Ring,
    capacity: Vec<Option<u64>>,
    gets: Vec<Option<u64>>,
}

impl Layout {
    fn of(target: &Target, timeout: Duration) -> Result<Layout, String> {
        use kv_common::ring::{Ring, RingMember};
        let (members, rule) = match target.cluster()? {
            Cluster::Mds { endpoints, group } => {
                let view = crate::cluster::fetch_view(&endpoints, &group, timeout)?;
                let rule = view.placement()?;
                (view.members, rule)
            }
            // A static list is placed by the client's option, as the
            // client the replay drives places it.
            Cluster::Members(m) => {
                (crate::cluster::member_records(&m)?, kvclient::Options::parse(&target.options)?.placement)
            }
        };
        let ring = Ring::with_placement(
            members.iter().map(|m| RingMember { id: m.id.clone(), weight: m.weight }).collect(),
            rule,
        );
        let stats = crate::cluster::gather(&members, timeout);
        if !members.is_empty() && stats.iter().all(|s| s.is_err()) {
            return Err(format!("no member answered for its statistics ({} members)", members.len()));
        }
        Ok(Layout {
            ids: members.iter().map(|m| m.id.clone()).collect(),
            capacity: stats.iter().map(|s| s.as_ref().ok().map(|s| s.capacity_bytes)).collect(),
            gets: stats.iter().map(|s| s.as_ref().ok().map(|s| s.hits + s.misses)).collect(),
            members,
            ring,
        })
    }

    /// The group's disk capacity and where the figure came from.
    fn total_capacity(&self) -> (u64, String) {
        let cap = self.capacity.iter().flatten().sum();
        let down: Vec<&str> =
            self.ids.iter().zip(&self.capacity).filter(|(_, c)| c.is_none()).map(|(id, _)| id.as_str()).collect();
        let source = if down.is_empty() {
            format!("node statistics of {} members", self.ids.len())
        } else {
            format!(
                "node statistics of {} of {} members ({} unreachable)",
                self.ids.len() - down.len(),
                self.ids.len(),
                down.join(", ")
            )
        };
        (cap, source)
    }

    /// What each member did since this layout was taken (None: it did not
    /// answer then or now, or restarted since).
    fn since(&self, timeout: Duration) -> Vec<Option<Served>> {
        crate::cluster::gather(&self.members, timeout)
            .iter()
            .zip(&self.gets)
            .map(|(now, before)| match (now, before) {
                (Ok(s), Some(b)) => (s.hits + s.misses).checked_sub(*b).map(|gets| Served {
                    gets,
                    used_bytes: s.used_bytes,
                    evictions: s.evictions,
                }),
                _ => None,
            })
            .collect()
    }

    /// The member (its index) that owns `key`.
    fn owner(&self, key: &[u8]) -> usize {
        self.ring.owner(key).unwrap_or(0)
    }
}

/// A member's figures at the end of a replay: the gets it served during
/// it, the bytes it holds (against its capacity) and its evictions so far.
#[derive(Clone, Copy, Debug)]
struct Served {
    gets: u64,
    used_bytes: u64,
    evictions: u64,
}

/// The end of the warm-up (--warm-until): the paced part starts when every
/// stream has issued its requests before the warm-up's end, so that no stream
/// runs paced requests beside another's warm-up burst.
struct WarmGate {
    /// Streams still warming up.
    left: Mutex<usize>,
    ended: Condvar,
    /// When the last stream arrived: the wall-clock origin of the paced part.
    paced_t0: OnceLock<Instant>,
}

impl WarmGate {
    fn new(streams: usize) -> Self {
        WarmGate { left: Mutex::new(streams), ended: Condvar::new(), paced_t0: OnceLock::new() }
    }

    /// One stream is done warming up (or never will: `wait` false, for a
    /// stream that did not start); with `wait`, returns when all are, with
    /// the origin of the paced part.
    fn arrive(&self, wait: bool) -> Instant {
        let mut left = self.left.lock().unwrap_or_else(|e| e.into_inner());
        *left = left.saturating_sub(1);
        if *left == 0 {
            self.paced_t0.get_or_init(Instant::now);
            self.ended.notify_all();
        }
        while wait && *left > 0 {
            left = self.ended.wait(left).unwrap_or_else(|e| e.into_inner());
        }
        // Set once the last stream arrived; a stream that does not wait may
        // leave before, and does not use the origin.
        self.paced_t0.get().copied().unwrap_or_else(Instant::now)
    }
}

/// Shared by the engine streams.
struct Shared<'a> {
    client: &'a BlockingClient,
    plan: &'a Plan,
    reqs: &'a [Request],
    pages: &'a [Vec<PageId>],
    events: &'a Events,
    done: &'a AtomicU64,
    wrong_seen: &'a AtomicU64,
    t0: Instant,
    first_ts: u64,
    warm: &'a WarmGate,
}

/// One engine stream: its requests in trace order.
fn stream(s: &Shared<'_>, idx: Vec<usize>) -> Vec<(usize, Outcome)> {
    let page_bytes = s.plan.page_bytes;
    let batch = (BATCH_BUFFER_BYTES / page_bytes as u64).clamp(1, 1024) as usize;
    let mut bufs: Vec<Vec<u8>> = Vec::new();
    let mut out = Vec::with_capacity(idx.len());
    let deadline = s.plan.duration.map(|d| s.t0 + d);
    // Without --warm-until the pace counts from the first request replayed.
    let mut pace = s.plan.warm_until_ms.is_none().then_some((s.t0, s.first_ts));
    // A stream that ends (or fails) before the paced part lets the others go on.
    struct Arrival<'a> {
        gate: &'a WarmGate,
        arrived: bool,
    }
    impl Drop for Arrival<'_> {
        fn drop(&mut self) {
            if !self.arrived {
                self.gate.arrive(false);
            }
        }
    }
    let mut guard = Arrival { gate: s.warm, arrived: pace.is_some() };
    for i in idx {
        let r = &s.reqs[i];
        if pace.is_none() && s.plan.warm_until_ms.is_some_and(|w| r.ts_ms >= w) {
            // Counted from the warm-up's end, or from the first request
            // replayed when --skip starts the slice after it.
            let w = s.plan.warm_until_ms.unwrap_or(0).max(s.first_ts);
            guard.arrived = true;
            pace = Some((s.warm.arrive(true), w));
        }
        if let (true, Some((origin, from_ts))) = (s.plan.speed > 0.0, pace) {
            let wait = r.ts_ms.saturating_sub(from_ts) as f64 / 1000.0 / s.plan.speed;
            // A time past what a clock holds is never reached: the stream ends.
            let Some(due) = Duration::try_from_secs_f64(wait).ok().and_then(|w| origin.checked_add(w)) else {
                break;
            };
            if deadline.is_some_and(|d| due >= d) {
                break;
            }
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        s.events.reach(r.ts_ms);
        let o = one_request(s, r, &s.pages[i], batch, &mut bufs);
        s.done.fetch_add(1, Ordering::Relaxed);
        out.push((i, o));
    }
    drop(guard);
    out
}

fn one_request(s: &Shared<'_>, r: &Request, pages: &[PageId], batch: usize, bufs: &mut Vec<Vec<u8>>) -> Outcome {
    let mut o = Outcome { issued: true, ..Outcome::default() };
    if pages.is_empty() {
        return o;
    }
    let page_bytes = s.plan.page_bytes;
    let keys: Vec<String> = pages.iter().map(|p| trace::key(&s.plan.tag, *p)).collect();
    let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
    let t = Instant::now();
    let st = s.client.batch_exist(&refs);
    let exist_ns = t.elapsed().as_nanos() as u64;
    let lead = st.iter().position(|x| *x != Status::Ok).unwrap_or(keys.len());
    if lead < keys.len() {
        o.end = Some(st[lead].name());
    }
    // The leading hits into caller buffers, in batches; the first page not
    // served (or not the page its key implies) ends the hits.
    let t = Instant::now();
    let mut stopped = false;
    let mut from = 0;
    while from < lead && !stopped {
        let to = lead.min(from + batch);
        while bufs.len() < to - from {
            bufs.push(vec![0u8; page_bytes]);
        }
        let mut items: Vec<kvclient::client::GetItem<'_, '_>> =
            refs[from..to].iter().zip(bufs.iter_mut()).map(|(k, b)| (*k, vec![&mut b[..]])).collect();
        let res = s.client.batch_getv(&mut items);
        drop(items);
        for (j, &(st, n)) in res.iter().enumerate() {
            let key = &keys[from + j];
            if st == Status::Ok {
                o.bytes_in += n as u64;
                let data = &bufs[j][..n.min(page_bytes)];
                if !trace::payload_matches(key.as_bytes(), data, page_bytes) {
                    o.wrong += 1;
                    let seen = s.wrong_seen.fetch_add(1, Ordering::Relaxed) + 1;
                    if seen <= WRONG_PAGES_PRINTED {
                        eprintln!(
                            "kvctl replay: WRONG PAGE: {key} (trace line {}): {n} bytes served that are not the \
                             {page_bytes} bytes this key's page holds",
                            r.line
                        );
                    }
                    if !stopped {
                        stopped = true;
                        o.end = Some("wrong");
                    }
                } else if !stopped {
                    o.hits += 1;
                }
            } else if !stopped {
                stopped = true;
                o.end = Some(st.name());
            }
        }
        from = to;
    }
    o.get_missed = lead as u64 - o.hits;
    o.get_ns = t.elapsed().as_nanos() as u64;
    o.l3_ns = exist_ns + o.get_ns;
    // The pages after the leading hits, as the engine writes back what it
    // computed.
    let mut from = o.hits as usize;
    while from < keys.len() {
        let to = keys.len().min(from + batch);
        while bufs.len() < to - from {
            bufs.push(vec![0u8; page_bytes]);
        }
        for (k, b) in keys[from..to].iter().zip(bufs.iter_mut()) {
            trace::fill_payload(k.as_bytes(), &mut b[..page_bytes]);
        }
        let items: Vec<(&[u8], Vec<&[u8]>)> =
            refs[from..to].iter().zip(bufs.iter()).map(|(k, b)| (*k, vec![&b[..page_bytes]])).collect();
        for st in s.client.batch_putv(&items) {
            if st == Status::Ok {
                o.bytes_out += page_bytes as u64;
            } else {
                *o.failed_puts.entry(st.name()).or_default() += 1;
            }
        }
        from = to;
    }
    o
}

pub fn run(a: &ReplayArgs, json: bool, timeout: Duration) -> Result<u8, String> {
    let plan = plan(a)?;
    let name = a.trace.display().to_string();
    let f = std::fs::File::open(&a.trace).map_err(|e| format!("{name}: {e}"))?;
    let reqs = trace::parse(std::io::BufReader::new(f), &name, a.skip, a.limit)?;
    let pages: Vec<Vec<PageId>> = reqs.iter().map(|r| plan.paging.pages(r)).collect();
    let total_pages: u64 = pages.iter().map(|p| p.len() as u64).sum();
    let distinct = pages.iter().flatten().collect::<HashSet<_>>().len() as u64;
    let longest_key = pages.iter().flatten().map(|p| trace::key(&plan.tag, *p).len() as u64).max().unwrap_or(0);
    let footprint = (HEADER_LEN as u64 + longest_key + plan.page_bytes as u64).div_ceil(EXTENT_ALIGN) * EXTENT_ALIGN;
    let working = report::WorkingSet {
        distinct_pages: distinct,
        payload_bytes: distinct * plan.page_bytes as u64,
        footprint_per_page: footprint,
        disk_bytes: distinct * footprint,
    };
    eprintln!(
        "kvctl replay: {name}: {} requests, {total_pages} pages ({} per block, {} tokens, {} each); tag {}",
        reqs.len(),
        plan.paging.per_block,
        plan.paging.page_tokens(),
        format_size(plan.page_bytes as u64),
        plan.tag
    );
    eprintln!(
        "kvctl replay: working set {distinct} distinct pages: {} of payload, {} on the nodes' disks ({} a page)",
        format_size(working.payload_bytes),
        format_size(working.disk_bytes),
        format_size(footprint)
    );
    let geo = Geometry { page_size: plan.paging.page_tokens() as u32, tp_size: 1, ..Geometry::default() };
    let client = a.target.client(geo)?;
    // A refused token would fail every request: say so once, up front.
    if client.exist(b"kvctl-replay-probe") == Status::Edenied {
        let why = kvclient::error::take_last_failure().unwrap_or_default();
        return Err(crate::denied_line(&why));
    }
    let layout = match Layout::of(&a.target, timeout) {
        Ok(l) if !l.ids.is_empty() => Some(l),
        Ok(_) => {
            eprintln!("kvctl replay: the group has no members: no per-node figures");
            None
        }
        Err(e) => {
            eprintln!("kvctl replay: no per-node figures: {e}");
            None
        }
    };
    let capacity = match plan.capacity {
        Some(c) => Some((c, "--capacity-bytes".to_string())),
        None => match &layout {
            Some(l) => Some(l.total_capacity()),
            None => {
                eprintln!("kvctl replay: no LRU simulation (give --capacity-bytes)");
                None
            }
        },
    };
    if let Some((c, src)) = &capacity {
        eprintln!(
            "kvctl replay: group capacity {} ({src}) = {} pages of {}",
            format_size(*c),
            c / footprint,
            format_size(footprint)
        );
    }

    let t0 = Instant::now();
    let events = Events {
        list: plan.events.clone(),
        next: AtomicUsize::new(0),
        runs: Mutex::new(Vec::new()),
        failed: Mutex::new(Vec::new()),
        t0,
    };
    let warm = WarmGate::new(plan.engines);
    let done = AtomicU64::new(0);
    let wrong_seen = AtomicU64::new(0);
    let shared = Shared {
        client: &client,
        plan: &plan,
        reqs: &reqs,
        pages: &pages,
        events: &events,
        done: &done,
        wrong_seen: &wrong_seen,
        t0,
        first_ts: reqs.first().map_or(0, |r| r.ts_ms),
        warm: &warm,
    };
    let stop = AtomicBool::new(false);
    let mut outcomes: Vec<Outcome> = vec![Outcome::default(); reqs.len()];
    let total = reqs.len() as u64;
    let wall = std::thread::scope(|sc| {
        // A bar is a nicety: none when its thread cannot start.
        let bar = std::io::stderr().is_terminal().then(|| {
            let (done, stop) = (&done, &stop);
            std::thread::Builder::new().spawn_scoped(sc, move || progress_bar(total, done, stop)).ok()
        });
        let mut handles = Vec::with_capacity(plan.engines);
        for e in 0..plan.engines {
            let idx: Vec<usize> = (e..reqs.len()).step_by(plan.engines).collect();
            let shared = &shared;
            match std::thread::Builder::new().name(format!("replay-{e}")).spawn_scoped(sc, move || stream(shared, idx))
            {
                Ok(h) => handles.push(h),
                Err(err) => {
                    warm.arrive(false);
                    eprintln!("kvctl replay: engine stream {e} not started ({err}): its requests are not issued")
                }
            }
        }
        for h in handles {
            // A stream that failed leaves its requests unissued.
            for (i, o) in h.join().unwrap_or_default() {
                outcomes[i] = o;
            }
        }
        let wall = t0.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        if let Some(Some(b)) = bar {
            let _ = b.join();
        }
        wall
    });
    let runs = events.finish();
    let served = layout.as_ref().map(|l| l.since(timeout));

    let r = report::build(report::Input {
        name: &name,
        plan: &plan,
        reqs: &reqs,
        pages: &pages,
        outcomes: &outcomes,
        working,
        capacity,
        layout: layout.as_ref().zip(served),
        runs,
        wall,
    });
    // What spreading hot keys' reads did (docs/ARCHITECTURE.md, "Hot
    // keys"): a read of a copy that missed was asked at the owner too.
    let hot = &client.core.metrics.hot;
    let spread = serde_json::json!({
        "copy_hits": hot.copy_hits.load(Ordering::Relaxed),
        "fallbacks": hot.fallbacks.load(Ordering::Relaxed),
        "fills": hot.fills_stored.load(Ordering::Relaxed),
    });
    if json {
        let mut j = r.json();
        j["spread"] = spread;
        println!("{j}");
    } else {
        r.print();
    }
    if r.wrong_pages > 0 {
        eprintln!(
            "kvctl replay: WRONG PAGES: {} page(s) were served with bytes other than the ones put under their key",
            r.wrong_pages
        );
        return Ok(1);
    }
    Ok(0)
}

/// A bar of requests done, drawn on stderr until `stop` (started only
/// when stderr is a terminal).
fn progress_bar(total: u64, done: &AtomicU64, stop: &AtomicBool) {
    let bar = indicatif::ProgressBar::new(total);
    bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
    bar.set_style(
        indicatif::ProgressStyle::with_template("[{bar:30}] {pos}/{len} requests {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("#>."),
    );
    while !stop.load(Ordering::Relaxed) {
        bar.set_position(done.load(Ordering::Relaxed));
        std::thread::sleep(Duration::from_millis(200));
    }
    bar.finish_and_clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_and_events_parse() {
        assert_eq!(parse_time_ms("--window", "10s").unwrap(), 10_000);
        assert_eq!(parse_time_ms("--window", "10").unwrap(), 10_000);
        assert_eq!(parse_time_ms("--window", "500ms").unwrap(), 500);
        assert_eq!(parse_time_ms("--window", "1.5m").unwrap(), 90_000);
        assert_eq!(parse_time_ms("--window", "1h").unwrap(), 3_600_000);
        assert!(parse_time_ms("--window", "10x").unwrap_err().contains("--window"));
        assert!(parse_time_ms("--window", "").is_err());
        assert!(parse_time_ms("--window", "-1s").is_err());
        assert_eq!(
            parse_event("120=kill -9 $(cat n2.pid)").unwrap(),
            Event { at_ms: 120_000, command: "kill -9 $(cat n2.pid)".into() }
        );
        assert_eq!(parse_event("1.5=a=b").unwrap(), Event { at_ms: 1500, command: "a=b".into() });
        assert!(parse_event("120").is_err());
        assert!(parse_event("120= ").is_err());
        assert!(parse_event("x=ls").is_err());
    }

    #[test]
    fn the_paced_part_starts_when_every_stream_is_warm() {
        let gate = WarmGate::new(3);
        // One stream never started: it does not hold the others.
        gate.arrive(false);
        let before = Instant::now();
        let origins: Vec<Instant> = std::thread::scope(|sc| {
            let a = sc.spawn(|| gate.arrive(true));
            let b = sc.spawn(|| {
                std::thread::sleep(Duration::from_millis(50));
                gate.arrive(true)
            });
            vec![a.join().unwrap(), b.join().unwrap()]
        });
        assert_eq!(origins[0], origins[1], "one origin for every stream");
        assert!(
            origins[0] >= before + Duration::from_millis(50),
            "the origin is the last stream's arrival: {:?}",
            origins[0] - before
        );
        // Later arrivals (none expected) do not wait and see the same origin.
        assert_eq!(gate.arrive(true), origins[0]);
    }
}
