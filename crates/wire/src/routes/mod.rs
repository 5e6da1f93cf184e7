//! The engine protocol's routes, once: one type per route and dialect ([`Endpoint`], listed in
//! [`endpoints`]), each naming its path, methods, dialect, who may call it, whether it changes
//! anything, which side serves it, and its request and answer types.
//!
//! [`ROUTES`] is built from that list. The engine and the gateway spell paths only through the
//! endpoints (`endpoints::PauseGeneration::PATH`), `EngineClient` calls them by type, and the
//! key checks of both servers and the gateway's control forwarder read the table, so paths and
//! methods cannot drift apart (they had: the engine served `/shutdown_weight_transfer_engine`
//! and the gateway did not, the gateway took `/wakeup` and the engine did not, the gateway took
//! `GET` on the memory routes and the engine did not). A test in the workspace
//! (`tests/serving/routes.rs`) checks every route here against both servers: each listed method
//! is served where the table says and nowhere else, and no other method is served.
//!
//! Auth levels follow the engines' own. SGLang 0.5.23 marks its mutating control routes
//! `AuthLevel.ADMIN_OPTIONAL` (the admin key when one is set) and leaves its read-only info
//! routes at the normal level; vLLM's development routes are its control routes. So: a route
//! that [`Route::mutates`] needs the admin key at the gateway; a read-only one is open there
//! unless the gateway is configured to key reads too.

/// Who serves a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The reference engine (one engine) and the gateway (the whole fleet).
    Both,
    /// Only an engine: it makes no sense fleet-wide.
    Engine,
    /// Only the gateway: a fleet-level name or an operation engines do not have.
    Gateway,
    /// Only real engines (vLLM's `/version`): Troupe calls it, neither the reference engine nor
    /// the gateway serves it.
    Foreign,
}

/// What an engine asks of a caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineAuth {
    /// The engine's admin key (its API key when it has no admin key).
    Admin,
    /// Its API key, like an inference request (when one is set).
    Normal,
}

/// What a route is for: the table holds the inference routes too, but only control routes are
/// keyed as such and forwarded to the fleet's control plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Fleet and engine control, and the reads that go with it (versions, server info).
    Control,
    /// Generation, tokenization and the OpenAI routes: keyed like any inference request.
    Inference,
    /// Liveness, readiness, load and metrics: open on the engine.
    Probe,
    /// The gateway's own management (`/workers`), keyed by its admin key.
    Admin,
}

/// One route of the engine protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    /// The path.
    pub path: &'static str,
    /// The methods it takes (`GET`, `POST`).
    pub methods: &'static [&'static str],
    /// Whose protocol it belongs to (`None`: Troupe's own).
    pub dialect: Option<crate::EngineDialect>,
    /// Whether calling it changes anything (pause, load, free, abort): such a route needs the
    /// admin key at the gateway.
    pub mutates: bool,
    /// What the reference engine asks of a caller.
    pub engine_auth: EngineAuth,
    /// Who serves it.
    pub side: Side,
    /// What it is for.
    pub kind: Kind,
    /// Methods only the reference engine takes besides [`Route::methods`], as the engine it
    /// stands for does (SGLang takes `PUT /generate`; its router, like the gateway, does not).
    pub engine_also: &'static [&'static str],
}

impl Route {
    /// Whether the route takes `method` (`GET`, `POST`, ...) on the gateway, and on the engine
    /// unless it is one of [`Route::engine_also`].
    pub fn takes(&self, method: &str) -> bool {
        self.methods.contains(&method)
    }

    /// Whether the reference engine takes `method` here.
    pub fn engine_takes(&self, method: &str) -> bool {
        self.takes(method) || self.engine_also.contains(&method)
    }

    /// The same route with `methods` taken by the engine alone as well.
    pub const fn with_engine_also(mut self, methods: &'static [&'static str]) -> Self {
        self.engine_also = methods;
        self
    }
}

/// One endpoint of the engine protocol: a type per route and dialect, as mini-redis has one
/// struct per command. The engine registers its handler at [`Endpoint::ROUTE`] and parses
/// [`Endpoint::Request`]; `EngineClient` sends that request and reads [`Endpoint::Response`];
/// the gateway serves the same route fleet-wide. So a route's path, methods and bodies are
/// written once, here, and the compiler ties the three sides together.
pub trait Endpoint {
    /// Path, methods, dialect, auth, side.
    const ROUTE: Route;
    /// The path alone (what handlers are registered at and clients call).
    const PATH: &'static str = Self::ROUTE.path;
    /// Where the request travels.
    const CARRIER: Carrier;
    /// The request: a JSON body, a query string, or `()` for none.
    type Request;
    /// The answer (`serde_json::Value` where engines answer free-form JSON).
    type Response;
}

