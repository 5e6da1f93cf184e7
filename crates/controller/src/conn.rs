//! A connection to one actor host, over whichever transport reaches it.
//!
//! `Direct` calls the host core in this process; `Grpc` speaks the `ActorHost` service. Both
//! enqueue a call synchronously when it is made (so one caller's calls keep their order) and
//! both fail every pending call with [`CallError::HostLost`] the moment the host is lost.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use troupe_actors::auth::TokenAttach;
use troupe_actors::tls::ClientTls;
use troupe_actors::{CallError, HostCore};
use troupe_wire::error_chain;
use troupe_wire::v1::{self, actor_host_client::ActorHostClient};

use crate::conn_framed::FramedConn;
use crate::grpc_status::from_status;

type Reply = Result<Vec<u8>, CallError>;

/// A call's reply, whichever transport carries it.
pub(crate) type CallFuture = Pin<Box<dyn Future<Output = Reply> + Send>>;

/// Where a host is reached: the address it reports, unless that is empty or a wildcard
/// (`0.0.0.0`, `[::]`: a host listening on every interface), which is no address anyone can
/// dial; then the host part the controller dialed, with the reported port. Servers, proxies and
/// the gateway are placed at this address, so a wildcard here would advertise `0.0.0.0`.
fn reachable_address(reported: &str, dialed: &str) -> String {
    match reported.parse::<std::net::SocketAddr>() {
        Ok(sa) if sa.ip().is_unspecified() => {
            let host = dialed.rsplit_once(':').map_or(dialed, |(h, _)| h);
            format!("{host}:{}", sa.port())
        }
        _ if reported.is_empty() => dialed.to_string(),
        _ => reported.to_string(),
    }
}

struct Session {
    epoch: u64,
    tx: SessionTx,
}

impl Drop for Session {
    fn drop(&mut self) {
        if let SessionTx::Framed(w) = &self.tx {
            crate::conn_framed::close(w, "session closed");
        }
    }
}

/// Where a session's calls go.
enum SessionTx {
    /// gRPC `CallStream`'s request stream.
    Stream(mpsc::UnboundedSender<v1::CallRequest>),
    /// A framed-call connection ([`crate::conn_framed`]).
    Framed(Arc<FramedConn>),
}

impl SessionTx {
    fn is_closed(&self) -> bool {
        match self {
            SessionTx::Stream(tx) => tx.is_closed(),
            SessionTx::Framed(w) => w.is_closed(),
        }
    }

    /// Sends `req`; `alone` when no other call is in flight (see [`FramedConn::send`]).
    fn send(&self, req: v1::CallRequest, alone: bool) -> bool {
        match self {
            SessionTx::Stream(tx) => tx.send(req).is_ok(),
            SessionTx::Framed(w) => w.send(&req, alone),
        }
    }
}

/// How a controller sends actor calls to hosts reached over the network.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CallTransport {
    /// Framed calls on the host's port where the host takes them (plaintext hosts), else
    /// gRPC's `CallStream` (hosts serving TLS). About half the task wake-ups per call.
    #[default]
    Framed,
    /// Always gRPC's `CallStream` (for comparison, or where a proxy between controller and
    /// hosts understands only HTTP/2).
    Grpc,
}

type Client = ActorHostClient<InterceptedService<Channel, TokenAttach>>;

struct Grpc {
    client: Client,
    /// A framed-call connection made at connect time, waiting to carry the first session.
    framed: Mutex<Option<Arc<FramedConn>>>,
    session: Mutex<Option<Session>>,
    pending: Mutex<HashMap<u64, (u64, oneshot::Sender<Reply>)>>,
    epochs: AtomicU64,
}

enum Transport {
    Direct(HostCore),
    Grpc(Box<Grpc>),
}

/// One host, as the controller sees it.
pub(crate) struct HostConn {
    pub host_id: String,
    pub address: String,
    pub max_message_bytes: u64,
    transport: Transport,
    lost: Mutex<Option<String>>,
    next_call: AtomicU64,
}

impl HostConn {
    /// Whether the host runs in this process (a core called directly). Such a host cannot be
    /// lost apart from its controller: a missed heartbeat only means this process was busy.
    pub(crate) fn in_process(&self) -> bool {
        matches!(self.transport, Transport::Direct(_))
    }

    pub fn direct(core: HostCore) -> Arc<Self> {
        let d = core.describe();
        Arc::new(HostConn {
            host_id: d.host_id,
            address: d.address,
            max_message_bytes: d.max_message_bytes,
            transport: Transport::Direct(core),
            lost: Mutex::new(None),
            next_call: AtomicU64::new(1),
        })
    }

