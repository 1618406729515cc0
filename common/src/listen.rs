//! The accept loop every listener of the daemons shares: the node's data
//! port, the node's metrics port and kv-mds's API (docs/ARCHITECTURE.md,
//! "Listeners").
//!
//! A connection lives in two stages:
//!
//! 1. **Opening**, from accept until the peer has shown it is a client (the
//!    data plane: its hello was accepted; HTTP: its first bytes arrived).
//!    Openings have their own small budget ([`Gate::max_opening`]) and a
//!    short deadline ([`Gate::opening_deadline`]). When the budget is full,
//!    the oldest opening is closed to make room once it is [`MIN_AGE`] old
//!    (until then new connections wait in the kernel's backlog, so a burst
//!    of real clients reconnecting at once is not cut off), so sockets that
//!    never speak, however often they are refreshed, cannot keep a real
//!    client from getting in: its hello arrives within a round trip.
//! 2. **Admitted**, once the service calls [`Opening::admit`]: the
//!    connection holds one of [`Gate::max_conns`] slots until it ends. At the
//!    cap `admit` says no and the service answers its own clear refusal (a
//!    "busy" hello, a 503); until that answer is written the connection is
//!    still an opening, so refusals are bounded by the same budget.
//!
//! On shutdown the loop stops accepting, closes the openings, and waits for
//! the admitted connections, each of which watches the same shutdown signal
//! and ends in its own way (the data plane answers what was sent, HTTP ends
//! after the request in flight), for at most [`Gate::drain_limit`] (None:
//! as long as they take).

use std::collections::VecDeque;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};

/// What a listener admits, and for how long it waits.
#[derive(Debug, Clone)]
pub struct Gate {
    /// Names the listener in log lines ("data port", "metrics port", "API").
    pub name: &'static str,
    /// Admitted connections at once.
    pub max_conns: usize,
    /// Connections still opening at once; past it the oldest is closed.
    pub max_opening: usize,
    /// Time from accept until the service must have admitted the connection.
    pub opening_deadline: Duration,
    /// Longest wait for connections to end after shutdown (then they are
    /// dropped, which closes them); None: no limit.
    pub drain_limit: Option<Duration>,
    /// Runtimes the connections are spread over, in turn (each connection
    /// lives on one for its whole life); empty: the accept loop's own.
    pub spread: Vec<tokio::runtime::Handle>,
}

/// Openings kept by default: far above what real clients have in their
/// first round trip at once, far below a connection cap.
pub const MAX_OPENING: usize = 256;

/// The youngest opening closed to make room: a real client's hello comes
/// within a round trip, so one this old is not about to say it.
pub const MIN_AGE: Duration = Duration::from_secs(1);

/// What [`Opening::admit`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Admitted: the connection holds one of the listener's slots.
    Admitted,
    /// Every slot is taken: the service answers its refusal ("busy", 503).
    Full,
    /// This opening was already closed to make room (or shutdown began):
    /// the connection ends without an answer.
    Closed,
}

impl Gate {
    /// A gate with the default opening budget.
    pub fn new(
        name: &'static str,
        max_conns: usize,
        opening_deadline: Duration,
        drain_limit: Option<Duration>,
    ) -> Gate {
        Gate { name, max_conns, max_opening: MAX_OPENING, opening_deadline, drain_limit, spread: Vec::new() }
    }
}

/// What a listener counts (a daemon shows them in its metrics).
#[derive(Debug, Default)]
pub struct Counters {
    /// Openings closed: no hello or first bytes before the deadline, or the
    /// oldest closed to make room for a new one.
    pub openings_closed: AtomicU64,
}

/// What serves the connections of one listener.
pub trait Service: Send + Sync + 'static {
    /// Serves one connection until it ends. It calls [`Opening::admit`]
    /// once the peer has shown it is a client, and answers a refusal itself
    /// when that says no. Dropping the future closes the connection.
    fn serve(self: Arc<Self>, conn: Accepted) -> impl Future<Output = ()> + Send;
}

/// One accepted connection, handed to [`Service::serve`].
pub struct Accepted {
    pub stream: TcpStream,
    pub peer: SocketAddr,
    pub opening: Opening,
    /// Turns true when the daemon shuts down.
    pub shutdown: watch::Receiver<bool>,
}

