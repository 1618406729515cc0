//! `kv-mds`: the stateless membership service over etcd (docs/PROTOCOL.md §6).
//!
//! Any number of replicas run side by side with no leader; each is an etcd
//! client and nothing else keeps state. Nodes register and heartbeat to any
//! replica ([`registry`]: leases, takeover, epochs); clients read a group's
//! view, or long-poll it, over HTTP/JSON ([`http`]; the API is in
//! docs/PROTOCOL.md). One etcd watch on the whole key space wakes
//! long-polls when a group's member set changes.

pub mod http;
pub mod metrics;
pub mod registry;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use etcd_client::{ConnectOptions, GetOptions, WatchOptions};
use kv_common::mds::{View, ETCD_ROOT};
use tokio::sync::watch;

pub use registry::{RegError, Registry};

/// How many distinct groups one replica follows for long-polls.
const MAX_GROUPS: usize = 4096;

/// A view as a replica holds it for its callers: the number of the read
/// that got it (see `read_seq`), the view, and when it was read.
#[derive(Debug, Clone)]
pub struct Held {
    pub seq: u64,
    pub view: Arc<View>,
    pub at: Instant,
}

impl Held {
    fn new(seq: u64, view: View) -> Held {
        Held { seq, view: Arc::new(view), at: Instant::now() }
    }
}

type Numbered = Held;

/// Views of this many recent epochs are kept per group as bases for deltas.
const DELTA_BASES: usize = 8;

/// How long one encoding of a view is served (its previous sets' time left
/// is counted from when it was made).
const ENCODING_FOR: Duration = Duration::from_secs(1);

/// Whether a caller that named `rules` (comma-separated; empty or absent:
/// `ketama`, as every earlier release) knows `rule` (None: ketama). Names
/// may come percent-encoded (`%2C` for commas).
pub fn knows_rule(rules: &str, rule: Option<&str>) -> bool {
    let ketama = kv_common::ring::Placement::Ketama.name();
    let rule = rule.unwrap_or(ketama);
    if rules.trim().is_empty() {
        return rule == ketama;
    }
    // Commas, plain or percent-encoded: no allocation per request.
    rules.split(',').flat_map(|r| r.split("%2C")).flat_map(|r| r.split("%2c")).any(|r| r.trim() == rule)
}

/// One body for a view: its epoch, when it was made, and the bytes (made
/// by the first caller that needs them).
type Encoding = (u64, Instant, Arc<OnceLock<hyper::body::Bytes>>);

/// What a replica keeps per followed group.
struct Group {
    /// The newest view read, for long-polls to wait on.
    tx: watch::Sender<Option<Numbered>>,
    /// The views of the last few epochs served, newest last: the bases of
    /// deltas for clients that hold one of them.
    recent: VecDeque<Arc<View>>,
    /// Encodings of the current epoch's view, by the base a delta is taken
    /// against (None: the whole view) and, for callers that miss a rule of
    /// its previous sets, the epochs of the sets they are sent (at most 16
    /// kinds however callers spell their rules); each made once and shared by every
    /// caller that wants it within [`ENCODING_FOR`].
    encoded: HashMap<(Option<u64>, Option<Vec<u64>>), Encoding>,
    /// The etcd read of this group's view under way, which every caller
    /// that needs one joins (a fleet's first polls cost etcd one read, not
    /// one each).
    reading: Option<SharedRead>,
    /// When a caller last asked for this group's view: a group polled
    /// within [`FOLLOW_FOR`] stays followed by the watch even with no
    /// long-poll waiting.
    used: Instant,
}

/// One etcd read of a view that several callers wait on.
type SharedRead = Arc<tokio::sync::OnceCell<Result<Held, String>>>;

/// How long a group nobody long-polls stays followed after a plain poll.
const FOLLOW_FOR: Duration = Duration::from_secs(60);

impl Group {
    fn new() -> Group {
        Group {
            tx: watch::channel(None).0,
            recent: VecDeque::new(),
            encoded: HashMap::new(),
            reading: None,
            used: Instant::now(),
        }
    }

    /// Whether the watch keeps this group's view current.
    fn followed(&self) -> bool {
        self.tx.receiver_count() > 0 || self.used.elapsed() < FOLLOW_FOR
    }

