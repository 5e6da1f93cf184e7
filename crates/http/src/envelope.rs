//! The request limits and the error envelope of every inbound request, ahead of routing's
//! handlers ([`front`], run by `listen::serve` for every request of the gateway and the DataProxy
//! alike, before routing).
//!
//! Before a handler runs: the URI (at most [`MAX_URI_BYTES`]) and the headers (at most
//! [`MAX_HEADERS`], [`MAX_HEADER_BYTES`] in all) are checked, then the route's key
//! ([`crate::keys::KeyedRoutes`]: a request without it is answered 401 before a byte of its body
//! is read), and the body is read in full here,
//! with the one body limit (`max_body_bytes`, checked against `Content-Length` before reading a
//! byte) and the body read timeout. Over a limit the answer is 414, 431 or 413, past the
//! timeout 408, all in the JSON envelope and with `Connection: close`, since the rest of the
//! request is never read.
//!
//! After a handler ran: any error answer (4xx/5xx) whose body is not JSON — axum's own plain-text
//! rejections, its empty 405, an upstream's plain-text error passed along — becomes the envelope
//! with the same status and headers and the original text as its message, so a client only ever
//! parses one error shape.
//!
//! Requests past hyper's own hard limits (more than 256 headers, a head larger than hyper's
//! ~400 KiB read buffer, a URI over 64 KiB) never reach this layer: hyper answers them with a
//! bare status line and closes the connection.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, Limited};
use hyper_util::service::TowerToHyperService;

use crate::error::ApiError;
use crate::hops::Hop;
use crate::keys::KeyedRoutes;
use crate::limits::ServeLimits;

/// Longest accepted path and query, in bytes (414 past it).
pub const MAX_URI_BYTES: usize = 8 << 10;
/// Most request headers (431 past it).
pub const MAX_HEADERS: usize = 100;
/// Most bytes of request headers, names and values (431 past it).
pub const MAX_HEADER_BYTES: usize = 64 << 10;
/// Most bytes of a non-JSON error body read to become the envelope's message.
const MAX_ERROR_TEXT: usize = 4 << 10;

/// What every request passes before it is routed, and what its answer passes after: the
/// limits, the route keys, and on a gateway its place in via chains ([`crate::hops`]).
#[derive(Debug, Clone)]
pub struct Front {
    /// The request limits.
    pub limits: ServeLimits,
    /// Which routes need which key.
    pub keys: KeyedRoutes,
    /// The gateway's id in via chains; `None` on servers that forward nothing (a data proxy).
    pub hop: Option<Arc<Hop>>,
}

/// An envelope answer after which the connection closes (the request was not read in full).
fn closing(e: ApiError) -> Response {
    let mut r = e.into_response();
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// Checks the request head, buffers the body within the limits, refuses a looped request (on a
/// gateway), runs `app` and maps a non-JSON error answer to the envelope. Called by the
/// listener for every request, ahead of routing: as an axum layer (`from_fn`) it cost each
/// request a clone of the route's boxed service, a boxed `Next` and a boxed future, twice with
/// the gateway's hop layer, about a tenth of the gateway's CPU per request.
pub(crate) async fn front<B>(front: &Front, app: axum::Router, req: Request<B>) -> Response
where
    B: hyper::body::Body<Data = axum::body::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (limits, keys) = (&front.limits, &front.keys);
    let uri_len = req.uri().path_and_query().map_or(0, |p| p.as_str().len());
    if uri_len > MAX_URI_BYTES {
        return closing(ApiError::new(
            StatusCode::URI_TOO_LONG,
            format!("the request URI is {uri_len} bytes; at most {MAX_URI_BYTES} are accepted"),
        ));
    }
    let headers = req.headers();
    let header_bytes: usize = headers
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum();
    if headers.len() > MAX_HEADERS || header_bytes > MAX_HEADER_BYTES {
        return closing(ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            format!(
                "the request has {} headers of {header_bytes} bytes; at most {MAX_HEADERS} headers of {MAX_HEADER_BYTES} bytes are accepted",
                headers.len()
            ),
        ));
    }
    if let Some(refused) = keys.refusal(req.uri().path(), req.headers()) {
        return refused;
    }
    let req = match buffer(req, *limits).await {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    let chain = match &front.hop {
        Some(hop) => match crate::hops::enter(hop, req.headers(), req.uri().path()) {
            Ok(c) => Some(c),
            Err(refused) => return refused.into_response(),
        },
        None => None,
    };
    // Kept for the envelope's message, should the answer be an error.
    let (method, uri) = (req.method().clone(), req.uri().clone());
    let call = hyper::service::Service::call(&TowerToHyperService::new(app), req);
    let resp = match chain {
        Some(c) => crate::hops::within(c, call).await,
        None => call.await,
    };
    let resp = match resp {
        Ok(r) => r,
        Err(never) => match never {},
    };
    to_envelope(resp, &method, uri.path()).await
}

