//! A benchmark tool, not an engine: a light stand-in for the reference engine that
//! `troupe bench scale --engine stub` places instead of real servers, so that 4,096 servers fit
//! on one machine and what is measured is the controller, the router and the fan-out, not the
//! engines.
//!
//! It is the `troupe.inference` actor kind of the hosts that benchmark launches ([`StubHosts`]:
//! `troupe host` processes with [`HOST_ENV`] set, which then register [`registry`] instead of
//! [`troupe_controller::standard_registry`]); nothing else ever registers it, so no test that
//! claims an engine can get one. Each stand-in binds the HTTP port the controller gave its
//! server and serves, on its host's runtime beside the host's other stand-ins, the
//! SGLang-dialect routes the controller, the data proxies and the gateway call: health, info,
//! load, weight version, pause and resume (with `If-Match` as the reference engine has it),
//! cache flush, memory release, aborts, and `/generate` with one fixed answer (no model, no
//! tokens computed). Weight transfers (`/init_weights_update_group` and the rest) are refused
//! with 501: the stand-in receives no weights, so the scale bench measures a version change
//! (`/update_weight_version`) instead: every stand-in's `/server_info` reports the wall-clock
//! time it last switched (`weight_version_switched_unix_ns`, one clock for every process of the
//! machine), which the bench compares with the time it asked.

use std::sync::{Arc, Mutex};
use std::time::Instant;
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use serde_json::{Value, json};
use troupe_actors::ActorError;
use troupe_actors::actor::{Actor, ActorContext, Handler, Methods};
use troupe_serving::inference::server::{CheckHealth, GetInfo, LogTail, ServerHealth};
use troupe_serving::inference::{LaunchSpec, ServerInfo, WorkerType};

/// The fixed text every `/generate` answers.
pub const ANSWER: &str = "stub";

/// The environment variable that makes `troupe host` serve stand-ins (value `1`).
pub const HOST_ENV: &str = "TROUPE_BENCH_STUB_ENGINE";

/// Now on the wall clock, in ns since the Unix epoch (0 if the clock is before it).
fn unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Launches `troupe host` processes on this machine, as the local launcher does, with
/// [`HOST_ENV`] set so that they serve stand-ins.
pub struct StubHosts(pub troupe_scheduler::launch::LocalLauncher);

impl troupe_scheduler::launch::HostLauncher for StubHosts {
    fn name(&self) -> &'static str {
        "local (stub engines)"
    }

    fn launch<'a>(
        &'a self,
        req: &'a troupe_scheduler::launch::LaunchRequest,
    ) -> troupe_scheduler::launch::BoxFuture<
        'a,
        Result<Vec<troupe_scheduler::launch::LaunchedHost>, troupe_scheduler::launch::LaunchError>,
    > {
        Box::pin(async move {
            let mut req = req.clone();
            req.host_env.push((HOST_ENV.to_string(), "1".to_string()));
            // One runtime worker per host process: hundreds of them share this machine's
            // cores, and a second worker each only adds wake-ups (the hosts' CPU per fan-out
            // was ~15% higher with two).
            req.host_env
                .push(("TOKIO_WORKER_THREADS".to_string(), "1".to_string()));
            self.0.launch(&req).await
        })
    }

    fn teardown(&self) -> troupe_scheduler::launch::BoxFuture<'_, ()> {
        self.0.teardown()
    }
}

/// What one stand-in says about itself; small, since thousands live in one process.
struct Stand {
    port: u16,
    admin_key: Option<String>,
    mode: &'static str,
    state: Mutex<StandState>,
}

#[derive(Default)]
struct StandState {
    version: String,
    /// When `version` was set (wall clock, ns since the Unix epoch; 0: never changed).
    switched_unix_ns: u64,
    paused: Option<String>,
}

impl Stand {
    fn lock(&self) -> std::sync::MutexGuard<'_, StandState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An admin route's key check, as the engine's: the 401 to answer unless the bearer key
    /// matches (`None`: go on).
    fn refused(&self, headers: &HeaderMap) -> Option<Response> {
        let key = self.admin_key.as_ref()?;
        (!troupe_wire::auth::has_key(headers, key))
            .then(|| error(StatusCode::UNAUTHORIZED, "missing or wrong API key"))
    }
}

fn error(status: StatusCode, message: &str) -> Response {
    (
        status,
        axum::Json(json!({"error": {"message": message, "code": status.as_u16()}})),
    )
        .into_response()
}

fn ok() -> Response {
    axum::Json(json!({"success": true, "message": "ok"})).into_response()
}

type St = State<Arc<Stand>>;

