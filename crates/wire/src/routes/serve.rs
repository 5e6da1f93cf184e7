//! Serving an endpoint through its table entry: a handler is registered at the endpoint's path
//! for exactly its methods ([`ServeEndpoint::endpoint`]), and takes its request through
//! [`Req`], which answers bad input with the error envelope naming the field. The engine and
//! the gateway both register this way, so what they serve is what [`super::ROUTES`] says.

use axum::extract::{FromRequest, Request};
use axum::handler::Handler;
use axum::http::Method;
use axum::routing::{MethodFilter, MethodRouter};
use serde::de::DeserializeOwned;

use super::Endpoint;
use crate::ApiError;

/// The methods `E` takes on the gateway (`engine`: on the reference engine), as axum filters
/// them.
pub fn methods<E: Endpoint>(engine: bool) -> MethodFilter {
    let also: &[&str] = if engine { E::ROUTE.engine_also } else { &[] };
    E::ROUTE
        .methods
        .iter()
        .chain(also)
        .filter_map(|m| Method::from_bytes(m.as_bytes()).ok())
        .filter_map(|m| MethodFilter::try_from(m).ok())
        .reduce(MethodFilter::or)
        // The table's own test checks every route has a method; POST is the protocol's default.
        .unwrap_or(MethodFilter::POST)
}

/// `handler` for exactly `E`'s methods (`engine`: with the ones only the engine takes).
pub fn on<E: Endpoint, H, T, S>(engine: bool, handler: H) -> MethodRouter<S>
where
    H: Handler<T, S>,
    T: 'static,
    S: Clone + Send + Sync + 'static,
{
    axum::routing::on(methods::<E>(engine), handler)
}

/// Registering handlers by endpoint, on an axum router.
pub trait ServeEndpoint<S> {
    /// Serves `handler` at `E`'s path for `E`'s methods (the endpoint value only names the
    /// type: `router.endpoint(endpoints::Pause, pause)`).
    fn endpoint<E: Endpoint, H, T>(self, endpoint: E, handler: H) -> Self
    where
        H: Handler<T, S>,
        T: 'static;

    /// [`ServeEndpoint::endpoint`] on the reference engine: with the methods only the engine
    /// takes ([`super::Route::engine_also`]).
    fn engine_endpoint<E: Endpoint, H, T>(self, endpoint: E, handler: H) -> Self
    where
        H: Handler<T, S>,
        T: 'static;
}

impl<S: Clone + Send + Sync + 'static> ServeEndpoint<S> for axum::Router<S> {
    fn endpoint<E: Endpoint, H, T>(self, _: E, handler: H) -> Self
    where
        H: Handler<T, S>,
        T: 'static,
    {
        self.route(E::PATH, on::<E, H, T, S>(false, handler))
    }

    fn engine_endpoint<E: Endpoint, H, T>(self, _: E, handler: H) -> Self
    where
        H: Handler<T, S>,
        T: 'static,
    {
        self.route(E::PATH, on::<E, H, T, S>(true, handler))
    }
}

/// An endpoint's JSON request, parsed by [`super::body::parse`]: bad input is a 400 in the
/// error envelope naming the field, before the handler runs.
#[derive(Debug)]
pub struct Req<E: Endpoint>(pub E::Request);

impl<E, S> FromRequest<S> for Req<E>
where
    E: Endpoint,
    E::Request: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| ApiError::bad_request(format!("reading the body: {e}")).control())?;
        super::body::parse(&bytes).map(Req)
    }
}
