//! A framed connection's host side reads its socket itself for a moment after it answered,
//! when the caller's next call has lately come quickly ([`IdleGaps`]), instead of parking its
//! worker thread in the reactor at once.
//!
//! Why: a sequential caller sends its next call a few microseconds after it read the last
//! reply. A host worker that parked meanwhile is woken by the kernel, and on a virtual machine
//! an idle vCPU takes tens of microseconds to wake, which is most of a loopback call's round
//! trip (`troupe bench rpc`: `rpc.remote.seq.p50_us` against `rpc.floor.seq.p50_us`, a raw
//! ping-pong whose ends never sleep). The controller's side polls for replies the same way
//! (`troupe_controller`'s `conn_framed.rs`). The wait is bounded by [`HOST_POLL_FOR`] and
//! only tried while the moving average of recent gaps is under it (and once in
//! [`PROBE_EVERY`] idle periods, to find out whether it has become so), so a host whose
//! callers pause between calls (every deployment's hosts, most of the time) spins at most one
//! window per [`PROBE_EVERY`] calls.

use std::io::{self, Read};
use std::time::{Duration, Instant};

use bytes::BytesMut;

/// Longest the host reads a connection's socket for the next call after answering, and the
/// recent gap (a moving average) above which it does not try. `TROUPE_HOST_POLL_US` overrides
/// it (0: never).
pub const HOST_POLL_FOR: Duration = Duration::from_micros(50);

/// Most microseconds a polling window's variable may ask for.
const MAX_POLL_US: u64 = 10_000;

/// The environment variable that sets [`host_poll_for`].
pub const HOST_POLL_ENV: &str = "TROUPE_HOST_POLL_US";

/// The window: [`HOST_POLL_FOR`], or `TROUPE_HOST_POLL_US` read once (a bad value is named in a
/// warning and the default kept).
pub fn host_poll_for() -> Duration {
    static WINDOW: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *WINDOW.get_or_init(|| {
        window_from_env(
            HOST_POLL_ENV,
            HOST_POLL_FOR,
            "a host's polling for the next call",
        )
    })
}

/// A polling window read from the environment variable `var` (microseconds, 0 to 10,000):
/// `default` when it is unset, and when it is bad, with a warning naming it. `what`: what 0
/// turns off. The one parser of the windows both ends of a framed call poll for
/// (`TROUPE_HOST_POLL_US` here, the controller's `TROUPE_CALL_POLL_US`).
pub fn window_from_env(var: &str, default: Duration, what: &str) -> Duration {
    poll_window(var, std::env::var(var).ok().as_deref(), default, what).unwrap_or_else(|why| {
        tracing::warn!("{why}; keeping {default:?}");
        default
    })
}

/// [`window_from_env`] given the variable's value.
fn poll_window(
    var: &str,
    value: Option<&str>,
    default: Duration,
    what: &str,
) -> Result<Duration, String> {
    let Some(v) = value else {
        return Ok(default);
    };
    match v.trim().parse::<u64>() {
        Ok(us) if us <= MAX_POLL_US => Ok(Duration::from_micros(us)),
        _ => Err(format!(
            "{var}={v:?} is not a number of microseconds from 0 to {MAX_POLL_US} (0 turns {what} \
             off)"
        )),
    }
}

/// The recent gaps between a connection's last reply and its next call: a moving average
/// (weight 1/8) that starts at [`FIRST_GAP`], so a connection polls only once calls have come
/// quickly (a few dozen of them).
///
/// A gap measured while the host was parked includes the host's own wake-up (tens of
/// microseconds on a virtual machine), so a caller whose calls come 5 µs apart can look slower
/// than the window for as long as the host parks, and the host would never poll again: `troupe
/// bench rpc` had runs settle at 80 µs a call beside runs at 9. So every
/// [`PROBE_EVERY`]th idle period is polled whatever the average says, and a call caught while
/// polling (whose gap is exact) brings the average within the window at once.
#[derive(Debug)]
pub struct IdleGaps {
    avg_ns: u64,
    /// When the connection last went idle (every reply written, no call in flight).
    since: Option<Instant>,
    /// Idle periods so far (for the probes).
    idles: u32,
}

/// One idle period in this many is polled even when recent gaps look too long (a probe: at
/// most one window of reading per this many calls of a slow caller).
pub const PROBE_EVERY: u32 = 8;

/// The gap a new connection is assumed to have: long, so that it does not poll at once.
pub const FIRST_GAP: Duration = Duration::from_secs(1);

impl Default for IdleGaps {
    fn default() -> Self {
        IdleGaps {
            avg_ns: FIRST_GAP.as_nanos() as u64,
            since: None,
            idles: 0,
        }
    }
}

impl IdleGaps {
    /// The connection has nothing in flight and nothing to write from now on.
    pub fn idle(&mut self) {
        self.idle_at(Instant::now());
    }