fn too_large(limit: usize) -> Response {
    closing(ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!(
            "the request body is larger than {limit} bytes (the server's max_body_bytes; max_weights_bytes for weight pushes)"
        ),
    ))
}

/// Reads the whole body within `max_body_bytes` and `body_read_timeout`.
async fn buffer<B>(req: Request<B>, limits: ServeLimits) -> Result<Request, Response>
where
    B: hyper::body::Body<Data = axum::body::Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let max = if req.uri().path() == crate::limits::WEIGHTS_PATH {
        limits.max_weights_bytes.max(limits.max_body_bytes)
    } else {
        limits.max_body_bytes
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large(max));
    }
    let (parts, body) = req.into_parts();
    let read = tokio::time::timeout(limits.body_read_timeout, Limited::new(body, max).collect());
    let bytes = match read.await {
        Ok(Ok(c)) => c.to_bytes(),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => return Err(too_large(max)),
        Ok(Err(e)) => {
            return Err(closing(ApiError::bad_request(format!(
                "cannot read the request body: {e}"
            ))));
        }
        Err(_) => {
            return Err(closing(ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request body did not arrive within {:?} (the server's body_read_timeout)",
                    limits.body_read_timeout
                ),
            )));
        }
    };
    Ok(Request::from_parts(parts, Body::from(bytes)))
}

/// Whether a content type is JSON (`application/json`, `application/problem+json`, ...).
pub fn is_json(ct: Option<&HeaderValue>) -> bool {
    ct.and_then(|v| v.to_str().ok()).is_some_and(|v| {
        let mime = v
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        mime == "application/json" || mime.ends_with("+json")
    })
}

/// The envelope message for a non-JSON error body: its text, or what the status means.
fn message(status: StatusCode, text: &str, method: &axum::http::Method, path: &str) -> String {
    let text = text.trim();
    if !text.is_empty() {
        return text.to_string();
    }
    match status {
        StatusCode::METHOD_NOT_ALLOWED => format!(
            "method {method} is not allowed on {path} (the Allow header lists the methods it takes)"
        ),
        _ => format!(
            "{method} {path}: {}",
            status.canonical_reason().unwrap_or("error")
        ),
    }
}

/// `resp` unchanged unless it is an error with a non-JSON body; then the envelope with the same
/// status and headers, the body's text (at most 4 KiB of it) as the message.
async fn to_envelope(resp: Response, method: &axum::http::Method, path: &str) -> Response {
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error())
        || is_json(resp.headers().get(header::CONTENT_TYPE))
    {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    // Error bodies are short and already produced; a slow one is cut rather than waited for.
    let text = match tokio::time::timeout(
        Duration::from_secs(5),
        Limited::new(body, MAX_ERROR_TEXT).collect(),
    )
    .await
    {
        Ok(Ok(c)) => String::from_utf8_lossy(&c.to_bytes()).into_owned(),
        _ => String::new(),
    };
    let msg = message(status, &text, method, path);
    let env = ApiError::new(status, msg).into_response();
    let (env_parts, env_body) = env.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.remove(header::TRANSFER_ENCODING);
    parts.headers.remove(header::CONTENT_ENCODING);
    for (k, v) in env_parts.headers {
        if let Some(k) = k {
            parts.headers.insert(k, v);
        }
    }
    Response::from_parts(parts, env_body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_content_types() {
        for (ct, json) in [
            ("application/json", true),
            ("application/json; charset=utf-8", true),
            ("Application/Problem+JSON", true),
            ("text/plain; charset=utf-8", false),
            ("text/event-stream", false),
        ] {
            assert_eq!(is_json(Some(&HeaderValue::from_static(ct))), json, "{ct}");
        }
        assert!(!is_json(None));
    }

    #[tokio::test]
    async fn plain_errors_become_the_envelope_and_keep_headers() {
        let plain = (
            StatusCode::PAYLOAD_TOO_LARGE,
            [("x-kept", "1")],
            "length limit exceeded",
        )
            .into_response();
        let r = to_envelope(plain, &axum::http::Method::POST, "/generate").await;
        assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(r.headers()["x-kept"], "1");
        assert!(is_json(r.headers().get(header::CONTENT_TYPE)));
        let b = axum::body::to_bytes(r.into_body(), 1 << 20)
            .await
            .unwrap_or_default();
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap_or_default();
        assert_eq!(v["type"], "PayloadTooLargeError");
        assert_eq!(v["message"], "length limit exceeded");

        let ok = (StatusCode::OK, "metrics text").into_response();
        let r = to_envelope(ok, &axum::http::Method::GET, "/metrics").await;
        assert_eq!(r.status(), StatusCode::OK);
    }
}