/// The openings of one listener, oldest first.
struct Openings {
    next: u64,
    /// Id, what closes it, and when it was accepted.
    queue: VecDeque<(u64, Arc<Notify>, Instant)>,
}

struct Slots {
    conns: Arc<Semaphore>,
    openings: Mutex<Openings>,
    counters: Arc<Counters>,
}

/// A connection's place in its listener: opening until [`Opening::admit`]
/// says yes, then one of the admitted slots until the connection ends.
pub struct Opening {
    id: u64,
    slots: Arc<Slots>,
    /// Held by the loop's task as well, so the slot lasts as long as the
    /// connection whatever the service does with this handle.
    permit: Arc<Mutex<Option<OwnedSemaphorePermit>>>,
}

impl Opening {
    /// Takes an admitted slot, if one is free and this opening is still
    /// open.
    pub fn admit(&self) -> Admission {
        let mut g = lock(&self.slots.openings);
        let Some(at) = g.queue.iter().position(|(id, _, _)| *id == self.id) else {
            return Admission::Closed;
        };
        let Ok(permit) = self.slots.conns.clone().try_acquire_owned() else {
            return Admission::Full;
        };
        g.queue.remove(at);
        *lock(&self.permit) = Some(permit);
        Admission::Admitted
    }
}

impl Drop for Opening {
    fn drop(&mut self) {
        let mut g = lock(&self.slots.openings);
        g.queue.retain(|(id, _, _)| *id != self.id);
    }
}

/// How an HTTP connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpEnd {
    Served,
    /// Refused at the connection cap with a 503.
    Refused,
}

