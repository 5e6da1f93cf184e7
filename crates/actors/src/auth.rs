//! Shared-token authentication of the gRPC control plane.
//!
//! Anyone who can reach a host's port could otherwise spawn processes on it. Every request
//! carries `authorization: Bearer <token>`; a host started with a token refuses any request
//! without the same token, before it reaches the host core, so a refused call changes nothing.

use std::sync::Arc;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// Environment variable hosts and controllers read the token from.
pub const TOKEN_ENV: &str = "TROUPE_TOKEN";

pub use troupe_wire::auth::same;

/// Server side: refuses requests without the expected bearer token (none expected: all pass).
#[derive(Clone, Default)]
pub struct TokenCheck {
    expected: Option<Arc<str>>,
}

impl TokenCheck {
    /// Expects `token` (or nothing, with `None`).
    pub fn new(token: Option<&str>) -> Self {
        TokenCheck {
            expected: token.map(Arc::from),
        }
    }
}

impl Interceptor for TokenCheck {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(want) = &self.expected else {
            return Ok(req);
        };
        let given = req.metadata().get("authorization").map(|v| {
            v.to_str()
                .ok()
                .and_then(troupe_wire::auth::bearer_value)
                .unwrap_or("")
        });
        match given {
            Some(got) if same(got.as_bytes(), want.as_bytes()) => Ok(req),
            Some(_) => Err(Status::unauthenticated(
                "wrong control-plane token: use the server's token (--token, TROUPE_TOKEN or the config's `token`)",
            )),
            None => Err(Status::unauthenticated(
                "this server requires a control-plane token: send `authorization: Bearer <token>` (set TROUPE_TOKEN)",
            )),
        }
    }
}

/// Client side: attaches the bearer token to every request.
#[derive(Clone, Default)]
pub struct TokenAttach {
    value: Option<MetadataValue<Ascii>>,
}

impl TokenAttach {
    /// Attaches `token`; an error if it cannot travel in a header (non-ASCII, control chars).
    pub fn new(token: Option<&str>) -> Result<Self, String> {
        let value = match token {
            None => None,
            Some(t) => Some(
                format!("Bearer {t}")
                    .parse()
                    .map_err(|_| "the control-plane token must be printable ASCII".to_string())?,
            ),
        };
        Ok(TokenAttach { value })
    }
}

impl Interceptor for TokenAttach {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.value {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}
