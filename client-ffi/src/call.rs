//! A bound on a whole call, per calling thread (`kv_set_call_timeout_ms`).
//!
//! An engine plugin must not let a sick node stretch its step, yet it may
//! never walk away from a call that holds pointers into the engine's
//! memory: a put left running computes its CRC over bytes the engine may
//! already have reused, a get left running writes into blocks that belong
//! to another request by then. So the bound is kept here, inside the call:
//! every request the call makes gets at most what is left of the call's
//! time (the I/O timeout still applies when it is shorter), items not
//! answered by then get KV_TIMEOUT, and the call returns only after all of
//! its work has stopped (timed-out exchanges are dropped with their
//! connections before the call returns, never left behind).
//!
//! The setting is the calling thread's (any handle); the deadline is taken
//! when a call starts. Every part of a call is driven on the calling
//! thread (the blocking paths, and `block_on` for the async core), which
//! is what lets a thread-local carry it down.

use std::cell::Cell;
use std::time::{Duration, Instant};

thread_local! {
    /// Milliseconds a call from this thread may take; 0: unbounded.
    static TIMEOUT_MS: Cell<u32> = const { Cell::new(0) };
    /// The running call's end and budget, while a bounded call runs.
    static CURRENT: Cell<Option<(Instant, Duration)>> = const { Cell::new(None) };
}

/// Sets this thread's call bound (0: none); returns the previous one.
pub fn set_timeout_ms(ms: u32) -> u32 {
    TIMEOUT_MS.with(|t| t.replace(ms))
}

/// This thread's call bound (0: none).
pub fn timeout_ms() -> u32 {
    TIMEOUT_MS.with(|t| t.get())
}

/// Runs `f` as one call: with this thread's bound in force, if it has one.
/// A call inside a call keeps the outer deadline.
pub fn scoped<R>(f: impl FnOnce() -> R) -> R {
    let ms = timeout_ms();
    if ms == 0 || CURRENT.with(|c| c.get()).is_some() {
        return f();
    }
    let budget = Duration::from_millis(u64::from(ms));
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            CURRENT.with(|c| c.set(None));
        }
    }
    CURRENT.with(|c| c.set(Some((Instant::now() + budget, budget))));
    let _reset = Reset;
    f()
}

/// The running call's (end, budget), when it is bounded.
pub fn current() -> Option<(Instant, Duration)> {
    CURRENT.with(|c| c.get())
}

/// `deadline`, or the call's end when that comes first.
pub fn clamp(deadline: Instant) -> Instant {
    match current() {
        Some((end, _)) => deadline.min(end),
        None => deadline,
    }
}

/// A request's time: `io`, or what is left of the call when that is less.
pub fn clamp_io(io: Duration) -> Duration {
    match current() {
        Some((end, _)) => io.min(end.saturating_duration_since(Instant::now())),
        None => io,
    }
}

/// Whether a request started at `started` and stopped by `deadline` was
/// cut by the call's end after less than half the call's budget: it was
/// not given a fair time, so its node is not blamed (no cool-down).
pub fn cut_early(started: Instant, deadline: Instant) -> bool {
    match current() {
        Some((end, budget)) => deadline >= end && end.saturating_duration_since(started) < budget / 2,
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bound_applies_inside_a_call_only_and_nests_to_the_outer_deadline() {
        assert_eq!(set_timeout_ms(200), 0);
        assert!(current().is_none(), "outside a call nothing is bounded");
        let io = Duration::from_secs(10);
        scoped(|| {
            let (end, budget) = current().expect("bounded");
            assert_eq!(budget, Duration::from_millis(200));
            assert!(clamp_io(io) <= Duration::from_millis(200));
            let far = Instant::now() + io;
            assert_eq!(clamp(far), end);
            // A nested call keeps the outer end.
            scoped(|| assert_eq!(current().map(|c| c.0), Some(end)));
            // A request begun at once and cut at the end had its time...
            assert!(!cut_early(end - budget, end));
            // ...one begun 10 ms before the end did not.
            assert!(cut_early(end - Duration::from_millis(10), end));
        });
        assert!(current().is_none());
        assert_eq!(set_timeout_ms(0), 200);
        scoped(|| assert!(current().is_none(), "0: unbounded"));
        assert_eq!(clamp_io(io), io);
    }
}