    fn remember(&mut self, view: &Arc<View>) {
        if self.recent.back().is_some_and(|v| v.epoch == view.epoch) {
            return;
        }
        self.recent.retain(|v| v.epoch != view.epoch);
        self.recent.push_back(view.clone());
        while self.recent.len() > DELTA_BASES {
            self.recent.pop_front();
        }
    }
}

/// The service: the registry plus, per group, the held view long-polls
/// wait on and the bases and encodings of the views it sends.
pub struct Mds {
    pub reg: Registry,
    watch_etcd: etcd_client::Client,
    /// Per group: the newest view read, with the number of the read that
    /// got it (see `read_seq`).
    groups: Mutex<HashMap<String, Group>>,
    /// The etcd watch is established; while false, long-polls re-read.
    watching: AtomicBool,
    /// Numbers every view read as it starts, so a read that started earlier
    /// (and may have seen an older view) never replaces a later one: a slow
    /// refresh finishing after a long-poll's own read cannot hand that
    /// long-poll an older epoch.
    read_seq: std::sync::atomic::AtomicU64,
    /// Test only (`KVMDS_TEST_FREEZE_HELD_VIEW=1` in the environment at
    /// start, see [`FREEZE_HELD_VIEW_ENV`]): the first view held for a group
    /// is never replaced, so plain polls keep getting it while etcd moves
    /// on, as from a replica whose watch lags. Never set in production.
    freeze_held: bool,
}

/// The environment variable of the test-only hook that freezes the views a
/// replica holds (the end-to-end tests' stale replica); read once at start.
pub const FREEZE_HELD_VIEW_ENV: &str = "KVMDS_TEST_FREEZE_HELD_VIEW";

/// How kv-mds reaches a production etcd: TLS with a client certificate,
/// and etcd's user/password authentication (DEPLOY.md, "etcd").
#[derive(Debug, Clone, Default)]
pub struct EtcdSecurity {
    /// PEM files: the CA that signed etcd's certificate, and this client's
    /// certificate and key (both or neither). With a CA, endpoints given
    /// without a scheme are dialled over https.
    pub ca: Option<Vec<u8>>,
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    /// etcd user and password: the client authenticates at start and again
    /// whenever etcd says its token expired.
    pub user: Option<(String, String)>,
}

impl EtcdSecurity {
    fn tls(&self) -> Option<etcd_client::TlsOptions> {
        if self.ca.is_none() && self.identity.is_none() {
            return None;
        }
        let mut t = etcd_client::TlsOptions::new();
        if let Some(ca) = &self.ca {
            t = t.ca_certificate(etcd_client::Certificate::from_pem(ca));
        }
        if let Some((cert, key)) = &self.identity {
            t = t.identity(etcd_client::Identity::from_pem(cert, key));
        }
        Some(t)
    }

    fn apply(&self, mut o: ConnectOptions) -> ConnectOptions {
        if let Some(t) = self.tls() {
            o = o.with_tls(t);
        }
        if let Some((u, p)) = &self.user {
            o = o.with_user(u.clone(), p.clone()).with_auto_token_refresh(true);
        }
        o
    }
}