async fn server_info(State(s): St) -> Response {
    let st = s.lock();
    axum::Json(json!({
        "model_path": Value::Null,
        "served_model_name": "stub",
        "port": s.port,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "disaggregation_mode": s.mode,
        "context_length": 4096,
        "max_total_num_tokens": 65536,
        "weight_version": st.version,
        "weight_version_switched_unix_ns": st.switched_unix_ns,
        "internal_states": [{"weight_version": st.version, "paused": st.paused}],
        "version": "troupe bench stub-engine",
        "resume_if_match": true,
    }))
    .into_response()
}

async fn model_info(State(s): St) -> Response {
    axum::Json(json!({
        "model_path": Value::Null, "tokenizer_path": Value::Null, "is_generation": true,
        "weight_version": s.lock().version, "model_type": "stub",
    }))
    .into_response()
}

async fn weight_version(State(s): St) -> Response {
    axum::Json(json!({"weight_version": s.lock().version})).into_response()
}

async fn get_load(State(s): St) -> Response {
    let _ = &s;
    axum::Json(json!([{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]))
        .into_response()
}

async fn pause(State(s): St, headers: HeaderMap, body: axum::body::Bytes) -> Response {
    if let Some(r) = s.refused(&headers) {
        return r;
    }
    let mode = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v.get("mode").and_then(Value::as_str).map(str::to_string))
        .unwrap_or_else(|| "abort".into());
    s.lock().paused = Some(mode);
    ok()
}

/// `POST /continue_generation`, with `If-Match: "<version>"` (or `*`) checked as the engine
/// checks it: 412 and the version held when it does not match.
async fn resume(State(s): St, req: Request) -> Response {
    if let Some(r) = s.refused(req.headers()) {
        return r;
    }
    let wanted = req
        .headers()
        .get(header::IF_MATCH)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let mut st = s.lock();
    if let Some(w) = wanted.filter(|w| w.trim() != "*") {
        let matches = w
            .split(',')
            .any(|t| t.trim().trim_matches('"') == st.version);
        if !matches {
            let held = st.version.clone();
            return (
                StatusCode::PRECONDITION_FAILED,
                axum::Json(
                    json!({"weight_version": held, "error": {"message": "weight version differs"}}),
                ),
            )
                .into_response();
        }
    }
    st.paused = None;
    ok()
}

async fn set_version(State(s): St, headers: HeaderMap, body: axum::body::Bytes) -> Response {
    if let Some(r) = s.refused(&headers) {
        return r;
    }
    let Some(v) = serde_json::from_slice::<Value>(&body).ok().and_then(|v| {
        v.get("new_version")
            .and_then(Value::as_str)
            .map(str::to_string)
    }) else {
        return error(StatusCode::BAD_REQUEST, "new_version must be a string");
    };
    let mut st = s.lock();
    st.version = v;
    st.switched_unix_ns = unix_ns();
    ok()
}

async fn admin_ok(State(s): St, headers: HeaderMap) -> Response {
    s.refused(&headers).unwrap_or_else(ok)
}

async fn no_weights() -> Response {
    error(
        StatusCode::NOT_IMPLEMENTED,
        "the benchmark's stub engine receives no weights (troupe bench scale --engine stub)",
    )
}

/// `/generate`: one fixed answer in SGLang's shape, streamed as one event when asked.
async fn generate(State(s): St, body: axum::body::Bytes) -> Response {
    let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let (version, paused) = {
        let st = s.lock();
        (st.version.clone(), st.paused.is_some())
    };
    if paused {
        return error(StatusCode::SERVICE_UNAVAILABLE, "paused");
    }
    let answer = json!({
        "text": ANSWER,
        "output_ids": [0],
        "meta_info": {
            "id": req.get("rid").cloned().unwrap_or(Value::Null),
            "prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": 1},
            "weight_version": version,
        },
    });
    if req.get("stream").and_then(Value::as_bool) == Some(true) {
        let text = format!("data: {answer}\n\ndata: [DONE]\n\n");
        return ([(header::CONTENT_TYPE, "text/event-stream")], text).into_response();
    }
    axum::Json(answer).into_response()
}

