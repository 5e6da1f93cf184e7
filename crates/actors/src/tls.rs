//! Optional TLS (rustls) for the gRPC control plane.
//!
//! The token keeps strangers from driving a host, but travels in the clear without TLS; on a
//! shared network both the token and every payload (weights, prompts) can be read or altered.
//! With TLS, servers present a certificate and clients verify it against a CA file they trust,
//! so a client never sends its token to a server it cannot authenticate.
//!
//! Files are read and parsed up front: a missing or malformed file is an error naming the file,
//! not a handshake failure later.

use std::path::{Path, PathBuf};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::{Deserialize, Serialize};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// Environment variable naming the server certificate (PEM chain) file.
pub const CERT_ENV: &str = "TROUPE_TLS_CERT";
/// Environment variable naming the server private key (PEM) file.
pub const KEY_ENV: &str = "TROUPE_TLS_KEY";
/// Environment variable naming the CA (PEM) file clients verify servers against.
pub const CA_ENV: &str = "TROUPE_TLS_CA";

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read TLS {what} file {path}: {source}")]
    Read {
        /// Which file (certificate, key, CA).
        what: &'static str,
        /// Its path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A file does not hold what it should.
    #[error("TLS {what} file {path} {problem}")]
    Malformed {
        /// Which file.
        what: &'static str,
        /// Its path.
        path: String,
        /// What is wrong, e.g. "holds no PEM certificate".
        problem: String,
    },
    /// Settings that do not go together (a certificate without its key, ...).
    #[error("{0}")]
    Incomplete(String),
    /// The address cannot be made into a TLS endpoint.
    #[error("gRPC endpoint {addr}: {message}")]
    Endpoint {
        /// The address.
        addr: String,
        /// Why.
        message: String,
    },
}

/// Where the TLS files are: a server's certificate and key, and the CA clients trust.
///
/// One value serves both ends (the config key `tls: {cert, key, ca}`): a controller uses `ca` to
/// verify hosts and hands `cert` / `key` to hosts it starts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// Server certificate chain (PEM), leaf first.
    #[serde(default)]
    pub cert: Option<PathBuf>,
    /// Server private key (PEM: PKCS#8, PKCS#1 or SEC1).
    #[serde(default)]
    pub key: Option<PathBuf>,
    /// CA certificate(s) (PEM) that clients verify servers against.
    #[serde(default)]
    pub ca: Option<PathBuf>,
}

fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.display().to_string(),
        source,
    })
}

fn malformed(what: &'static str, path: &Path, problem: impl Into<String>) -> TlsError {
    TlsError::Malformed {
        what,
        path: path.display().to_string(),
        problem: problem.into(),
    }
}

/// Reads a PEM file holding at least one certificate.
fn read_certs(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    let pem = read(what, path)?;
    let mut n = 0;
    for c in CertificateDer::pem_slice_iter(&pem) {
        c.map_err(|e| malformed(what, path, format!("is not valid PEM: {e}")))?;
        n += 1;
    }
    if n == 0 {
        return Err(malformed(
            what,
            path,
            "holds no PEM certificate (expected a -----BEGIN CERTIFICATE----- block)",
        ));
    }
    Ok(pem)
}

impl TlsFiles {
    /// The files named by `TROUPE_TLS_CERT`, `TROUPE_TLS_KEY` and `TROUPE_TLS_CA`.
    pub fn from_env() -> Self {
        TlsFiles {
            cert: env_path(CERT_ENV),
            key: env_path(KEY_ENV),
            ca: env_path(CA_ENV),
        }
    }

    /// No file is named: TLS is off.
    pub fn is_empty(&self) -> bool {
        self.cert.is_none() && self.key.is_none() && self.ca.is_none()
    }

    /// The server identity, if a certificate and key are named (one without the other is an
    /// error).
    pub fn server(&self) -> Result<Option<ServerTls>, TlsError> {
        match (&self.cert, &self.key) {
            (None, None) => Ok(None),
            (Some(c), Some(k)) => ServerTls::load(c, k).map(Some),
            (Some(_), None) => Err(TlsError::Incomplete(
                "a TLS certificate was given without its key: set both cert and key (--tls-cert and --tls-key, or TROUPE_TLS_CERT and TROUPE_TLS_KEY)".into(),
            )),
            (None, Some(_)) => Err(TlsError::Incomplete(
                "a TLS key was given without its certificate: set both cert and key (--tls-cert and --tls-key, or TROUPE_TLS_CERT and TROUPE_TLS_KEY)".into(),
            )),
        }
    }

    /// The client side, if a CA is named. A server identity without a CA is an error: the
    /// client could not verify the servers it connects to.
    pub fn client(&self) -> Result<Option<ClientTls>, TlsError> {
        match &self.ca {
            Some(ca) => ClientTls::load(ca).map(Some),
            None if self.cert.is_some() || self.key.is_some() => Err(TlsError::Incomplete(
                "TLS cert/key are set but no CA: clients verify servers against tls.ca (TROUPE_TLS_CA, --tls-ca); set it to the CA that signed the certificate".into(),
            )),
            None => Ok(None),
        }
    }
}

/// A server's certificate chain and private key, read and checked.
#[derive(Clone)]
pub struct ServerTls {
    cert: Vec<u8>,
    key: Vec<u8>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("ServerTls")
            .field("cert_bytes", &self.cert.len())
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Reads and checks a PEM certificate chain and its PEM private key.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let cert_pem = read_certs("certificate", cert)?;
        let key_pem = read("key", key)?;
        PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
            malformed(
                "key",
                key,
                format!("holds no usable PEM private key (PKCS#8, PKCS#1 or SEC1): {e}"),
            )
        })?;
        Ok(ServerTls {
            cert: cert_pem,
            key: key_pem,
        })
    }

    /// The tonic server setting.
    pub fn config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(Identity::from_pem(&self.cert, &self.key))
    }
}

/// What a client trusts: the CA certificate(s) servers must chain to.
#[derive(Debug, Clone)]
pub struct ClientTls {
    ca: Vec<u8>,
    domain: Option<String>,
}

impl ClientTls {
    /// Reads and checks a PEM CA file.
    pub fn load(ca: &Path) -> Result<Self, TlsError> {
        Ok(ClientTls {
            ca: read_certs("CA", ca)?,
            domain: None,
        })
    }

    /// Verifies servers as `name` instead of the host part of the address they are reached at
    /// (when certificates name a DNS name but hosts are dialed by IP).
    pub fn domain_name(mut self, name: impl Into<String>) -> Self {
        self.domain = Some(name.into());
        self
    }

    fn config(&self) -> ClientTlsConfig {
        let c = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&self.ca));
        match &self.domain {
            Some(d) => c.domain_name(d.clone()),
            None => c,
        }
    }
}

/// An endpoint for `addr` (`host:port`): `https://` verified against `tls`'s CA when given,
/// plain `http://` otherwise.
pub fn endpoint(addr: &str, tls: Option<&ClientTls>) -> Result<Endpoint, TlsError> {
    let bad = |message: String| TlsError::Endpoint {
        addr: addr.to_string(),
        message,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let ep = Endpoint::from_shared(format!("{scheme}://{addr}"))
        .map_err(|e| bad(format!("bad address: {e}")))?;
    match tls {
        None => Ok(ep),
        Some(t) => ep.tls_config(t.config()).map_err(|e| bad(e.to_string())),
    }
}