    /// Connects to `addr` (host:port) with an optional control-plane token (and over TLS,
    /// verifying the host against `tls`'s CA, when given) and reads the host's description.
    /// Calls go as `calls` says, where the host takes that.
    pub async fn grpc(
        addr: &str,
        connect_timeout: Duration,
        token: Option<&str>,
        tls: Option<&ClientTls>,
        calls: CallTransport,
    ) -> Result<(Arc<Self>, v1::HostDescription), CallError> {
        let attach = TokenAttach::new(token).map_err(CallError::BadRequest)?;
        let bad = |e: &dyn std::fmt::Display| {
            CallError::HostLost(format!("cannot connect to actor host at {addr}: {e}"))
        };
        let ep = troupe_actors::tls::endpoint(addr, tls)
            .map_err(|e| CallError::BadRequest(e.to_string()))?
            .tcp_nodelay(true)
            .connect_timeout(connect_timeout)
            .initial_stream_window_size(Some(8 << 20))
            .initial_connection_window_size(Some(16 << 20));
        let channel = tokio::time::timeout(connect_timeout, ep.connect())
            .await
            .map_err(|_| bad(&"timed out"))?
            .map_err(|e| bad(&error_chain(&e)))?;
        let mut client = ActorHostClient::with_interceptor(channel, attach)
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX);
        let d = client
            .describe(v1::DescribeRequest {})
            .await
            .map_err(|s| match s.code() {
                tonic::Code::Unauthenticated => from_status(&s),
                _ => bad(&s),
            })?
            .into_inner();
        let framed = if calls == CallTransport::Framed && d.framed_calls && tls.is_none() {
            match crate::conn_framed::connect(addr, token, connect_timeout).await {
                Ok(c) => Some(c),
                Err(e) => {
                    tracing::warn!("{e}; calls to host {} go over gRPC", d.host_id);
                    None
                }
            }
        } else {
            None
        };
        let conn = Arc::new(HostConn {
            host_id: d.host_id.clone(),
            address: reachable_address(&d.address, addr),
            max_message_bytes: d.max_message_bytes,
            transport: Transport::Grpc(Box::new(Grpc {
                client,
                framed: Mutex::new(framed),
                session: Mutex::new(None),
                pending: Mutex::new(HashMap::new()),
                epochs: AtomicU64::new(0),
            })),
            lost: Mutex::new(None),
            next_call: AtomicU64::new(1),
        });
        Ok((conn, d))
    }

    /// Why the host is lost, if it is.
    pub fn lost_reason(&self) -> Option<String> {
        self.lost.lock().clone()
    }

    /// Marks the host lost and fails every pending call with `HostLost`.
    pub fn mark_lost(&self, reason: &str) -> bool {
        {
            let mut l = self.lost.lock();
            if l.is_some() {
                return false;
            }
            *l = Some(reason.to_string());
        }
        if let Transport::Grpc(g) = &self.transport {
            g.session.lock().take();
            g.framed.lock().take();
            let drained: Vec<_> = g.pending.lock().drain().collect();
            for (_, (_, tx)) in drained {
                let _ = tx.send(Err(CallError::HostLost(reason.to_string())));
            }
        }
        true
    }

    fn host_lost(&self) -> Option<CallError> {
        self.lost
            .lock()
            .as_ref()
            .map(|r| CallError::HostLost(format!("host {}: {r}", self.host_id)))
    }

    /// Enqueues a call now and returns a future of its reply.
    pub fn call(
        self: &Arc<Self>,
        actor_id: &str,
        method: &str,
        payload: Vec<u8>,
        deadline: Option<Duration>,
    ) -> CallFuture {
        if let Some(e) = self.host_lost() {
            return Box::pin(async move { Err(e) });
        }
        if payload.len() as u64 > self.max_message_bytes {
            let e = CallError::MessageTooLarge {
                size: payload.len() as u64,
                limit: self.max_message_bytes,
            };
            return Box::pin(async move { Err(e) });
        }
        match &self.transport {
            Transport::Direct(core) => match core.dispatch(actor_id, method.to_string(), payload) {
                Ok(rx) => {
                    let core = core.clone();
                    Box::pin(async move { core.await_reply(rx, deadline).await })
                }
                Err(e) => Box::pin(async move { Err(e) }),
            },
            Transport::Grpc(g) => self.grpc_call(g, actor_id, method, payload, deadline),
        }
    }

    fn grpc_call(
        self: &Arc<Self>,
        g: &Grpc,
        actor_id: &str,
        method: &str,
        payload: Vec<u8>,
        deadline: Option<Duration>,
    ) -> CallFuture {
        let call_id = self.next_call.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let lone;
        let req = v1::CallRequest {
            actor_id: actor_id.to_string(),
            method: method.to_string(),
            payload,
            call_id,
            deadline_ms: deadline.map(|d| d.as_millis().max(1) as u64).unwrap_or(0),
        };
        {
            let mut session = g.session.lock();
            let s = match session.as_ref() {
                Some(s) if !s.tx.is_closed() => s,
                _ => session.insert(self.open_session(g)),
            };
            let alone = {
                let mut p = g.pending.lock();
                let alone = p.is_empty();
                p.insert(call_id, (s.epoch, tx));
                alone
            };
            if !s.tx.send(req, alone) {
                g.pending.lock().remove(&call_id);
                return Box::pin(async { Err(CallError::Transport("call stream closed".into())) });
            }
            // A lone framed call times its round trip, and reads its reply itself while recent
            // round trips were short (see `conn_framed`).
            lone = match &s.tx {
                SessionTx::Framed(c) if alone => Some((c.clone(), std::time::Instant::now())),
                _ => None,
            };
        }
        let me = self.clone();
        Box::pin(async move {
            let died = || CallError::HostLost("call stream ended before the reply".into());
            let mut rx = rx;
            let window = crate::conn_framed::poll_for();
            if let Some((c, sent)) = &lone
                && c.round_trips.worth_polling(window)
                && let Some(r) = me.poll_for_reply(c, &mut rx, *sent + window).await
            {
                c.round_trips.record(sent.elapsed());
                return r.map_err(|_| died())?;
            }
            let r = match deadline {
                None => rx.await.map_err(|_| died())?,
                // The host enforces the deadline; ours is a backstop against a silent host.
                Some(d) => match tokio::time::timeout(d + Duration::from_millis(250), rx).await {
                    Ok(r) => r.map_err(|_| died())?,
                    Err(_) => {
                        if let Transport::Grpc(g) = &me.transport {
                            g.pending.lock().remove(&call_id);
                        }
                        Err(CallError::DeadlineExceeded(d))
                    }
                },
            };
            if let Some((c, sent)) = &lone {
                c.round_trips.record(sent.elapsed());
            }
            r
        })
    }

    /// Reads `c` for replies until `rx`'s has come (then it, or `Err` if its session ended) or
    /// `until` passes (`None`), yielding to the runtime between reads; every reply read goes to
    /// its own caller on the way.
    async fn poll_for_reply(
        &self,
        c: &FramedConn,
        rx: &mut oneshot::Receiver<Reply>,
        until: std::time::Instant,
    ) -> Option<Result<Reply, ()>> {
        let mut deliver = |r: v1::CallReply| {
            self.deliver(r);
            true
        };
        loop {
            c.poll_replies(&mut deliver);
            match rx.try_recv() {
                Ok(r) => return Some(Ok(r)),
                Err(oneshot::error::TryRecvError::Closed) => return Some(Err(())),
                Err(oneshot::error::TryRecvError::Empty) => {}
            }
            if std::time::Instant::now() >= until {
                return None;
            }
            // Yield to the runtime between reads (as the host's side does, `idle_poll`), so
            // the worker's other tasks run meanwhile.
            tokio::task::yield_now().await;
        }
    }

    /// Opens the session the next calls go on: the framed connection made at connect time if
    /// one is waiting, else a gRPC call stream.
    fn open_session(self: &Arc<Self>, g: &Grpc) -> Session {
        let epoch = g.epochs.fetch_add(1, Ordering::Relaxed) + 1;
        let me = Arc::downgrade(self);
        if let Some(w) = g.framed.lock().take() {
            let conn = w.clone();
            tokio::spawn(async move {
                let deliver = |r: v1::CallReply| match me.upgrade() {
                    Some(me) => {
                        me.deliver(r);
                        true
                    }
                    None => false,
                };
                let why = crate::conn_framed::drive(&conn, deliver).await;
                crate::conn_framed::close(&conn, &why);
                if let Some(me) = me.upgrade() {
                    me.end_session(epoch, why);
                }
            });
            return Session {
                epoch,
                tx: SessionTx::Framed(w),
            };
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let mut client = g.client.clone();
        tokio::spawn(async move {
            let why = match client.call_stream(UnboundedReceiverStream::new(rx)).await {
                Err(s) => format!("cannot open call stream: {s}"),
                Ok(resp) => {
                    let mut replies = resp.into_inner();
                    loop {
                        match replies.message().await {
                            Ok(Some(r)) => match me.upgrade() {
                                Some(me) => me.deliver(r),
                                None => return,
                            },
                            Ok(None) => break "call stream closed by the host".to_string(),
                            Err(s) => break format!("call stream failed: {s}"),
                        }
                    }
                }
            };
            if let Some(me) = me.upgrade() {
                me.end_session(epoch, why);
            }
        });
        Session {
            epoch,
            tx: SessionTx::Stream(tx),
        }
    }

    /// Hands a reply to the call waiting for it.
    fn deliver(&self, r: v1::CallReply) {
        let Transport::Grpc(g) = &self.transport else {
            return;
        };
        let waiter = g.pending.lock().remove(&r.call_id);
        if let Some((_, tx)) = waiter {
            let _ = tx.send(troupe_actors::framed::reply_result(r));
        }
    }

    /// Ends session `epoch`: everything sent on it is lost with it.
    fn end_session(&self, epoch: u64, why: String) {
        let Transport::Grpc(g) = &self.transport else {
            return;
        };
        {
            let mut s = g.session.lock();
            if s.as_ref().is_some_and(|s| s.epoch == epoch) {
                s.take();
            }
        }
        let failed: Vec<_> = {
            let mut p = g.pending.lock();
            let ids: Vec<u64> = p
                .iter()
                .filter(|(_, (e, _))| *e == epoch)
                .map(|(id, _)| *id)
                .collect();
            ids.into_iter().filter_map(|id| p.remove(&id)).collect()
        };
        let reason = self.lost_reason().unwrap_or(why);
        for (_, tx) in failed {
            let _ = tx.send(Err(CallError::HostLost(format!(
                "host {}: {reason}",
                self.host_id
            ))));
        }
    }

    /// Reads the host's current description.
    pub async fn describe(&self) -> Result<v1::HostDescription, CallError> {
        if let Some(e) = self.host_lost() {
            return Err(e);
        }
        match &self.transport {
            Transport::Direct(core) => Ok(core.describe()),
            Transport::Grpc(g) => g
                .client
                .clone()
                .describe(v1::DescribeRequest {})
                .await
                .map(|r| r.into_inner())
                .map_err(|s| from_status(&s)),
        }
    }

    /// Spawns an actor; returns its id.
    pub async fn spawn(&self, req: v1::SpawnRequest) -> Result<String, CallError> {
        if let Some(e) = self.host_lost() {
            return Err(e);
        }
        if req.args.len() as u64 > self.max_message_bytes {
            return Err(CallError::MessageTooLarge {
                size: req.args.len() as u64,
                limit: self.max_message_bytes,
            });
        }
        match &self.transport {
            Transport::Direct(core) => {
                let p = req.restart.unwrap_or_default();
                let policy = troupe_actors::RestartPolicy {
                    max_restarts: p.max_restarts,
                    backoff: Duration::from_millis(p.backoff_ms),
                };
                core.spawn(&req.kind, &req.name, req.args, policy).await
            }
            Transport::Grpc(g) => g
                .client
                .clone()
                .spawn(req)
                .await
                .map(|r| r.into_inner().actor_id)
                .map_err(|s| from_status(&s)),
        }
    }

    /// Stops an actor; returns whether it stopped within the grace period.
    pub async fn stop(&self, actor_id: &str, grace: Duration) -> Result<bool, CallError> {
        if let Some(e) = self.host_lost() {
            return Err(e);
        }
        match &self.transport {
            Transport::Direct(core) => core.stop(actor_id, grace).await,
            Transport::Grpc(g) => g
                .client
                .clone()
                .stop(v1::StopRequest {
                    actor_id: actor_id.to_string(),
                    grace_ms: grace.as_millis() as u64,
                })
                .await
                .map(|r| r.into_inner().graceful)
                .map_err(|s| from_status(&s)),
        }
    }

    /// Opens the host's event stream.
    pub async fn watch(&self) -> Result<crate::event_stream::EventStream, CallError> {
        use futures::StreamExt;
        match &self.transport {
            Transport::Direct(core) => {
                let stop = core.stopped();
                let first = futures::stream::iter([Ok(core.heartbeat_now())]);
                let rest = tokio_stream::wrappers::BroadcastStream::new(core.watch())
                    .filter_map(|e| async move { e.ok().map(Ok) });
                Ok(Box::pin(
                    first
                        .chain(rest)
                        .take_until(async move { stop.cancelled().await }),
                ))
            }
            Transport::Grpc(g) => {
                let s = g
                    .client
                    .clone()
                    .watch(v1::WatchRequest {})
                    .await
                    .map_err(|s| from_status(&s))?
                    .into_inner();
                Ok(Box::pin(s.map(|r| r.map_err(|s| s.to_string()))))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::reachable_address;

    #[test]
    fn a_wildcard_host_address_becomes_the_dialed_host() {
        assert_eq!(
            reachable_address("0.0.0.0:7000", "10.0.0.5:7000"),
            "10.0.0.5:7000"
        );
        assert_eq!(
            reachable_address("[::]:7000", "[fd00::5]:7000"),
            "[fd00::5]:7000"
        );
        assert_eq!(reachable_address("", "h:1"), "h:1");
        assert_eq!(
            reachable_address("10.0.0.6:7000", "gw:7000"),
            "10.0.0.6:7000"
        );
    }
}