fn router(s: Arc<Stand>) -> Router {
    Router::new()
        .route(ep::Health::PATH, get(|| async { StatusCode::OK }))
        .route(ep::Ready::PATH, get(|| async { StatusCode::OK }))
        .route(ep::HealthGenerate::PATH, get(|| async { StatusCode::OK }))
        .route(ep::ServerInfo::PATH, get(server_info))
        .route(ep::GetServerInfo::PATH, get(server_info))
        .route(ep::ModelInfo::PATH, get(model_info))
        .route(ep::GetModelInfo::PATH, get(model_info))
        .route(ep::GetWeightVersion::PATH, get(weight_version))
        .route(ep::GetLoad::PATH, get(get_load))
        .route(ep::Generate::PATH, post(generate))
        .route(ep::PauseGeneration::PATH, post(pause))
        .route(ep::ContinueGeneration::PATH, post(resume))
        .route(ep::UpdateWeightVersion::PATH, post(set_version))
        .route(ep::FlushCache::PATH, post(admin_ok).get(admin_ok))
        .route(ep::ReleaseMemoryOccupation::PATH, post(admin_ok))
        .route(ep::ResumeMemoryOccupation::PATH, post(admin_ok))
        .route(ep::AbortRequest::PATH, post(|| async { ok() }))
        .route(ep::InitWeightsUpdateGroup::PATH, post(no_weights))
        .route(ep::UpdateWeightsFromDistributed::PATH, post(no_weights))
        .route(ep::DestroyWeightsUpdateGroup::PATH, post(no_weights))
        .route(ep::UpdateWeightsFromDisk::PATH, post(no_weights))
        .with_state(s)
}

/// The `troupe.inference` kind of the scale bench's hosts: one stand-in server per actor, its
/// HTTP side a task of this process that ends when the actor does.
pub struct StubEngine {
    info: ServerInfo,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for StubEngine {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

impl Actor for StubEngine {
    const KIND: &'static str = "troupe.inference";
    type Args = LaunchSpec;

    async fn start(spec: LaunchSpec, _ctx: &ActorContext) -> Result<Self, ActorError> {
        let started = Instant::now();
        let listener = tokio::net::TcpListener::bind((spec.host.as_str(), spec.port))
            .await
            .map_err(|e| {
                // The fork relaunches on fresh ports when it reads this.
                ActorError::new(format!(
                    "stub engine cannot listen on {}:{}: {e}",
                    spec.host, spec.port
                ))
            })?;
        let mode = match spec.worker_type {
            WorkerType::Regular | WorkerType::Train => "null",
            WorkerType::Prefill => "prefill",
            WorkerType::Decode => "decode",
        };
        let stand = Arc::new(Stand {
            port: spec.port,
            admin_key: spec.admin_api_key.clone(),
            mode,
            state: Mutex::new(StandState {
                version: "default".into(),
                ..StandState::default()
            }),
        });
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let app = router(stand);
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        tokio::spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
                let _ = stopped.await;
            });
            if let Err(e) = serve.await {
                tracing::warn!("stub engine stopped serving: {e}");
            }
        });
        let pd = spec.worker_type != WorkerType::Regular;
        let info = ServerInfo {
            addr: format!("{}:{}", spec.advertise_host, spec.port),
            url: spec.url(),
            worker_type: spec.worker_type,
            bootstrap_host: pd.then(|| spec.advertise_host.clone()),
            bootstrap_port: if pd { spec.bootstrap_port } else { None },
            gpu_count: spec.gpu_count(),
            pid: std::process::id(),
            log_path: String::new(),
            command: vec!["troupe bench stub-engine".into()],
            ready_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        };
        Ok(StubEngine {
            info,
            stop: Some(stop),
        })
    }

    fn methods(m: &mut Methods<Self>) {
        m.add::<GetInfo>().add::<CheckHealth>().add::<LogTail>();
    }
}

impl Handler<GetInfo> for StubEngine {
    async fn handle(&mut self, _m: GetInfo, _c: &ActorContext) -> Result<ServerInfo, ActorError> {
        Ok(self.info.clone())
    }
}

impl Handler<CheckHealth> for StubEngine {
    async fn handle(
        &mut self,
        _m: CheckHealth,
        _c: &ActorContext,
    ) -> Result<ServerHealth, ActorError> {
        let running = self.stop.as_ref().is_some_and(|s| !s.is_closed());
        Ok(ServerHealth {
            running,
            exit_code: None,
            healthy: running,
        })
    }
}

impl Handler<LogTail> for StubEngine {
    async fn handle(&mut self, _m: LogTail, _c: &ActorContext) -> Result<String, ActorError> {
        Ok("(the benchmark's stub engine keeps no log)".into())
    }
}

/// The scale bench's hosts' actor kinds: the standard ones, with `troupe.inference` replaced by
/// the stand-in.
pub fn registry() -> troupe_actors::Registry {
    let mut r = troupe_controller::standard_registry();
    r.register::<StubEngine>();
    r
}
