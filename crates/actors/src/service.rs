//! The `ActorHost` gRPC service: a thin translation between protobuf and [`HostCore`].
//!
//! Spawn and Stop report typed errors as a gRPC status carrying the Troupe error code in the
//! `troupe-error-code` metadata key; Call carries them inside the reply, so one failing call on a
//! stream never tears down the stream.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::StreamExt;
use tokio::net::TcpListener;
use tokio_stream::Stream;
use tokio_stream::wrappers::{BroadcastStream, UnboundedReceiverStream};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};
use troupe_wire::v1;
use troupe_wire::v1::actor_host_server::{ActorHost, ActorHostServer};

use crate::auth::TokenCheck;
use crate::call_stream::{CallReplies, deadline, reply};
use crate::error::CallError;
use crate::framed::Protocol;
use crate::host::{HostCore, RestartPolicy};
use crate::orphan::Watchers;

/// Metadata key that carries a [`CallError`]'s wire code on a failed Spawn or Stop.
pub const ERROR_CODE_KEY: &str = "troupe-error-code";

/// Encodes a typed error as a gRPC status.
pub fn status_of(e: &CallError) -> Status {
    let code = match e {
        CallError::UnknownActor(_) | CallError::UnknownKind(_) => tonic::Code::NotFound,
        CallError::BadPayload(_) | CallError::BadRequest(_) | CallError::UnknownMethod(_) => {
            tonic::Code::InvalidArgument
        }
        CallError::MessageTooLarge { .. } => tonic::Code::ResourceExhausted,
        CallError::DeadlineExceeded(_) => tonic::Code::DeadlineExceeded,
        CallError::HostShuttingDown | CallError::HostLost(_) | CallError::Transport(_) => {
            tonic::Code::Unavailable
        }
        CallError::ActorFailed(_) | CallError::Handler(_) => tonic::Code::Aborted,
        CallError::Unauthenticated(_) => tonic::Code::Unauthenticated,
    };
    let mut s = Status::new(code, e.to_wire().message);
    if let Ok(v) = (e.code() as i32).to_string().parse() {
        s.metadata_mut().insert(ERROR_CODE_KEY, v);
    }
    s
}

/// The gRPC face of one host.
#[derive(Clone)]
pub struct HostService {
    core: HostCore,
    watchers: Arc<Watchers>,
}

impl HostService {
    /// Wraps a host core; with an orphan grace in its config, the host stops once no controller
    /// has watched it that long ([`crate::orphan`]).
    pub fn new(core: HostCore) -> Self {
        let watchers = Arc::new(Watchers::default());
        if let Some(grace) = core.config().orphan_grace {
            let recovery = core.config().recovery_file.clone();
            crate::orphan::stop_when_orphaned(core.clone(), watchers.clone(), grace, recovery);
        }
        HostService { core, watchers }
    }