/// Serves one HTTP/1.1 connection of a listener: admitted on its first
/// bytes; at the cap answered `503` with `busy` (a JSON body) and closed;
/// otherwise served by `service` with keep-alive, `header_timeout` for each
/// request's head, and ended after the request in flight on shutdown.
pub async fn serve_http<S, B>(conn: Accepted, service: S, busy: &str, header_timeout: Duration) -> HttpEnd
where
    S: hyper::service::Service<hyper::Request<hyper::body::Incoming>, Response = hyper::Response<B>>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: hyper::body::Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let Accepted { mut stream, peer, opening, mut shutdown } = conn;
    // The first bytes end the opening (a peer that closes first is done).
    if !matches!(stream.peek(&mut [0u8; 1]).await, Ok(n) if n > 0) {
        return HttpEnd::Served;
    }
    match opening.admit() {
        Admission::Admitted => {}
        Admission::Full => {
            refuse_http(&mut stream, busy).await;
            return HttpEnd::Refused;
        }
        Admission::Closed => return HttpEnd::Served,
    }
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(header_timeout)
        .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
    tokio::pin!(conn);
    let ended = tokio::select! {
        r = conn.as_mut() => r,
        _ = stopped(&mut shutdown) => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = ended {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
    HttpEnd::Served
}

/// A 503 with `body`, then close after the peer's FIN (closing with its
/// request unread would reset the connection and could lose the answer).
async fn refuse_http(stream: &mut TcpStream, body: &str) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let reply = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        stream.write_all(reply.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}

/// Resolves once shutdown has been signalled (or its sender is gone).
pub async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await.map(|_| ());
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Accepts on `listener` and serves each connection with `service` until
/// `shutdown` turns true, then waits for the connections (up to
/// [`Gate::drain_limit`]).
pub async fn run<S: Service>(
    listener: TcpListener,
    gate: Gate,
    counters: Arc<Counters>,
    service: Arc<S>,
    mut shutdown: watch::Receiver<bool>,
) {
    let slots = Arc::new(Slots {
        conns: Arc::new(Semaphore::new(gate.max_conns)),
        openings: Mutex::new(Openings { next: 0, queue: VecDeque::new() }),
        counters,
    });
    let mut tasks = tokio::task::JoinSet::new();
    let mut backoff = Duration::from_millis(5);
    let closed_logged = crate::daemon::Throttle::new(Duration::from_secs(60));
    'accept: loop {
        // The budget full of openings younger than MIN_AGE: new connections
        // wait in the backlog until one ends or is old enough to close.
        loop {
            let wait = {
                let g = lock(&slots.openings);
                match g.queue.front() {
                    Some((_, _, since)) if g.queue.len() >= gate.max_opening.max(1) => {
                        MIN_AGE.saturating_sub(since.elapsed())
                    }
                    _ => Duration::ZERO,
                }
            };
            if wait.is_zero() {
                break;
            }
            tokio::select! {
                biased;
                _ = stopped(&mut shutdown) => break 'accept,
                _ = tokio::time::sleep(wait.min(Duration::from_millis(5))) => {}
            }
        }
        let accepted = tokio::select! {
            biased;
            _ = stopped(&mut shutdown) => break,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(a) => {
                backoff = Duration::from_millis(5);
                a
            }
            Err(e) => {
                // EMFILE and the like: wait and retry rather than spin or die.
                tracing::warn!(listener = gate.name, error = %e, "accept failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        let (id, kick) = {
            let mut g = lock(&slots.openings);
            if g.queue.len() >= gate.max_opening.max(1) {
                if let Some((_, oldest, _)) = g.queue.pop_front() {
                    oldest.notify_one();
                    slots.counters.openings_closed.fetch_add(1, Ordering::Relaxed);
                    if closed_logged.ready() {
                        tracing::warn!(listener = gate.name, budget = gate.max_opening,
                            "connections that have not said hello fill their budget: closing the oldest (one line a minute at most)");
                    }
                }
            }
            let id = g.next;
            g.next += 1;
            let kick = Arc::new(Notify::new());
            g.queue.push_back((id, kick.clone(), Instant::now()));
            (id, kick)
        };
        while tasks.try_join_next().is_some() {}
        let permit = Arc::new(Mutex::new(None));
        let opening = Opening { id, slots: slots.clone(), permit: permit.clone() };
        // A connection served on another runtime is registered with that
        // runtime's reactor: it leaves this one's as a plain socket.
        let (stream, home) = if gate.spread.is_empty() {
            (Ok(stream), None)
        } else {
            let home = gate.spread[id as usize % gate.spread.len()].clone();
            (Err(stream.into_std()), Some(home))
        };
        let shutdown_rx = shutdown.clone();
        let mut stop = shutdown.clone();
        let deadline = tokio::time::Instant::now() + gate.opening_deadline;
        let service = service.clone();
        let slots = slots.clone();
        let name = gate.name;
        let task = async move {
            let stream = match stream {
                Ok(s) => s,
                Err(moved) => match moved.and_then(TcpStream::from_std) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(listener = name, %peer, error = %e, "cannot move a connection to its runtime");
                        return;
                    }
                },
            };
            let conn = Accepted { stream, peer, opening, shutdown: shutdown_rx };
            // Ends the connection if it is still opening at its deadline,
            // when it is closed to make room, or at shutdown; never once
            // admitted (the service then ends it its own way).
            let watchdog = async {
                tokio::select! {
                    _ = tokio::time::sleep_until(deadline) => {
                        if lock(&permit).is_some() {
                            std::future::pending::<()>().await;
                        }
                        slots.counters.openings_closed.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(listener = name, %peer, "closing a connection that did not say hello in time");
                    }
                    _ = kick.notified() => {
                        tracing::debug!(listener = name, %peer, "closing the oldest unfinished opening");
                    }
                    _ = stopped(&mut stop) => {
                        if lock(&permit).is_some() {
                            std::future::pending::<()>().await;
                        }
                    }
                }
            };
            tokio::select! {
                _ = service.serve(conn) => {}
                _ = watchdog => {}
            }
            drop(permit);
        };
        match &home {
            Some(h) => tasks.spawn_on(task, h),
            None => tasks.spawn(task),
        };
    }
    drop(listener);
    if !tasks.is_empty() {
        tracing::info!(listener = gate.name, connections = tasks.len(), "shutting down: finishing requests in flight");
    }
    let drain = async { while tasks.join_next().await.is_some() {} };
    match gate.drain_limit {
        Some(limit) => {
            let _ = tokio::time::timeout(limit, drain).await;
        }
        None => drain.await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Echoes one byte per connection after a one-byte "hello" of 'h';
    /// answers 'b' (busy) when not admitted.
    struct Echo;

    impl Service for Echo {
        async fn serve(self: Arc<Self>, mut conn: Accepted) {
            let mut b = [0u8; 1];
            if conn.stream.read_exact(&mut b).await.is_err() || b[0] != b'h' {
                return;
            }
            let answer = if conn.opening.admit() == Admission::Admitted { b'a' } else { b'b' };
            let _ = conn.stream.write_all(&[answer]).await;
            if answer == b'b' {
                return;
            }
            while let Ok(1) = conn.stream.read(&mut b).await {
                if conn.stream.write_all(&b).await.is_err() {
                    return;
                }
            }
        }
    }

    async fn start(gate: Gate) -> (SocketAddr, Arc<Counters>, watch::Sender<bool>, tokio::task::JoinHandle<()>) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let counters = Arc::new(Counters::default());
        let (tx, rx) = watch::channel(false);
        let h = tokio::spawn(run(l, gate, counters.clone(), Arc::new(Echo), rx));
        (addr, counters, tx, h)
    }

    async fn hello(addr: SocketAddr) -> (TcpStream, u8) {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"h").await.expect("hello");
        let mut b = [0u8; 1];
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut b))
            .await
            .expect("answer in time")
            .expect("answer");
        (s, b[0])
    }

    /// Waits until `f` holds (polled, with a deadline).
    async fn until(what: &str, f: impl Fn() -> bool) {
        let t0 = Instant::now();
        while !f() {
            assert!(t0.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Silent sockets take no admitted slot and cannot keep a client out,
    /// however many are opened: the oldest is closed to make room, and the
    /// rest at their deadline.
    #[tokio::test]
    async fn silent_sockets_cannot_crowd_out_a_client() {
        let gate = Gate {
            name: "test",
            max_conns: 2,
            max_opening: 4,
            opening_deadline: Duration::from_secs(2),
            drain_limit: Some(Duration::from_secs(5)),
            spread: Vec::new(),
        };
        let (addr, counters, _tx, _h) = start(gate).await;
        // Twice the cap of silent sockets, and more than the opening budget.
        let mut silent = Vec::new();
        for _ in 0..8 {
            silent.push(TcpStream::connect(addr).await.expect("connect"));
        }
        until("the oldest openings closed", || counters.openings_closed.load(Ordering::Relaxed) >= 4).await;
        let (mut a, answer) = hello(addr).await;
        assert_eq!(answer, b'a', "a client gets in past silent sockets");
        let (_b, answer) = hello(addr).await;
        assert_eq!(answer, b'a');
        // The cap holds for admitted connections: a clear refusal.
        let (_c, answer) = hello(addr).await;
        assert_eq!(answer, b'b', "the third client is told busy");
        // The admitted connection outlives the opening deadline.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        a.write_all(b"x").await.expect("write");
        let mut b = [0u8; 1];
        a.read_exact(&mut b).await.expect("still served");
        assert_eq!(&b, b"x");
        // Every silent socket was closed by then.
        for mut s in silent {
            let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await.expect("closed in time");
            assert!(matches!(n, Ok(0) | Err(_)), "a silent socket is closed");
        }
    }

    /// A slot is given back when its connection ends, and the loop stops
    /// on shutdown once its connections have ended.
    #[tokio::test]
    async fn slots_come_back_and_shutdown_waits_for_connections() {
        let gate = Gate {
            name: "test",
            max_conns: 1,
            max_opening: 4,
            opening_deadline: Duration::from_secs(5),
            drain_limit: Some(Duration::from_secs(5)),
            spread: Vec::new(),
        };
        let (addr, _counters, tx, h) = start(gate).await;
        let (a, answer) = hello(addr).await;
        assert_eq!(answer, b'a');
        drop(a);
        let t0 = Instant::now();
        let mut s = loop {
            let (s, answer) = hello(addr).await;
            if answer == b'a' {
                break s;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "the slot came back");
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        // A socket that never says hello does not hold the shutdown up.
        let _silent = TcpStream::connect(addr).await.expect("connect");
        tx.send(true).expect("signal");
        // The loop waits for the open connection, which still answers.
        s.write_all(b"y").await.expect("write");
        let mut b = [0u8; 1];
        s.read_exact(&mut b).await.expect("answered during the drain");
        assert!(!h.is_finished());
        drop(s);
        let t0 = Instant::now();
        tokio::time::timeout(Duration::from_secs(5), h).await.expect("stops once connections end").expect("join");
        assert!(t0.elapsed() < Duration::from_secs(2), "openings are closed at shutdown (deadline 5 s)");
        assert!(TcpStream::connect(addr).await.is_err(), "no longer accepting");
    }
}