/// Connects to etcd. The connection is made lazily and re-made after
/// failures, so this succeeds while etcd is down; calls then fail until it
/// is back. With a user, the client must authenticate first: then this
/// waits for etcd (logging once), and a refused password is an error.
/// `handoff`: how long replaced member sets stay in views (zero: off).
/// `nodes`: the runtime that serves nodes' calls, if not this one (their
/// etcd client is made there).
pub async fn connect(
    endpoints: &[String],
    ttl: Duration,
    handoff: Duration,
    sec: &EtcdSecurity,
    nodes: Option<&tokio::runtime::Handle>,
) -> Result<Arc<Mds>, String> {
    let tls = sec.tls().is_some();
    let urls: Vec<String> = endpoints
        .iter()
        .map(|e| match (e.contains("://"), tls) {
            (true, _) => e.clone(),
            (false, true) => format!("https://{e}"),
            (false, false) => format!("http://{e}"),
        })
        .collect();
    if tls {
        if let Some(u) = urls.iter().find(|u| u.starts_with("http://")) {
            return Err(format!("--etcd {u}: TLS options (--etcd-cacert, --etcd-cert) need https:// endpoints"));
        }
    }
    let joined = endpoints.join(",");
    let unary = sec.apply(
        ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(1))
            .with_timeout(Duration::from_millis(1500))
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5)),
    );
    let streaming = sec.apply(
        ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            // etcd refuses HTTP/2 pings more often than every 5 s (its
            // --grpc-keepalive-min-time) by closing the connection; a dead etcd
            // process is noticed at once anyway (the connection resets).
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
            .with_keep_alive_while_idle(true),
    );
    let etcd = connect_one(&urls, unary.clone(), &joined, sec.user.is_some()).await?;
    let watch_etcd = connect_one(&urls, streaming, &joined, sec.user.is_some()).await?;
    let mut reg = Registry::new(etcd, joined.clone(), ttl).with_handoff(handoff);
    if let Some(nodes) = nodes {
        // Made on the nodes' runtime: its connections are driven there.
        let (urls, auth) = (urls.clone(), sec.user.is_some());
        let made = nodes.spawn(async move { connect_one(&urls, unary, &joined, auth).await });
        let node_etcd = made.await.map_err(|e| format!("cannot set up the nodes' etcd client: {e}"))??;
        reg = reg.with_node_etcd(node_etcd);
    }
    Ok(Arc::new(Mds {
        reg,
        watch_etcd,
        groups: Mutex::default(),
        watching: AtomicBool::new(false),
        read_seq: std::sync::atomic::AtomicU64::new(0),
        freeze_held: freeze_held(),
    }))
}

/// Whether the test-only hook [`FREEZE_HELD_VIEW_ENV`] is on (logged, so a
/// replica started with it by mistake says so).
fn freeze_held() -> bool {
    let on = std::env::var(FREEZE_HELD_VIEW_ENV).is_ok_and(|v| v == "1");
    if on {
        tracing::warn!("{FREEZE_HELD_VIEW_ENV}=1: TEST ONLY, views held for polls are never refreshed");
    }
    on
}

