//! Mutual TLS for the gRPC connections of a job that spans machines: workers to the
//! coordinator's control service and workers to each other's link service.
//!
//! Every process of the job holds the same three PEM files: the job's certificate authority,
//! a certificate it signed and that certificate's key. A server presents the certificate and
//! accepts only clients that present one signed by the authority; a client checks the
//! server's certificate against the authority under one server name (`podsim` unless told
//! otherwise), the same for every process, so one certificate serves a whole cluster whatever
//! its hosts are called. The job token is still checked on top: the certificate says a
//! process may talk to the job, the token says which job it is. Unix-socket links between
//! workers on one host never leave the host and stay as they are.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::WorkerError;

/// The server name clients expect in every certificate of the job unless told otherwise.
pub const DEFAULT_SERVER_NAME: &str = "podsim";

/// Where a process finds its TLS material (`[launch.tls]`, `podsim worker --tls-*`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TlsFiles {
    /// The job's certificate authority (PEM).
    pub ca: PathBuf,
    /// This process's certificate, signed by `ca` (PEM).
    pub cert: PathBuf,
    /// The certificate's private key (PEM).
    pub key: PathBuf,
    /// The name every certificate carries (a subject alternative name).
    pub server_name: String,
}

/// Loaded TLS material, ready for servers and clients.
#[derive(Debug, Clone)]
pub struct Tls {
    files: TlsFiles,
    ca: Certificate,
    identity: Identity,
}

/// Which file of [`TlsFiles`] a problem is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsFile {
    Ca,
    Cert,
    Key,
}

impl TlsFile {
    pub fn key(self) -> &'static str {
        match self {
            TlsFile::Ca => "ca",
            TlsFile::Cert => "cert",
            TlsFile::Key => "key",
        }
    }
}

impl Tls {
    /// Reads the three files and checks that they make a server and a client configuration;
    /// each problem names the file it is about (every unreadable file at once).
    pub fn load(files: &TlsFiles) -> Result<Tls, Vec<(TlsFile, String)>> {
        let read = |which: TlsFile, path: &Path| {
            let bytes = std::fs::read(path)
                .map_err(|e| (which, format!("cannot read {}: {e}", path.display())))?;
            if !String::from_utf8_lossy(&bytes).contains("-----BEGIN ") {
                return Err((which, format!("{} is not a PEM file", path.display())));
            }
            Ok(bytes)
        };
        let (ca, cert, key) = match (
            read(TlsFile::Ca, &files.ca),
            read(TlsFile::Cert, &files.cert),
            read(TlsFile::Key, &files.key),
        ) {
            (Ok(ca), Ok(cert), Ok(key)) => (ca, cert, key),
            (ca, cert, key) => {
                return Err([ca.err(), cert.err(), key.err()]
                    .into_iter()
                    .flatten()
                    .collect());
            }
        };
        let tls = Tls {
            files: files.clone(),
            ca: Certificate::from_pem(ca),
            identity: Identity::from_pem(cert, key),
        };
        // The builders parse the PEM contents, so a bad authority, certificate or key shows
        // here, not at the first connection: the certificate and key on their own first, then
        // with the authority, so that each problem is named as its file's.
        let check = |config: ServerTlsConfig| {
            tonic::transport::Server::builder()
                .tls_config(config)
                .map(drop)
        };
        check(ServerTlsConfig::new().identity(tls.identity.clone())).map_err(|e| {
            let why = format!(
                "{} with {}: {}",
                files.cert.display(),
                files.key.display(),
                chain(&e)
            );
            vec![(TlsFile::Cert, why)]
        })?;
        check(tls.server()).map_err(|e| {
            vec![(
                TlsFile::Ca,
                format!("{}: {}", files.ca.display(), chain(&e)),
            )]
        })?;
        tonic::transport::Endpoint::from_static("https://podsim.invalid")
            .tls_config(tls.client())
            .map_err(|e| {
                vec![(
                    TlsFile::Ca,
                    format!("{}: {}", files.ca.display(), chain(&e)),
                )]
            })?;
        Ok(tls)
    }

    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// A server that presents this process's certificate and requires a client certificate
    /// signed by the job's authority.
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity.clone())
            .client_ca_root(self.ca.clone())
    }

    /// A client that trusts only the job's authority, expects the job's server name and
    /// presents this process's certificate.
    pub fn client(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(self.ca.clone())
            .domain_name(self.files.server_name.clone())
            .identity(self.identity.clone())
    }
}

/// `http://addr` or `https://addr`.
pub fn url(addr: &str, tls: Option<&Tls>) -> String {
    match tls {
        Some(_) => format!("https://{addr}"),
        None => format!("http://{addr}"),
    }
}

/// An error with its causes (a transport error's own text is only "transport error"; the
/// handshake's reason is in its sources).
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text = format!("{text}: {more}");
        }
        source = s.source();
    }
    text
}

/// A client endpoint for `url` with TLS when the job uses it.
pub fn secure(
    endpoint: tonic::transport::Endpoint,
    tls: Option<&Tls>,
) -> Result<tonic::transport::Endpoint, WorkerError> {
    match tls {
        Some(tls) => endpoint
            .tls_config(tls.client())
            .map_err(|e| WorkerError::Link(chain(&e))),
        None => Ok(endpoint),
    }
}
