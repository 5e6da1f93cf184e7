//! Which routes need which bearer key, checked from the request head before a byte of its body
//! is read.
//!
//! [`crate::envelope`] buffers every request body before a handler runs; a key checked in the
//! handler (or a route layer) came after the body was read, so an unauthenticated client could
//! make the gateway hold a weight push's 4 GiB before its 401. [`KeyedRoutes`] is handed to
//! [`crate::listen::serve`], and the envelope consults it first: a request on a keyed route
//! without its key is answered 401 at once and its connection closed (the body is never read).
//! It is the one check: the handlers behind it (`control_api`, `gateway/admin.rs`) do not
//! check again.

use std::sync::Arc;

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// Which paths a key covers.
#[derive(Debug, Clone, Copy)]
pub enum Paths {
    /// Exactly these paths.
    Exact(&'static [&'static str]),
    /// This path and everything below it (`/workers`, `/workers/…`).
    Tree(&'static str),
    /// Every path the function accepts.
    Where(fn(&str) -> bool),
}

impl Paths {
    fn matches(&self, path: &str) -> bool {
        match self {
            Paths::Exact(list) => list.contains(&path),
            Paths::Tree(root) => path
                .strip_prefix(root)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/')),
            Paths::Where(f) => f(path),
        }
    }
}

#[derive(Debug, Clone)]
struct Rule {
    paths: Paths,
    key: Arc<str>,
    /// What the routes are, for the 401's message ("a fleet control endpoint").
    what: &'static str,
    /// Answer in SGLang's control envelope (with `"success": false`).
    control: bool,
}

/// The keyed routes of one server (none: every route open).
#[derive(Debug, Clone, Default)]
pub struct KeyedRoutes {
    rules: Vec<Rule>,
}

impl KeyedRoutes {
    /// Every route open (a data proxy; a loopback server without keys).
    pub fn open() -> Self {
        Self::default()
    }

    /// Adds: `paths` need `key` (`None`: no rule, those paths stay open). The first rule that
    /// matches a path decides.
    pub fn with(self, paths: Paths, key: Option<&str>, what: &'static str) -> Self {
        self.rule(paths, key, what, false)
    }

    /// [`KeyedRoutes::with`] for SGLang's control endpoints, whose errors carry
    /// `"success": false`.
    pub fn with_control(self, paths: Paths, key: Option<&str>, what: &'static str) -> Self {
        self.rule(paths, key, what, true)
    }

    fn rule(mut self, paths: Paths, key: Option<&str>, what: &'static str, control: bool) -> Self {
        if let Some(k) = key {
            self.rules.push(Rule {
                paths,
                key: Arc::from(k),
                what,
                control,
            });
        }
        self
    }

    /// `Err(401)` for a request to `path` that lacks its key.
    fn check(&self, path: &str, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(rule) = self.rules.iter().find(|r| r.paths.matches(path)) else {
            return Ok(());
        };
        if troupe_wire::auth::has_key(headers, &rule.key) {
            return Ok(());
        }
        let e = ApiError::new(
            StatusCode::UNAUTHORIZED,
            format!(
                "{path} is {}: send Authorization: Bearer <admin key>",
                rule.what
            ),
        );
        Err(if rule.control { e.control() } else { e })
    }

    /// The 401 answer for a request to `path` that lacks its key, or `None` when it may
    /// proceed. The answer closes the connection: its body, if any, was never read.
    pub fn refusal(&self, path: &str, headers: &HeaderMap) -> Option<Response> {
        let e = self.check(path, headers).err()?;
        let mut r = e.into_response();
        r.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        Some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_auth(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(v).unwrap_or_else(|_| HeaderValue::from_static("")),
        );
        h
    }

    impl KeyedRoutes {
        fn allows(&self, path: &str, headers: &HeaderMap) -> bool {
            self.refusal(path, headers).is_none()
        }
    }

    #[test]
    fn rules_match_their_paths_only_and_need_the_exact_key() {
        let k = KeyedRoutes::open()
            .with(Paths::Tree("/workers"), Some("adm"), "worker management")
            .with(
                Paths::Exact(&["/pause"]),
                Some("ctl"),
                "a fleet control endpoint",
            )
            .with(Paths::Exact(&["/open"]), None, "never");
        let none = HeaderMap::new();
        assert!(k.allows("/generate", &none));
        assert!(k.allows("/open", &none));
        assert!(k.allows("/workersx", &none));
        for p in ["/workers", "/workers/1", "/workers/a/b"] {
            assert!(!k.allows(p, &none), "{p}");
            assert!(k.allows(p, &with_auth("Bearer adm")), "{p}");
            assert!(k.allows(p, &with_auth("bearer adm")), "{p}");
            assert!(!k.allows(p, &with_auth("Bearer ctl")), "{p}");
        }
        assert!(!k.allows("/pause", &with_auth("Bearer adm")));
        assert!(k.allows("/pause", &with_auth("Bearer ctl")));
        let r = k.refusal("/pause", &none).map(|r| r.status());
        assert_eq!(r, Some(StatusCode::UNAUTHORIZED));
    }
}