/// One client. Without a user it connects lazily; with one it
/// authenticates, retrying while etcd cannot be reached.
async fn connect_one(
    urls: &[String],
    opts: ConnectOptions,
    joined: &str,
    authenticates: bool,
) -> Result<etcd_client::Client, String> {
    let mut logged = false;
    loop {
        match etcd_client::Client::connect(urls, Some(opts.clone())).await {
            Ok(c) => {
                if logged {
                    tracing::info!(etcd = joined, "etcd reachable: authenticated");
                }
                return Ok(c);
            }
            Err(e) if authenticates && unreachable(&e) => {
                if !logged {
                    tracing::warn!(etcd = joined, error = %e, "etcd does not answer yet: waiting to authenticate (retrying every second)");
                    logged = true;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => return Err(format!("cannot set up the etcd client for {joined}: {e}")),
        }
    }
}

/// Whether a connect error means etcd was not reached (as opposed to a
/// refused password or a bad certificate).
fn unreachable(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        etcd_client::Error::GRpcStatus(s) => {
            matches!(s.code(), tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown)
                && !s.message().contains("authentication failed")
        }
        _ => false,
    }
}

impl Mds {
    /// The number of a view read about to start.
    fn next_read(&self) -> u64 {
        self.read_seq.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// A receiver that sees each new view of `group` (as the watch finds it).
    fn subscribe(&self, group: &str) -> Option<watch::Receiver<Option<Numbered>>> {
        let mut g = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        Mds::group_entry(&mut g, group).map(|grp| {
            grp.used = Instant::now();
            grp.tx.subscribe()
        })
    }

    /// The group's entry, made if there is room: groups no longer followed
    /// make room, then the one polled least recently that no long-poll
    /// waits on (plain polls of made-up names cannot crowd out the groups
    /// long-polls follow).
    fn group_entry<'a>(g: &'a mut HashMap<String, Group>, group: &str) -> Option<&'a mut Group> {
        if !g.contains_key(group) {
            if g.len() >= MAX_GROUPS {
                g.retain(|_, grp| grp.followed());
            }
            if g.len() >= MAX_GROUPS {
                let oldest = g
                    .iter()
                    .filter(|(_, grp)| grp.tx.receiver_count() == 0)
                    .min_by_key(|(_, grp)| grp.used)
                    .map(|(name, _)| name.clone())?;
                g.remove(&oldest);
            }
            g.insert(group.to_string(), Group::new());
        }
        g.get_mut(group)
    }

    /// Re-reads a followed group's view and publishes it if the epoch
    /// changed (retrying a few times: a lost refresh would leave waiters
    /// asleep until their deadline).
    async fn refresh(&self, group: &str) {
        if self.freeze_held {
            return;
        }
        {
            let groups = self.groups.lock().unwrap_or_else(|e| e.into_inner());
            match groups.get(group) {
                Some(grp) if grp.followed() => {}
                Some(Group { tx, .. }) => {
                    // Nobody waits: drop the view held rather than read it;
                    // the next long-poll reads etcd (a view held through a
                    // change nobody refreshed would be stale).
                    tx.send_replace(None);
                    return;
                }
                None => return,
            }
        }
        let mut backoff = Duration::from_millis(50);
        let (seq, view) = loop {
            let seq = self.next_read();
            match self.reg.view(group).await {
                Ok(v) => break (seq, v),
                Err(e) if backoff > Duration::from_millis(800) => {
                    tracing::warn!(group, error = %e, "cannot refresh a view after a change: long-polls re-read at their deadline");
                    // The view held is no longer known to be current: long-polls
                    // read etcd again until a refresh succeeds.
                    if let Some(grp) = self.groups.lock().unwrap_or_else(|e| e.into_inner()).get(group) {
                        grp.tx.send_replace(None);
                    }
                    return;
                }
                Err(_) => {
                    tokio::time::sleep(backoff).await;
                    backoff *= 2;
                }
            }
        };
        self.publish(group, seq, view);
    }

    /// Makes `view` (read as number `seq`) the group's view held for its
    /// long-polls, unless a later read holds another epoch already; returns
    /// it as held.
    fn publish(&self, group: &str, seq: u64, view: View) -> Held {
        let held = Held::new(seq, view);
        if let Some(grp) = self.groups.lock().unwrap_or_else(|e| e.into_inner()).get_mut(group) {
            // `!=`, not `>`: after etcd lost its data, revisions restart
            // lower. Only a read that started after the one published
            // replaces it (and only a view published is a base for deltas,
            // so the newest base stays last).
            let published = grp.tx.send_if_modified(|cur| {
                let changed =
                    cur.as_ref().is_none_or(|c| seq > c.seq && held.view.epoch != c.view.epoch && !self.freeze_held);
                if changed {
                    *cur = Some(held.clone());
                }
                changed
            });
            if published {
                grp.remember(&held.view);
            }
        }
        held
    }

    /// The group's view now, for a plain poll: the view the etcd watch
    /// holds when there is one (no etcd read), else read.
    ///
    /// With `min_epoch` (the caller heard of that epoch, maybe from another
    /// replica; 0: any), a held view older than it is not answered: the
    /// view is read from etcd as for a long-poll ([`Mds::read_at_least`]),
    /// so the answer is older only if etcd itself went back
    /// (docs/PROTOCOL.md §6, `min_epoch`).
    pub async fn current_view(&self, group: &str, min_epoch: u64) -> Result<Held, RegError> {
        let held = {
            let mut g = self.groups.lock().unwrap_or_else(|e| e.into_inner());
            Mds::group_entry(&mut g, group).and_then(|grp| {
                grp.used = Instant::now();
                grp.tx.borrow().clone()
            })
        };
        let held = held.filter(|_| self.watching.load(Ordering::SeqCst));
        if let Some(h) = held.as_ref().filter(|h| h.view.epoch >= min_epoch) {
            self.reg.counters.polls_from_cache.fetch_add(1, Ordering::Relaxed);
            return Ok(h.clone());
        }
        if held.is_some() {
            // Behind the caller: the watch has not delivered the change yet.
            self.reg.counters.polls_behind_min_epoch.fetch_add(1, Ordering::Relaxed);
            return self.read_at_least(group, min_epoch).await;
        }
        let h = self.read_at_least(group, min_epoch).await?;
        if h.view.epoch == 0 && h.view.members.is_empty() {
            // No such group: not worth following.
            let mut g = self.groups.lock().unwrap_or_else(|e| e.into_inner());
            if g.get(group).is_some_and(|grp| grp.tx.receiver_count() == 0 && grp.reading.is_none()) {
                g.remove(group);
            }
        }
        Ok(h)
    }

    /// A view read for a long-poll holding epoch `after`: the shared read,
    /// unless it is older than `after` (it may have started before the
    /// change the caller heard of from another replica), then a read of
    /// its own: a client is never handed an epoch older than it holds
    /// (unless etcd itself went back, after losing its data).
    async fn read_at_least(&self, group: &str, after: u64) -> Result<Held, RegError> {
        let shared = self.read_shared(group).await?;
        if shared.view.epoch >= after {
            return Ok(shared);
        }
        let seq = self.next_read();
        Ok(self.publish(group, seq, self.reg.view(group).await?))
    }

    /// Sets a group's placement rule and holds the view it gives, so this
    /// replica's next answers name the rule at once.
    pub async fn set_placement(&self, group: &str, rule: kv_common::ring::Placement) -> Result<Held, RegError> {
        let seq = self.next_read();
        let v = self.reg.set_placement(group, rule).await?;
        Ok(self.publish(group, seq, v))
    }

    /// Reads the group's view from etcd and publishes it. Callers that
    /// arrive while a read of the group is under way share its answer
    /// rather than start their own: a fleet re-polling at once costs etcd
    /// one read, not one per client.
    async fn read_shared(&self, group: &str) -> Result<Held, RegError> {
        let cell = {
            let mut g = self.groups.lock().unwrap_or_else(|e| e.into_inner());
            Mds::group_entry(&mut g, group)
                .map(|grp| grp.reading.get_or_insert_with(|| Arc::new(tokio::sync::OnceCell::new())).clone())
        };
        let Some(cell) = cell else {
            // No room to follow the group: a read of its own.
            let seq = self.next_read();
            return Ok(Held::new(seq, self.reg.view(group).await?));
        };
        let mine = cell.clone();
        cell.get_or_init(|| async move {
            let seq = self.next_read();
            let r = self.reg.view(group).await.map(|v| self.publish(group, seq, v)).map_err(|e| e.to_string());
            // Callers from now on start a read of their own.
            if let Some(grp) = self.groups.lock().unwrap_or_else(|e| e.into_inner()).get_mut(group) {
                if grp.reading.as_ref().is_some_and(|c| Arc::ptr_eq(c, &mine)) {
                    grp.reading = None;
                }
            }
            r
        })
        .await
        .clone()
        .map_err(RegError::Conflict)
    }

    /// The JSON body answering `held` to a caller that holds epoch `base`
    /// and takes deltas (None: the whole view), and whether it is a delta.
    /// A delta is sent when the base is the view's own epoch (nothing
    /// changed) or one this replica served recently (docs/PROTOCOL.md §6,
    /// "Deltas"). Each body is made once and shared by
    /// every caller that wants the same within a second; previous sets'
    /// time left counts from when the view was read.
    ///
    /// Previous sets placed by a rule the caller did not name (`rules`) are
    /// left out of its answer: it would build their rings by another rule.
    pub fn encode(&self, group: &str, held: &Held, base: Option<u64>, rules: &str) -> (hyper::body::Bytes, bool) {
        let unknown = held.view.previous.iter().any(|p| !knows_rule(rules, p.placement.as_deref()));
        let (cell, base_view) = {
            let mut groups = self.groups.lock().unwrap_or_else(|e| e.into_inner());
            match groups.get_mut(group) {
                Some(grp) => {
                    // A long-poll ending at its deadline holds the epoch
                    // already: a change of nothing.
                    let base_view = base.and_then(|b| {
                        if b == held.view.epoch {
                            Some(held.view.clone())
                        } else {
                            grp.recent.iter().find(|v| v.epoch == b).cloned()
                        }
                    });
                    // Callers that miss a rule of the previous sets get
                    // them filtered by what they named: a body of their own.
                    let kept = || {
                        let known = held.view.previous.iter().filter(|p| knows_rule(rules, p.placement.as_deref()));
                        known.map(|p| p.epoch).collect::<Vec<u64>>()
                    };
                    let key = (base_view.as_ref().map(|v| v.epoch), unknown.then(kept));
                    let epoch = held.view.epoch;
                    grp.encoded.retain(|_, (e, at, _)| *e == epoch && at.elapsed() < ENCODING_FOR);
                    let cell = grp
                        .encoded
                        .entry(key)
                        .or_insert_with(|| (epoch, Instant::now(), Arc::new(OnceLock::new())))
                        .2
                        .clone();
                    (cell, base_view)
                }
                None => (Arc::new(OnceLock::new()), None),
            }
        };
        let is_delta = base_view.is_some();
        let body = cell
            .get_or_init(|| {
                let c = &self.reg.counters;
                c.view_encodings.fetch_add(1, Ordering::Relaxed);
                let mut v = (*held.view).clone();
                let aged = held.at.elapsed().as_millis() as u64;
                v.previous.retain(|p| p.remaining_ms > aged && knows_rule(rules, p.placement.as_deref()));
                v.previous.iter_mut().for_each(|p| p.remaining_ms -= aged);
                if let Some(b) = &base_view {
                    v.delta = Some(kv_common::mds::ViewDelta::between(
                        b.epoch,
                        &b.members,
                        &v.members,
                        v.placement.as_deref(),
                    ));
                    v.members = Vec::new();
                }
                hyper::body::Bytes::from(serde_json::to_vec(&v).unwrap_or_default())
            })
            .clone();
        let c = &self.reg.counters;
        if is_delta {
            c.views_delta.fetch_add(1, Ordering::Relaxed);
            c.view_bytes_delta.fetch_add(body.len() as u64, Ordering::Relaxed);
        } else {
            c.view_bytes_full.fetch_add(body.len() as u64, Ordering::Relaxed);
        }
        (body, is_delta)
    }

    /// The view once its epoch differs from `after`, or at `wait`'s end.
    ///
    /// While the etcd watch runs, the group's view it last published is
    /// current (every change of the group's keys refreshes it), so a
    /// long-poll that holds that epoch already waits on it without reading
    /// etcd, on entry or at its deadline: a fleet's re-polls after a change
    /// cost etcd nothing. Otherwise (no watch, nothing held yet, a refresh
    /// that failed, a client ahead of this replica) the view is read.
    pub async fn wait_view(&self, group: &str, after: u64, wait: Duration) -> Result<Held, RegError> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut rx = self.subscribe(group);
        let held = |rx: &mut Option<watch::Receiver<Option<Numbered>>>| -> Option<Numbered> {
            if !self.watching.load(Ordering::SeqCst) {
                return None;
            }
            rx.as_mut().and_then(|r| r.borrow_and_update().clone())
        };
        let mut v = match held(&mut rx) {
            Some(h) if h.view.epoch == after => {
                self.reg.counters.views_from_cache.fetch_add(1, Ordering::Relaxed);
                h
            }
            _ => self.read_at_least(group, after).await?,
        };
        loop {
            if v.view.epoch != after || tokio::time::Instant::now() >= deadline {
                return Ok(v);
            }
            // Without a working watch, fall back to re-reading twice a second.
            let polling = !self.watching.load(Ordering::SeqCst) || rx.is_none();
            let slice = if polling { Duration::from_millis(500) } else { Duration::from_secs(3600) };
            let until = deadline.min(tokio::time::Instant::now() + slice);
            let timer = async {
                tokio::time::sleep_until(until).await;
            };
            match rx.as_mut() {
                Some(r) => {
                    tokio::select! {
                        changed = r.changed() => {
                            if changed.is_ok() {
                                // A view read before ours is not newer than ours.
                                let got = r.borrow_and_update().clone();
                                match got {
                                    Some(h) if h.seq > v.seq => v = h,
                                    Some(_) => {}
                                    None => {
                                        // The view held was dropped (a refresh
                                        // failed): read it now.
                                        v = self.read_at_least(group, after).await?;
                                    }
                                }
                            }
                        }
                        _ = timer => {
                            // At the deadline with the watch running and a view
                            // held, `v` is current: answer it without a read.
                            let current = !polling && r.borrow().is_some();
                            if !current {
                                v = self.read_at_least(group, after).await?;
                            }
                        }
                    }
                }
                None => {
                    timer.await;
                    let seq = self.next_read();
                    v = Held::new(seq, self.reg.view(group).await?);
                }
            }
        }
    }

    /// Follows every group's keys with one etcd watch, for as long as the
    /// process runs; re-established with backoff when etcd goes away.
    pub async fn watch_loop(self: Arc<Self>) {
        let mut backoff = Duration::from_millis(100);
        loop {
            let mut etcd = self.watch_etcd.clone();
            // Start the watch just after the current revision, so nothing
            // between the catch-up refresh below and the watch is missed.
            let start =
                match etcd.get(ETCD_ROOT, Some(GetOptions::new().with_prefix().with_keys_only().with_limit(1))).await {
                    Ok(r) => r.header().map(|h| h.revision() + 1),
                    Err(_) => None,
                };
            if let Some(rev) = start {
                let opts = WatchOptions::new().with_prefix().with_start_revision(rev);
                if let Ok(mut ws) = etcd.watch(ETCD_ROOT, Some(opts)).await {
                    backoff = Duration::from_millis(100);
                    tracing::debug!(revision = rev, "watching membership keys");
                    // Changes missed while the watch was down; held views
                    // are served as current only from then on.
                    self.refresh_all().await;
                    self.watching.store(true, Ordering::SeqCst);
                    while let Ok(Some(resp)) = ws.message().await {
                        let mut touched: Vec<String> = Vec::new();
                        for ev in resp.events() {
                            if let Some(g) = ev.kv().and_then(|kv| registry::group_of_key(kv.key())) {
                                if !touched.iter().any(|t| t == g) {
                                    touched.push(g.to_string());
                                }
                            }
                        }
                        for g in touched {
                            self.refresh(&g).await;
                        }
                        if resp.canceled() {
                            break;
                        }
                    }
                    self.watching.store(false, Ordering::SeqCst);
                    // Nothing keeps the held views current now.
                    for grp in self.groups.lock().unwrap_or_else(|e| e.into_inner()).values() {
                        grp.tx.send_replace(None);
                    }
                    tracing::warn!("etcd watch ended: long-polls re-read etcd until it is back");
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    async fn refresh_all(&self) {
        let groups: Vec<String> = {
            let mut g = self.groups.lock().unwrap_or_else(|e| e.into_inner());
            g.retain(|_, grp| grp.followed());
            g.keys().cloned().collect()
        };
        for g in groups {
            self.refresh(&g).await;
        }
    }

    /// Drops per-group and per-node state nobody uses any more, every TTL.
    pub async fn sweep_loop(self: Arc<Self>) {
        loop {
            tokio::time::sleep(self.reg.ttl.max(Duration::from_secs(1))).await;
            self.reg.sweep();
            self.groups.lock().unwrap_or_else(|e| e.into_inner()).retain(|_, grp| grp.followed());
        }
    }
}

/// Parses a duration: `30s`, `500ms`, `2m`, or a plain number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => (&s[..i], &s[i..]),
        None => (s, "s"),
    };
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a duration (e.g. 30s, 500ms, 2m)"))?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n * 60),
        _ => return Err(format!("{s:?} is not a duration (e.g. 30s, 500ms, 2m)")),
    };
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_callers_name() {
        assert!(knows_rule("", None), "callers naming no rules know ketama, as earlier releases");
        assert!(!knows_rule("", Some("multiprobe")));
        assert!(knows_rule("ketama,multiprobe", Some("multiprobe")));
        assert!(knows_rule("ketama%2Cmultiprobe", Some("multiprobe")));
        assert!(!knows_rule("ketama", Some("multiprobe")));
        assert!(knows_rule("multiprobe", Some("multiprobe")) && !knows_rule("multiprobe", None));
        assert!(knows_rule("ketama%2cmultiprobe", Some("multiprobe")) && knows_rule(" ketama , multiprobe", None));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("3s").unwrap(), Duration::from_secs(3));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("x").is_err());
        assert!(parse_duration("3h").is_err());
    }
}