/// Where an endpoint's request travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carrier {
    /// A JSON body.
    Json,
    /// The query string (vLLM's `/pause?mode=`, `/sleep?level=`, `/wake_up?tags=`).
    Query,
    /// Nothing (a GET, or a POST whose body is ignored).
    None,
}

pub mod body;
pub mod endpoints;
#[cfg(feature = "axum")]
pub mod serve;

pub use endpoints::ROUTES;

/// The query string of a request its endpoint carries there ([`Carrier::Query`]): `?k=v&...`,
/// a list repeating its key (`tags=a&tags=b`, as vLLM reads it), absent fields left out;
/// empty when nothing is set. An error when the request is not a flat object.
pub fn query_string(req: &(impl serde::Serialize + ?Sized)) -> Result<String, String> {
    use serde_json::Value;
    let obj = match serde_json::to_value(req).map_err(|e| e.to_string())? {
        Value::Object(o) => o,
        Value::Null => return Ok(String::new()),
        other => return Err(format!("a query is an object of fields, not {other}")),
    };
    let mut parts = Vec::new();
    for (k, v) in obj {
        let values = match v {
            Value::Array(a) => a,
            Value::Null => Vec::new(),
            one => vec![one],
        };
        for x in values {
            let text = match x {
                Value::String(s) => s,
                Value::Array(_) | Value::Object(_) => {
                    return Err(format!("{k}: a query value must be a string or a number"));
                }
                other => other.to_string(),
            };
            parts.push(format!("{}={}", escape(&k), escape(&text)));
        }
    }
    Ok(if parts.is_empty() {
        String::new()
    } else {
        format!("?{}", parts.join("&"))
    })
}

/// Percent-encodes all but RFC 3986's unreserved characters.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The route at `path`, of any kind. One hash lookup.
pub fn lookup(path: &str) -> Option<&'static Route> {
    static BY_PATH: std::sync::OnceLock<std::collections::HashMap<&'static str, &'static Route>> =
        std::sync::OnceLock::new();
    BY_PATH
        .get_or_init(|| ROUTES.iter().map(|r| (r.path, r)).collect())
        .get(path)
        .copied()
}

/// The route at `path`, if it is a control route. One hash lookup: every request to the
/// gateway and the engine asks (their key checks).
pub fn find(path: &str) -> Option<&'static Route> {
    lookup(path).filter(|r| r.kind == Kind::Control)
}

/// Paths the gateway serves as fleet control endpoints.
pub fn gateway_paths() -> impl Iterator<Item = &'static str> {
    ROUTES
        .iter()
        .filter(|r| r.kind == Kind::Control && r.side != Side::Engine)
        .map(|r| r.path)
}

/// Whether the reference engine asks for its admin key on `path`.
pub fn engine_admin(path: &str) -> bool {
    find(path).is_some_and(|r| r.side != Side::Gateway && r.engine_auth == EngineAuth::Admin)
}

#[cfg(test)]
mod tests {
    use super::*;
    use endpoints::GET;

    #[test]
    fn paths_are_unique_and_reads_are_gets() {
        let mut seen = std::collections::HashSet::new();
        for r in ROUTES {
            assert!(seen.insert(r.path), "{} twice", r.path);
            assert!(r.path.starts_with('/'));
            if !r.mutates && r.kind == Kind::Control {
                assert_eq!(r.methods, GET, "{}: reads are GETs", r.path);
                assert_eq!(r.engine_auth, EngineAuth::Normal, "{}", r.path);
            }
        }
        assert!(engine_admin("/pause_generation"));
        assert!(!engine_admin("/server_info"));
        assert!(!engine_admin("/wakeup"), "gateway-only");
        assert!(gateway_paths().any(|p| p == "/wakeup"));
        assert!(!gateway_paths().any(|p| p == "/shutdown_weight_transfer_engine"));
        assert!(
            !gateway_paths().any(|p| p == "/generate"),
            "inference, not control"
        );
        assert!(find("/generate").is_none());
        assert_eq!(lookup("/generate").map(|r| r.kind), Some(Kind::Inference));
    }
}