    /// A call arrived: the gap since [`IdleGaps::idle`] (if it was idle) joins the average.
    pub fn busy(&mut self) {
        self.busy_at(Instant::now());
    }

    fn idle_at(&mut self, now: Instant) {
        self.since.get_or_insert(now);
    }

    fn busy_at(&mut self, now: Instant) {
        if let Some(t) = self.since.take() {
            let gap = now.saturating_duration_since(t).as_nanos();
            let gap = u64::try_from(gap).unwrap_or(u64::MAX) / 8;
            self.avg_ns = self.avg_ns - self.avg_ns / 8 + gap;
        }
    }

    /// Whether reading the socket for up to `window` is likely to catch the next call.
    pub fn worth_polling(&self, window: Duration) -> bool {
        !window.is_zero() && self.avg_ns <= window.as_nanos() as u64
    }

    /// Whether to read the socket for up to `window` in the idle period that starts now:
    /// when [`IdleGaps::worth_polling`], and on every [`PROBE_EVERY`]th idle period anyway
    /// (never when `window` is zero).
    pub fn poll_now(&mut self, window: Duration) -> bool {
        if window.is_zero() {
            return false;
        }
        self.idles = self.idles.wrapping_add(1);
        self.worth_polling(window) || self.idles.is_multiple_of(PROBE_EVERY)
    }

    /// A call arrived while the socket was being read for up to `window`: its gap is exact
    /// (no wake-up in it) and shorter than the window, so the average comes within the window
    /// before the gap joins it.
    pub fn caught(&mut self, window: Duration) {
        self.caught_at(Instant::now(), window);
    }

    fn caught_at(&mut self, now: Instant, window: Duration) {
        self.avg_ns = self.avg_ns.min(window.as_nanos() as u64);
        self.busy_at(now);
    }
}

/// What reading the socket for a while found.
#[derive(Debug)]
pub enum Polled {
    /// Bytes arrived (appended to the inbox).
    Bytes,
    /// Nothing within the window: wait the ordinary way.
    Nothing,
    /// The peer closed its side.
    Closed,
    /// The socket failed.
    Failed(io::Error),
}

/// Reads `sock` (non-blocking, as the runtime made it) into `inbox` until bytes arrive or
/// `window` passes, reading the socket itself: the reactor learns of readiness only when a
/// worker next polls for I/O, which is the wait this avoids. Readiness the runtime still holds
/// for bytes read here is cleared by its next read, which then finds none.
///
/// Between reads the task yields to the runtime rather than spinning inside its poll: a spin
/// would hold the worker, and the call it catches would wake the actor's task while the
/// worker was still in the same chain of tasks handed over directly (tokio's LIFO slot, three
/// such hand-overs a turn); the fourth goes to the run queue with a parked worker woken to
/// steal it, and on a virtual machine that worker takes tens of microseconds to run it.
/// Yielding ends the chain at every read, lets the worker's other tasks run meanwhile, and
/// keeps the worker from parking. (Yielding the thread's CPU as well, at every read or after
/// 15 µs, was measured and lost: `troupe bench rpc` on a 2-vCPU VM, median 1.9× and 2.9× the
/// floor against 1.5×.)
pub async fn read_for(
    sock: &tokio::net::TcpStream,
    inbox: &mut BytesMut,
    window: Duration,
) -> Polled {
    let start = Instant::now();
    loop {
        if let Some(p) = read_now(sock, inbox) {
            return p;
        }
        if start.elapsed() >= window {
            return Polled::Nothing;
        }
        tokio::task::yield_now().await;
    }
}

