//! The controller's gRPC API for external trainers: the engine side of weight sync.
//!
//! An external trainer (rank 0, e.g. a Python FSDP process with NCCL) broadcasts the tensors;
//! this service tells every engine what to expect, concurrently, and never resumes serving on
//! mixed weight versions.
//!
//! It controls every engine, so it is guarded like the hosts: with a token every request must
//! carry `authorization: Bearer <token>` (refused before it reaches a handler, so a refused call
//! changes nothing), it refuses to listen on a non-loopback address without one, and it can
//! serve over TLS. [`connect`] is the matching client.

use std::net::SocketAddr;

use serde_json::Value;
use tokio::net::TcpListener;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};
use troupe_actors::auth::{TokenAttach, TokenCheck};
use troupe_actors::tls::{ClientTls, ServerTls};
use troupe_weights::plan::{EngineGpus, WeightSyncPlan};
use troupe_wire::v1::controller_client::ControllerClient;
use troupe_wire::v1::controller_server::{Controller, ControllerServer};
use troupe_wire::v1::{
    BeginWeightUpdateRequest, EndWeightUpdateRequest, EngineRank, GetWeightPlanRequest,
    InitWeightGroupRequest, ServerStatus, WeightAck, WeightBucketRequest, WeightPlan,
};

use troupe_wire::sglang::{InitWeightsUpdateGroup, UpdateWeightsFromDistributed};

use troupe_serving::control_plane::{InferenceControl, ServerResult};
use troupe_wire::PauseMode;

/// The `troupe.v1.Controller` service over a set of engines.
#[derive(Clone)]
pub struct ControllerApi {
    control: InferenceControl,
    gpus: Vec<u32>,
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

fn ack(results: Vec<ServerResult<Value>>) -> WeightAck {
    let servers: Vec<ServerStatus> = results
        .into_iter()
        .map(|r| ServerStatus {
            ok: r.result.is_ok(),
            error: r.result.err().unwrap_or_default(),
            url: r.url,
        })
        .collect();
    WeightAck {
        ok: servers.iter().all(|s| s.ok),
        servers,
    }
}

impl ControllerApi {
    /// An API over `control`'s engines; `gpus[i]` is engine i's GPU count (its rank span).
    pub fn new(control: InferenceControl, gpus: Vec<u32>) -> Result<Self, String> {
        if gpus.len() != control.urls().len() {
            return Err(format!(
                "{} engines but {} GPU counts",
                control.urls().len(),
                gpus.len()
            ));
        }
        Ok(ControllerApi {
            control,
            gpus,
            token: None,
            tls: None,
        })
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

    fn plan(&self) -> Result<WeightSyncPlan, Status> {
        let engines: Vec<EngineGpus> = self
            .control
            .urls()
            .iter()
            .zip(&self.gpus)
            .map(|(u, g)| EngineGpus {
                engine: u.clone(),
                gpus: *g,
            })
            .collect();
        WeightSyncPlan::new("troupe-weights", &engines, 1)
            .map_err(|e| Status::failed_precondition(e.to_string()))
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

    /// Binds `addr` and serves in the background; returns the bound address. Refuses a
    /// non-loopback address without a token: anyone who reached it could pause every engine
    /// or load weights into them.
    pub async fn spawn(self, addr: SocketAddr) -> Result<SocketAddr, String> {
        check_listen(addr, self.token.as_deref())?;
        let l = TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let bound = l.local_addr().map_err(|e| e.to_string())?;
        let served = self.serve(l, std::future::pending());
        tokio::spawn(async move {
            if let Err(e) = served.await {
                tracing::error!("controller api on {bound} stopped: {e}");
            }
        });
        Ok(bound)
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
        let plan = self.plan()?;
        let engines = self
            .control
            .urls()
            .iter()
            .enumerate()
            .map(|(i, u)| EngineRank {
                url: u.clone(),
                rank_offset: plan.rank_offset(i).unwrap_or(0),
                gpus: self.gpus[i],
            })
            .collect();
        Ok(Response::new(WeightPlan {
            world_size: plan.world_size(),
            engines,
        }))
    }

    async fn init_weight_group(
        &self,
        r: Request<InitWeightGroupRequest>,
    ) -> Result<Response<WeightAck>, Status> {
        let r = r.into_inner();
        if r.master_address.is_empty() || r.master_port == 0 || r.master_port > 65535 {
            return Err(Status::invalid_argument(
                "master_address and master_port (1-65535) are required, e.g. 10.0.0.1:29500",
            ));
        }
        if r.group_name.is_empty() {
            return Err(Status::invalid_argument("group_name is required"));
        }
        let backend = if r.backend.is_empty() {
            "nccl".to_string()
        } else {
            r.backend
        };
        let plan = self.plan()?;
        let world = plan.world_size();
        let engines = self.control.engines();
        let calls = engines.iter().enumerate().map(|(i, e)| {
            let req = InitWeightsUpdateGroup {
                master_address: r.master_address.clone(),
                master_port: u16::try_from(r.master_port).unwrap_or(0),
                rank_offset: plan.rank_offset(i).unwrap_or(0),
                world_size: world,
                group_name: r.group_name.clone(),
                backend: backend.clone(),
            };
            async move {
                ServerResult {
                    url: e.url.clone(),
                    result: self
                        .control
                        .client()
                        .init_weight_group(e, &req)
                        .await
                        .map_err(|e| e.to_string()),
                }
            }
        });
        Ok(Response::new(ack(futures::future::join_all(calls).await)))
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
        Ok(Response::new(ack(self.control.pause(mode).await)))
    }

    async fn weight_bucket(
        &self,
        r: Request<WeightBucketRequest>,
    ) -> Result<Response<WeightAck>, Status> {
        let r = r.into_inner();
        let n = r.names.len();
        if n == 0 || r.dtypes.len() != n || r.shapes.len() != n {
            return Err(Status::invalid_argument(format!(
                "names, dtypes and shapes must be non-empty and of equal length (got {}, {}, {})",
                n,
                r.dtypes.len(),
                r.shapes.len()
            )));
        }
        // What `EndWeightUpdate` expects every engine to hold (engines that honour `If-Match`
        // then check and resume in one call).
        if !r.weight_version.is_empty() {
            self.control.fleet().expect_version(&r.weight_version);
        }
        let req = UpdateWeightsFromDistributed {
            names: r.names,
            dtypes: r.dtypes,
            shapes: r
                .shapes
                .iter()
                .map(|s| s.dims.iter().map(|&d| d as usize).collect())
                .collect(),
            group_name: r.group_name,
            flush_cache: r.flush_cache,
            weight_version: Some(r.weight_version),
            packed: false,
        };
        let req = &req;
        let res = self
            .control
            .fan_out(|c, u| async move { c.update_weights(&u, req).await })
            .await;
        Ok(Response::new(ack(res)))
    }

    async fn end_weight_update(
        &self,
        _r: Request<EndWeightUpdateRequest>,
    ) -> Result<Response<WeightAck>, Status> {
        let expected = self.control.fleet().expected_version();
        let r = self
            .control
            .resume_on_one_version(None, expected.as_deref())
            .await
            .map_err(|m| {
                Status::failed_precondition(format!(
                    "engines hold different weight versions {:?}; finish the update (resend the failed buckets) before resuming{}",
                    m.versions, m.undone
                ))
            })?;
        // Servers that came back held (restarted on initial weights) and took this update may
        // be routed again: the serving watcher readmits them.
        if let Some(v) = &r.version {
            self.control.fleet().updated(v, &r.reached);
        }
        Ok(Response::new(ack(r.results)))
    }
}
