//! The controller's gRPC API for external trainers: the engine side of weight sync.
//!
//! An external trainer (rank 0, e.g. a Python FSDP process with NCCL) broadcasts the tensors;
//! this service tells every engine what to expect, concurrently, and never resumes serving on
//! mixed weight versions. Every call is an operation of the deployment's [`ControlPlane`], the
//! one the gateway's control endpoints use, so the two never interleave (one operation at a
//! time), the plane knows a gRPC pause as its own, and a gRPC update is the fleet's last update
//! like any other.
//!
//! It controls every engine, so it is guarded like the hosts: with a token every request must
//! carry `authorization: Bearer <token>` (refused before it reaches a handler, so a refused call
//! changes nothing), it refuses to listen on a non-loopback address without one, and it can
//! serve over TLS. [`connect`] is the matching client.

use std::net::SocketAddr;
use std::sync::Arc;

use serde_json::Value;
use tokio::net::TcpListener;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};
use troupe_actors::auth::{TokenAttach, TokenCheck};
use troupe_actors::tls::{ClientTls, ServerTls};
use troupe_serving::control_plane::ControlPlane;
use troupe_serving::control_plane::updates::FleetGroupRequest;
use troupe_wire::sglang::UpdateWeightsFromDistributed;
use troupe_wire::v1::controller_client::ControllerClient;
use troupe_wire::v1::controller_server::{Controller, ControllerServer};
use troupe_wire::v1::{
    BeginWeightUpdateRequest, EndWeightUpdateRequest, EngineRank, GetWeightPlanRequest,
    InitWeightGroupRequest, ServerStatus, WeightAck, WeightBucketRequest, WeightPlan,
};
use troupe_wire::{ApiError, PauseMode, WeightVersion};

/// The trainer is rank 0; the fleet's ranks start here.
const FIRST_ENGINE_RANK: u32 = 1;

/// The `troupe.v1.Controller` service over a deployment's control plane.
#[derive(Clone)]
pub struct ControllerApi {
    plane: Arc<ControlPlane>,
    token: Option<String>,
    tls: Option<ServerTls>,
}

/// A client of the API that sends the token (a trainer's side of [`ControllerApi`]).
pub type ApiClient = ControllerClient<InterceptedService<Channel, TokenAttach>>;

/// Connects to the API at `addr` (`host:port`), sending `token` with every request and, with
/// `tls`, verifying the server against its CA.
pub async fn connect(
    addr: &str,
    token: Option<&str>,
    tls: Option<&ClientTls>,
    timeout: std::time::Duration,
) -> Result<ApiClient, String> {
    let attach = TokenAttach::new(token)?;
    let ep = troupe_actors::tls::endpoint(addr, tls)
        .map_err(|e| e.to_string())?
        .connect_timeout(timeout);
    let channel = tokio::time::timeout(timeout, ep.connect())
        .await
        .map_err(|_| format!("cannot connect to the controller api at {addr}: timed out"))?
        .map_err(|e| {
            format!(
                "cannot connect to the controller api at {addr}: {}",
                troupe_wire::error_chain(&e)
            )
        })?;
    Ok(ControllerClient::with_interceptor(channel, attach))
}