/// One non-blocking read of `sock` into `inbox` (and whatever else has arrived); `None` when
/// nothing was there.
fn read_now(sock: &tokio::net::TcpStream, inbox: &mut BytesMut) -> Option<Polled> {
    let raw = socket2::SockRef::from(sock);
    let mut chunk = [0u8; 4096];
    let mut got = false;
    loop {
        match (&*raw).read(&mut chunk) {
            Ok(0) if got => return Some(Polled::Bytes),
            Ok(0) => return Some(Polled::Closed),
            Ok(n) => {
                inbox.extend_from_slice(&chunk[..n]);
                got = true;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return got.then_some(Polled::Bytes);
            }
            Err(_) if got => return Some(Polled::Bytes),
            Err(e) => return Some(Polled::Failed(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polling_starts_only_after_quick_gaps_and_stops_after_a_slow_one() {
        let w = HOST_POLL_FOR;
        let mut g = IdleGaps::default();
        assert!(!g.worth_polling(w), "nothing measured yet: do not spin");
        // Quick gaps: 5 µs from each reply to the next call.
        let mut t = Instant::now();
        let mut calls = 0;
        while !g.worth_polling(w) {
            g.idle_at(t);
            t += Duration::from_micros(5);
            g.busy_at(t);
            calls += 1;
            assert!(calls < 200, "quick calls never made it poll");
        }
        assert!(calls > 20, "a few quick calls are not enough ({calls})");
        assert!(!g.worth_polling(Duration::ZERO), "0 turns it off");
        // One slow gap is enough to stop.
        g.idle_at(t);
        t += Duration::from_millis(2);
        g.busy_at(t);
        assert!(!g.worth_polling(w));
        // A call that arrives while busy adds no gap.
        let before = g.avg_ns;
        g.busy();
        assert_eq!(g.avg_ns, before);
    }

    #[test]
    fn a_probe_catches_a_quick_caller_that_parked_gaps_made_look_slow() {
        let w = HOST_POLL_FOR;
        let mut g = IdleGaps::default();
        let mut t = Instant::now();
        // Parked gaps of 75 µs (5 µs of caller, 70 of the host's own wake-up): too slow.
        for _ in 0..100 {
            g.idle_at(t);
            t += Duration::from_micros(75);
            g.busy_at(t);
        }
        assert!(!g.worth_polling(w));
        // Within PROBE_EVERY idle periods one is polled anyway, and catches the call.
        let probes = (0..PROBE_EVERY).filter(|_| g.poll_now(w)).count();
        assert_eq!(probes, 1);
        g.idle_at(t);
        t += Duration::from_micros(5);
        g.caught_at(t, w);
        // From then on every idle period polls, while calls keep being caught.
        for _ in 0..50 {
            assert!(g.poll_now(w));
            g.idle_at(t);
            t += Duration::from_micros(5);
            g.caught_at(t, w);
        }
        assert!(g.avg_ns < 10_000, "{}", g.avg_ns);
        // A window of zero never polls, probes included.
        assert!((0..2 * PROBE_EVERY).all(|_| !g.poll_now(Duration::ZERO)));
    }

    #[test]
    fn the_window_comes_from_the_environment_or_a_clear_error() {
        let w = |v| poll_window(HOST_POLL_ENV, v, HOST_POLL_FOR, "polling");
        assert_eq!(w(None), Ok(HOST_POLL_FOR));
        assert_eq!(w(Some("0")), Ok(Duration::ZERO));
        assert_eq!(w(Some(" 80 ")), Ok(Duration::from_micros(80)));
        for bad in ["-1", "1e3", "fast", "", "10001"] {
            let e = w(Some(bad)).unwrap_err();
            assert!(
                e.contains(HOST_POLL_ENV) && e.contains("0 to 10000"),
                "{bad}: {e}"
            );
        }
    }

    #[tokio::test]
    async fn reading_for_a_window_finds_bytes_an_end_or_nothing() {
        use tokio::io::AsyncWriteExt;
        let within = Duration::from_secs(20);
        tokio::time::timeout(within, async {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            let (client, accepted) = tokio::join!(tokio::net::TcpStream::connect(addr), l.accept());
            let mut client = client.unwrap();
            let (server, _) = accepted.unwrap();
            let mut inbox = BytesMut::new();
            assert!(matches!(
                read_for(&server, &mut inbox, Duration::from_micros(200)).await,
                Polled::Nothing
            ));
            client.write_all(b"hello").await.unwrap();
            // Loopback delivers at once, but allow for a scheduler's delay.
            let mut got = false;
            for _ in 0..1000 {
                if matches!(
                    read_for(&server, &mut inbox, Duration::from_millis(1)).await,
                    Polled::Bytes
                ) {
                    got = true;
                    break;
                }
            }
            assert!(got);
            assert_eq!(&inbox[..], b"hello");
            drop(client);
            let mut closed = false;
            for _ in 0..1000 {
                if matches!(
                    read_for(&server, &mut inbox, Duration::from_millis(1)).await,
                    Polled::Closed
                ) {
                    closed = true;
                    break;
                }
            }
            assert!(closed);
        })
        .await
        .expect("test timed out");
    }

    /// The poll hands the worker back between reads: on a one-thread runtime the task that
    /// sends the call runs while the poll is waiting for it (a spin inside the poll would hold
    /// the only worker for the whole window and find nothing).
    #[tokio::test(flavor = "current_thread")]
    async fn the_worker_runs_other_tasks_while_the_poll_waits() {
        use tokio::io::AsyncWriteExt;
        tokio::time::timeout(Duration::from_secs(20), async {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            let (client, accepted) = tokio::join!(tokio::net::TcpStream::connect(addr), l.accept());
            let mut client = client.unwrap();
            let (server, _) = accepted.unwrap();
            let sender = tokio::spawn(async move {
                client.write_all(b"call").await.unwrap();
                client
            });
            let mut inbox = BytesMut::new();
            let polled = read_for(&server, &mut inbox, Duration::from_secs(5)).await;
            assert!(matches!(polled, Polled::Bytes), "{polled:?}");
            assert_eq!(&inbox[..], b"call");
            drop(sender.await.unwrap());
        })
        .await
        .expect("test timed out");
    }
}