    /// The tonic server for this service, with the host's message-size limits and token
    /// check applied.
    pub fn into_server(self) -> InterceptedService<ActorHostServer<HostService>, TokenCheck> {
        // Leave headroom for the envelope around the payload.
        let limit = (self.core.config().max_message_bytes as usize).saturating_add(64 << 10);
        let check = TokenCheck::new(self.core.config().auth_token.as_deref());
        let server = ActorHostServer::new(self)
            .max_decoding_message_size(limit)
            .max_encoding_message_size(limit);
        InterceptedService::new(server, check)
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl ActorHost for HostService {
    async fn describe(
        &self,
        _req: Request<v1::DescribeRequest>,
    ) -> Result<Response<v1::HostDescription>, Status> {
        Ok(Response::new(self.core.describe()))
    }

    async fn spawn(
        &self,
        req: Request<v1::SpawnRequest>,
    ) -> Result<Response<v1::SpawnReply>, Status> {
        let r = req.into_inner();
        let policy = r
            .restart
            .map(|p| RestartPolicy {
                max_restarts: p.max_restarts,
                backoff: Duration::from_millis(p.backoff_ms),
            })
            .unwrap_or_default();
        match self.core.spawn(&r.kind, &r.name, r.args, policy).await {
            Ok(actor_id) => Ok(Response::new(v1::SpawnReply { actor_id })),
            Err(e) => Err(status_of(&e)),
        }
    }

    async fn call(&self, req: Request<v1::CallRequest>) -> Result<Response<v1::CallReply>, Status> {
        let r = req.into_inner();
        let out = self
            .core
            .call(&r.actor_id, r.method, r.payload, deadline(r.deadline_ms))
            .await;
        Ok(Response::new(reply(r.call_id, out)))
    }

    type CallStreamStream = BoxStream<v1::CallReply>;

    async fn call_stream(
        &self,
        req: Request<Streaming<v1::CallRequest>>,
    ) -> Result<Response<Self::CallStreamStream>, Status> {
        let replies = CallReplies::new(self.core.clone(), req.into_inner());
        Ok(Response::new(Box::pin(replies)))
    }

    async fn stop(&self, req: Request<v1::StopRequest>) -> Result<Response<v1::StopReply>, Status> {
        let r = req.into_inner();
        match self
            .core
            .stop(&r.actor_id, Duration::from_millis(r.grace_ms))
            .await
        {
            Ok(graceful) => Ok(Response::new(v1::StopReply { graceful })),
            Err(e) => Err(status_of(&e)),
        }
    }

    type WatchStream = BoxStream<v1::HostEvent>;

    async fn watch(
        &self,
        _req: Request<v1::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let first = futures::stream::iter([Ok(self.core.heartbeat_now())]);
        let rest =
            BroadcastStream::new(self.core.watch()).filter_map(|e| async move { e.ok().map(Ok) });
        let stop = self.core.stopped();
        // The stream holds the guard: when the controller goes away the stream is dropped.
        let guard = self.watchers.watch();
        let s = first
            .chain(rest)
            .take_until(async move { stop.cancelled().await })
            .map(move |e| {
                let _watched = &guard;
                e
            });
        Ok(Response::new(Box::pin(s)))
    }
}

/// How often the host pings each gRPC connection.
const GRPC_PING_INTERVAL: Duration = Duration::from_secs(30);
/// How long a ping may go unanswered before its connection is closed.
const GRPC_PING_TIMEOUT: Duration = Duration::from_secs(20);

/// Serves `core` on `listener` until `shutdown` resolves or the host shuts down.
///
/// TCP_NODELAY is set on every accepted socket: without it each small call stalls on Nagle.
/// Without TLS the same port also takes framed calls ([`crate::framed`]): each connection's
/// first bytes say which protocol it speaks.
pub async fn serve(
    core: HostCore,
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    if let Ok(a) = listener.local_addr()
        && core.describe().address.is_empty()
    {
        core.set_address(a.to_string());
    }
    let stop = core.stopped();
    // A gRPC connection whose peer stops answering HTTP/2 pings (a raw socket that sent the
    // preface and nothing else) is closed; every real HTTP/2 client answers them.
    let mut builder = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .http2_adaptive_window(Some(true))
        .http2_keepalive_interval(Some(GRPC_PING_INTERVAL))
        .http2_keepalive_timeout(Some(GRPC_PING_TIMEOUT));
    let until = async move {
        tokio::select! {
            _ = shutdown => {}
            _ = stop.cancelled() => {}
        }
    };
    if let Some(tls) = &core.config().tls {
        let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
        return builder
            .tls_config(tls.config())?
            .add_service(HostService::new(core).into_server())
            .serve_with_incoming_shutdown(incoming, until)
            .await;
    }
    let (grpc_tx, grpc_rx) = tokio::sync::mpsc::unbounded_channel();
    let accept = tokio::spawn(accept_loop(core.clone(), listener, grpc_tx));
    let out = builder
        .add_service(HostService::new(core).into_server())
        .serve_with_incoming_shutdown(UnboundedReceiverStream::new(grpc_rx), until)
        .await;
    accept.abort();
    out
}

/// Accepts connections and sends each to gRPC or to a framed-call task by its first bytes.
///
/// A connection must identify itself within the host's `handshake_timeout` (the whole framed
/// hello, token included, or HTTP/2's whole preface) or it is closed; at most
/// `max_pending_connections` may be at that stage at once, and more are closed on arrival,
/// so silent or half-open connections cannot hold the host's descriptors.
async fn accept_loop(
    core: HostCore,
    listener: TcpListener,
    grpc: tokio::sync::mpsc::UnboundedSender<std::io::Result<tokio::net::TcpStream>>,
) {
    let cfg = core.config();
    let wait = cfg.handshake_timeout;
    let pending = Arc::new(tokio::sync::Semaphore::new(
        cfg.max_pending_connections.max(1),
    ));
    let mut refused = 0u64;
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of descriptors and the like: back off instead of spinning.
                tracing::warn!("accepting a connection: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = pending.clone().try_acquire_owned() else {
            refused += 1;
            if refused.is_power_of_two() {
                tracing::warn!(
                    refused,
                    "closing new connections: {} are still to identify themselves (max_pending_connections)",
                    cfg.max_pending_connections
                );
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (core, grpc) = (core.clone(), grpc.clone());
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + wait;
            match crate::framed::classify(&stream, deadline).await {
                Some(Protocol::Framed) => {
                    crate::framed::serve_connection(core, stream, deadline, permit).await
                }
                Some(Protocol::Grpc) => {
                    drop(permit);
                    let _ = grpc.send(Ok(stream));
                }
                None => {}
            }
        });
    }
}