/// Each engine's line of a plane answer's `engines` list: `{url, success, error?}` after a
/// failure; after a success every listed engine succeeded (`ok`), whatever else its entry
/// says (`init_group` lists `{url, rank_offset, gpus}`).
fn servers(engines: Option<&Value>, succeeded: bool) -> Vec<ServerStatus> {
    engines
        .and_then(Value::as_array)
        .map(|list| {
            list.iter()
                .map(|e| ServerStatus {
                    url: e["url"].as_str().unwrap_or_default().to_string(),
                    ok: succeeded || e["success"].as_bool().unwrap_or(false),
                    error: e["error"].as_str().unwrap_or_default().to_string(),
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The gRPC answer to a plane operation: its per-engine breakdown as a [`WeightAck`] (`ok:
/// false` with the message when some engine failed: the plane has undone what it undoes), or
/// the status that matches the plane's refusal (bad input, mixed versions, no engine).
fn ack(r: Result<Value, ApiError>) -> Result<Response<WeightAck>, Status> {
    match r {
        Ok(v) => Ok(Response::new(WeightAck {
            ok: true,
            servers: servers(v.get("engines"), true),
            message: v["message"].as_str().unwrap_or_default().to_string(),
            skipped: v["skipped"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|u| u.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default(),
        })),
        Err(e) if e.status.as_u16() == 502 && e.engines.is_some() => Ok(Response::new(WeightAck {
            ok: false,
            servers: servers(e.engines.as_ref(), false),
            message: e.message,
            skipped: e.skipped,
        })),
        Err(e) => Err(status_of(&e)),
    }
}

/// The gRPC status for a plane refusal with HTTP status `e.status`.
fn status_of(e: &ApiError) -> Status {
    let code = match e.status.as_u16() {
        400 | 413 | 422 => Code::InvalidArgument,
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        404 => Code::NotFound,
        409 => Code::FailedPrecondition,
        503 | 502 => Code::Unavailable,
        504 => Code::DeadlineExceeded,
        _ => Code::Internal,
    };
    Status::new(code, e.message.clone())
}

impl ControllerApi {
    /// An API over `plane`'s engines: each call is one of its operations, serialized with the
    /// gateway's control endpoints and recorded in the same fleet state.
    pub fn new(plane: Arc<ControlPlane>) -> Self {
        ControllerApi {
            plane,
            token: None,
            tls: None,
        }
    }

    /// Requires `token` on every request (None: no check, and loopback addresses only).
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token.filter(|t| !t.is_empty());
        self
    }

    /// Serves over TLS with this identity.
    pub fn with_tls(mut self, tls: Option<ServerTls>) -> Self {
        self.tls = tls;
        self
    }

    /// Serves the API on `listener` until `shutdown` resolves (TCP_NODELAY on every socket).
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> Result<(), tonic::transport::Error> {
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        let mut builder = tonic::transport::Server::builder();
        if let Some(tls) = &self.tls {
            builder = builder.tls_config(tls.config())?;
        }
        let check = TokenCheck::new(self.token.as_deref());
        builder
            .add_service(InterceptedService::new(ControllerServer::new(self), check))
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await
    }

    /// Binds `addr` and serves in the background until the returned [`ApiServer`] is dropped.
    /// Refuses a non-loopback address without a token: anyone who reached it could pause
    /// every engine or load weights into them.
    pub async fn spawn(self, addr: SocketAddr) -> Result<ApiServer, String> {
        check_listen(addr, self.token.as_deref())?;
        let l = TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let bound = l.local_addr().map_err(|e| e.to_string())?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = self.serve(l, async move {
            let _ = stopped.await;
        });
        tokio::spawn(async move {
            if let Err(e) = served.await {
                tracing::error!("controller api on {bound} stopped: {e}");
            }
        });
        Ok(ApiServer {
            addr: bound,
            _stop: stop,
        })
    }
}

/// A controller API serving in the background: it stops (and frees its port) when this is
/// dropped, so it never outlives its owner (`troupe serve`, a Python `Service`, a test) or
/// keeps the deployment's plane alive after it.
#[derive(Debug)]
pub struct ApiServer {
    addr: SocketAddr,
    /// Dropping it ends the server's shutdown future.
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl ApiServer {
    /// The address it listens on (the bound port when `:0` was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Refuses to serve the API on a non-loopback address without a token.
pub fn check_listen(addr: SocketAddr, token: Option<&str>) -> Result<(), String> {
    if token.is_none_or(str::is_empty) && !addr.ip().is_loopback() {
        return Err(format!(
            "refusing to serve the controller api on {addr} without a control-plane token: anyone who reaches it could pause the engines or load weights into them; set `token:` in the config (or TROUPE_TOKEN), or listen on 127.0.0.1"
        ));
    }
    Ok(())
}

#[tonic::async_trait]
impl Controller for ControllerApi {
    async fn get_weight_plan(
        &self,
        _r: Request<GetWeightPlanRequest>,
    ) -> Result<Response<WeightPlan>, Status> {
        let (members, world_size) = self
            .plane
            .group_ranks(FIRST_ENGINE_RANK)
            .await
            .map_err(|e| status_of(&e))?;
        let engines = members
            .into_iter()
            .map(|(e, rank_offset)| EngineRank {
                url: e.url,
                rank_offset,
                gpus: e.gpus,
            })
            .collect();
        Ok(Response::new(WeightPlan {
            world_size,
            engines,
        }))
    }

    async fn init_weight_group(
        &self,
        r: Request<InitWeightGroupRequest>,
    ) -> Result<Response<WeightAck>, Status> {
        let r = r.into_inner();
        let port = u16::try_from(r.master_port).ok().filter(|p| *p != 0);
        let (false, Some(master_port)) = (r.master_address.is_empty(), port) else {
            return Err(Status::invalid_argument(
                "master_address and master_port (1-65535) are required, e.g. 10.0.0.1:29500",
            ));
        };
        if r.group_name.is_empty() {
            return Err(Status::invalid_argument("group_name is required"));
        }
        let backend = if r.backend.is_empty() {
            "nccl".to_string()
        } else {
            r.backend
        };
        ack(self
            .plane
            .init_group(FleetGroupRequest {
                master_address: r.master_address,
                master_port,
                group_name: r.group_name,
                backend,
                world_size: None,
                rank_offset: Some(FIRST_ENGINE_RANK),
                group_secret: (!r.group_secret.is_empty()).then_some(r.group_secret),
            })
            .await)
    }

    async fn begin_weight_update(
        &self,
        r: Request<BeginWeightUpdateRequest>,
    ) -> Result<Response<WeightAck>, Status> {
        let mode = match r.into_inner().pause_mode.as_str() {
            "" => PauseMode::Abort,
            other => PauseMode::parse(other).ok_or_else(|| {
                Status::invalid_argument(format!(
                    "pause_mode {other:?} is not one of {}",
                    PauseMode::names()
                ))
            })?,
        };
        ack(self.plane.begin_update(mode).await)
    }

    async fn weight_bucket(
        &self,
        r: Request<WeightBucketRequest>,
    ) -> Result<Response<WeightAck>, Status> {
        let r = r.into_inner();
        // Empty: no version (the fleet's stays). Otherwise checked here as every version is, so
        // a bad one is refused by name before any engine is called.
        let weight_version = match r.weight_version.as_str() {
            "" => None,
            v => Some(
                WeightVersion::new(v)
                    .map_err(|e| Status::invalid_argument(format!("weight_version: {e}")))?,
            ),
        };
        let req = UpdateWeightsFromDistributed {
            names: r.names,
            dtypes: r.dtypes,
            shapes: r
                .shapes
                .iter()
                .map(|s| {
                    s.dims
                        .iter()
                        .map(|&d| usize::try_from(d).unwrap_or(usize::MAX))
                        .collect()
                })
                .collect(),
            group_name: r.group_name,
            flush_cache: r.flush_cache,
            weight_version: weight_version.map(|v| v.as_str().to_string()),
            packed: false,
            stage: false,
        };
        // With a version, the plane records it once every member took the bucket: the fleet
        // then expects it, so `EndWeightUpdate` checks and resumes in one call per engine.
        ack(self.plane.update_distributed(req).await)
    }

    async fn end_weight_update(
        &self,
        r: Request<EndWeightUpdateRequest>,
    ) -> Result<Response<WeightAck>, Status> {
        let buckets = r.into_inner().buckets;
        ack(self.plane.end_update(buckets).await)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use troupe_serving::control_plane::{InferenceControl, WeightSync};

    use super::*;

    /// Dropping the handle stops the server: its port refuses connections (no API outlives
    /// its owner, e.g. a test beside a running job), and an empty fleet is refused as such.
    #[tokio::test]
    async fn an_api_server_stops_when_its_handle_is_dropped() {
        tokio::time::timeout(Duration::from_secs(30), async {
            let plane = ControlPlane::new(
                InferenceControl::with_engines(Vec::new(), None),
                WeightSync::new(Default::default()),
            );
            let server = ControllerApi::new(plane)
                .spawn("127.0.0.1:0".parse().expect("address"))
                .await
                .expect("serves");
            let addr = server.addr();
            let mut c = ControllerClient::connect(format!("http://{addr}"))
                .await
                .expect("connects");
            let e = c
                .get_weight_plan(GetWeightPlanRequest {})
                .await
                .expect_err("no engine");
            assert_eq!(e.code(), Code::Unavailable, "{e:?}");
            assert!(e.message().contains("no live engine"), "{e:?}");
            drop(c);
            drop(server);
            // Stopping is asynchronous: poll until the port refuses.
            while tokio::net::TcpStream::connect(addr).await.is_ok() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the server stopped in time");
    }
}
