//! Rank 0 collecting one answer from every engine at once (ring offers, links up, bucket
//! confirmations), and deciding from the answers which rank is at fault.

use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::control::{Fault, FromEngine, read_from_engine};

/// One connected engine, as seen by rank 0.
#[derive(Debug)]
pub(crate) struct Peer {
    pub(crate) rank: u32,
    pub(crate) n_ranks: u32,
    pub(crate) data_addr: String,
    pub(crate) control: TcpStream,
    /// Its control connection comes from this machine's own address (so it may map the ring).
    pub(crate) local: bool,
    /// Digest of the delta bases it said it holds when it joined.
    pub(crate) digest: u64,
    /// It mapped the ring and reads buckets from it.
    pub(crate) on_ring: bool,
}

/// What one engine said about a bucket (or the chain wiring).
#[derive(Debug)]
pub(crate) enum Outcome {
    Ok,
    /// The bucket arrived but these tensors' deltas could not be applied (resend them whole).
    Need(Vec<u32>),
    /// Its answer to the ring offer: `None` mapped, `Some(why not)`.
    Mapped(Option<String>),
    Reported {
        fault: Fault,
        rank: u32,
        reason: String,
    },
    Lost(String),
    TimedOut,
    /// Rank 0 stopped waiting (the bucket had already failed on a data link).
    Cancelled,
}

pub(crate) type Collected = (usize, Peer, Outcome);

/// Reads one report from every engine concurrently, each bounded by `deadline`.
pub(crate) fn spawn_collect(peers: Vec<Peer>, deadline: Instant) -> JoinSet<Collected> {
    spawn_collect_until(peers, deadline, None)
}

/// As [`spawn_collect`], and an engine still silent when `cancel` turns true is
/// [`Outcome::Cancelled`] (its peer comes back all the same, so it can be told the verdict).
pub(crate) fn spawn_collect_until(
    peers: Vec<Peer>,
    deadline: Instant,
    cancel: Option<watch::Receiver<bool>>,
) -> JoinSet<Collected> {
    let mut tasks = JoinSet::new();
    for (i, mut p) in peers.into_iter().enumerate() {
        let mut cancel = cancel.clone();
        tasks.spawn(async move {
            let cancelled = async {
                if let Some(c) = cancel.as_mut()
                    && c.wait_for(|&v| v).await.is_ok()
                {
                    return;
                }
                std::future::pending::<()>().await
            };
            let read = tokio::time::timeout_at(deadline, read_from_engine(&mut p.control));
            let answer = tokio::select! {
                a = read => a,
                () = cancelled => return (i, p, Outcome::Cancelled),
            };
            let o = match answer {
                Err(_) => Outcome::TimedOut,
                Ok(Ok(FromEngine::Ready | FromEngine::Ack)) => Outcome::Ok,
                Ok(Ok(FromEngine::AckNeed(list))) => Outcome::Need(list),
                Ok(Ok(FromEngine::Mapped(m))) => Outcome::Mapped(m),
                Ok(Ok(FromEngine::Error {
                    fault,
                    rank,
                    reason,
                })) => Outcome::Reported {
                    fault,
                    rank,
                    reason,
                },
                Ok(Err(e)) => Outcome::Lost(e.to_string()),
            };
            (i, p, o)
        });
    }
    tasks
}

pub(crate) async fn join_collect(
    tasks: &mut JoinSet<Collected>,
    peers: &mut Vec<Peer>,
) -> Vec<(u32, Outcome)> {
    let mut got = Vec::new();
    while let Some(j) = tasks.join_next().await {
        // A collector only panics if the runtime is shutting down; that engine counts as lost.
        if let Ok(c) = j {
            got.push(c);
        }
    }
    restore(got, peers)
}

/// Puts the peers back in chain order and returns `(rank, outcome)` in the same order.
pub(crate) fn restore(mut got: Vec<Collected>, peers: &mut Vec<Peer>) -> Vec<(u32, Outcome)> {
    got.sort_by_key(|(i, _, _)| *i);
    let mut out = Vec::with_capacity(got.len());
    for (_, p, o) in got {
        out.push((p.rank, o));
        peers.push(p);
    }
    out
}

/// Which rank to blame, if anything failed: an engine whose control connection died first (in
/// chain order), then one that refused the bucket itself, then whatever a neighbour reported,
/// then a failed data link from rank 0, then the first engine that never answered.
pub(crate) fn culprit(
    outcomes: &[(u32, Outcome)],
    link_err: Option<(u32, String)>,
) -> Option<(u32, String)> {
    let lost = outcomes.iter().find_map(|(r, o)| match o {
        Outcome::Lost(e) => Some((*r, format!("rank {r} went away: {e}"))),
        Outcome::Mapped(_) => Some((
            *r,
            format!("rank {r} answered a ring offer nobody made; is it the same troupe version?"),
        )),
        _ => None,
    });
    let mine = outcomes.iter().find_map(|(r, o)| match o {
        Outcome::Reported {
            fault: Fault::Mine,
            reason,
            ..
        } => Some((*r, format!("rank {r} refused the bucket: {reason}"))),
        _ => None,
    });
    let neighbour = outcomes.iter().find_map(|(r, o)| match o {
        Outcome::Reported { rank, reason, .. } => {
            Some((*rank, format!("reported by rank {r}: {reason}")))
        }
        _ => None,
    });
    let silent = outcomes.iter().find_map(|(r, o)| match o {
        Outcome::TimedOut => Some((
            *r,
            format!(
                "rank {r} did not confirm in time; is /update_weights_from_distributed (or \
                 /init_weights_update_group) being called on that engine with the same names, \
                 dtypes and shapes?"
            ),
        )),
        _ => None,
    });
    lost.or(mine).or(neighbour).or(link_err).or(silent)
}
