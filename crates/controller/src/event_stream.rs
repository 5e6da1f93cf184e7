//! A host's event stream, the one type both sides of a host's events name: `conn.rs` opens it
//! (`HostConn::watch`) and `membership.rs` watches it. It lives here, below both, so that
//! neither module depends on the other for it.

/// A host's event stream, opened before the cluster is handed out so no event is missed.
pub(crate) type EventStream = std::pin::Pin<
    Box<dyn tokio_stream::Stream<Item = Result<troupe_wire::v1::HostEvent, String>> + Send>,
>;
