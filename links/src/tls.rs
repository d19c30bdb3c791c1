//! Mutual TLS for the connections of a job that spans machines: workers to the coordinator's
//! control service and to each other's link service (gRPC), and the record links between
//! workers over TCP.
//!
//! Every process of the job holds the same three PEM files: the job's certificate authority,
//! a certificate it signed and that certificate's key. A server presents the certificate and
//! accepts only clients that present one signed by the authority; a client checks the
//! server's certificate against the authority under one server name (`podsim` unless told
//! otherwise), the same for every process, so one certificate serves a whole cluster whatever
//! its hosts are called. The job token is still checked on top: the certificate says a
//! process may talk to the job, the token says which job it is. Unix-socket links between
//! workers on one host never leave the host and stay as they are.
//!
//! The record links between workers over TCP (`records`) use the same material through
//! rustls directly (`Tls::records`, the crate's own): the same
//! authority, certificate and server name, so one set of files serves both.
//!
//! A handshake that fails on a certificate fails the same way every time (both sides' files
//! decide it), so whoever dials reports it at once, naming the peer and rustls's reason
//! ([`handshake_failure`]), instead of dialling again until its patience runs out.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use serde::{Deserialize, Serialize};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::LinkError;

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
    records: RecordTls,
}

/// The rustls configurations of record links: the listening side, the dialling side, and the
/// name the dialler expects in the listener's certificate.
#[derive(Debug, Clone)]
pub(crate) struct RecordTls {
    pub(crate) server: Arc<rustls::ServerConfig>,
    pub(crate) client: Arc<rustls::ClientConfig>,
    pub(crate) server_name: ServerName<'static>,
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
    /// Reads the three files and checks that they make a server and a client configuration,
    /// the certificate one the authority signed for the server name; each problem names the
    /// file it is about (every unreadable file at once).
    pub fn load(files: &TlsFiles) -> Result<Tls, Vec<(TlsFile, String)>> {
        Tls::load_checking(files, true)
    }

    /// [`Tls::load`] without the check that the authority signed the certificate: the
    /// tests' foreign peers, which a handshake must refuse.
    #[cfg(test)]
    pub(crate) fn load_foreign(files: &TlsFiles) -> Result<Tls, Vec<(TlsFile, String)>> {
        Tls::load_checking(files, false)
    }

    fn load_checking(files: &TlsFiles, signed: bool) -> Result<Tls, Vec<(TlsFile, String)>> {
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
        let records = record_tls(&ca, &cert, &key, files, signed)?;
        let tls = Tls {
            files: files.clone(),
            ca: Certificate::from_pem(ca),
            identity: Identity::from_pem(cert, key),
            records,
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

    /// The rustls configurations of record links.
    pub(crate) fn records(&self) -> &RecordTls {
        &self.records
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

/// The record links' rustls configurations from the PEM contents of the three files: mutual
/// TLS on ring, TLS 1.2 or 1.3, the authority the only root of trust on both sides.
fn record_tls(
    ca: &[u8],
    cert: &[u8],
    key: &[u8],
    files: &TlsFiles,
    signed: bool,
) -> Result<RecordTls, Vec<(TlsFile, String)>> {
    let bad = |which: TlsFile, path: &Path, e: &dyn std::fmt::Display| {
        vec![(which, format!("{}: {e}", path.display()))]
    };
    let mut roots = rustls::RootCertStore::empty();
    for der in CertificateDer::pem_slice_iter(ca) {
        let der = der.map_err(|e| bad(TlsFile::Ca, &files.ca, &e))?;
        roots
            .add(der)
            .map_err(|e| bad(TlsFile::Ca, &files.ca, &e))?;
    }
    let roots = Arc::new(roots);
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<_, _>>()
        .map_err(|e| bad(TlsFile::Cert, &files.cert, &e))?;
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| bad(TlsFile::Key, &files.key, &e))?;
    // AES-128-GCM first (TLS 1.3's mandatory suite): every payload between hosts is
    // encrypted, and it costs about a third less than AES-256 for the same protection
    // against anyone on a cluster network.
    let mut provider = rustls::crypto::ring::default_provider();
    let aes128 = |s: &rustls::SupportedCipherSuite| {
        use rustls::CipherSuite as C;
        matches!(
            s.suite(),
            C::TLS13_AES_128_GCM_SHA256
                | C::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
                | C::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
        )
    };
    provider.cipher_suites.sort_by_key(|s| !aes128(s));
    let provider = Arc::new(provider);
    let server_name = ServerName::try_from(files.server_name.clone()).map_err(|e| {
        vec![(
            TlsFile::Cert,
            format!("server name {:?}: {e}", files.server_name),
        )]
    })?;
    if signed {
        signed_by_authority(&roots, &chain, &server_name, &provider, files)?;
    }
    let with_cert = |e: &dyn std::fmt::Display| {
        vec![(
            TlsFile::Cert,
            format!("{} with {}: {e}", files.cert.display(), files.key.display()),
        )]
    };
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        roots.clone(),
        provider.clone(),
    )
    .build()
    .map_err(|e| bad(TlsFile::Ca, &files.ca, &e))?;
    let server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| with_cert(&e))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(|e| with_cert(&e))?;
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| with_cert(&e))?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(|e| with_cert(&e))?;
    Ok(RecordTls {
        server: Arc::new(server),
        client: Arc::new(client),
        server_name,
    })
}

/// Refuses a certificate the job's authority did not sign for `server_name`: every peer would
/// refuse it at its handshake, and a coordinator with one started and waited out its join
/// timeout while each worker was refused.
fn signed_by_authority(
    roots: &Arc<rustls::RootCertStore>,
    chain: &[CertificateDer<'static>],
    server_name: &ServerName<'static>,
    provider: &Arc<rustls::crypto::CryptoProvider>,
    files: &TlsFiles,
) -> Result<(), Vec<(TlsFile, String)>> {
    use rustls::client::danger::ServerCertVerifier;
    let refused = |why: String| {
        vec![(
            TlsFile::Cert,
            format!(
                "{} is not a certificate of {} for {:?}: {why}",
                files.cert.display(),
                files.ca.display(),
                files.server_name
            ),
        )]
    };
    let Some((leaf, intermediates)) = chain.split_first() else {
        return Err(refused("it holds no certificate".into()));
    };
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
        roots.clone(),
        provider.clone(),
    )
    .build()
    .map_err(|e| refused(e.to_string()))?;
    verifier
        .verify_server_cert(
            leaf,
            intermediates,
            server_name,
            &[],
            rustls::pki_types::UnixTime::now(),
        )
        .map(drop)
        .map_err(|e| refused(e.to_string()))
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

/// rustls's reason when `e`, or an error it comes from, is a TLS handshake's verdict (a
/// certificate not signed by a trusted authority or naming another server, no certificate,
/// the other side's alert refusing ours) rather than the network's. Another attempt cannot
/// change such a verdict, so it is not one to retry. `None` for any other error.
pub fn handshake_failure(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut next = Some(e);
    while let Some(e) = next {
        if let Some(verdict) = rustls_error(e) {
            return Some(verdict.to_string());
        }
        next = e.source();
    }
    None
}

/// `e` as rustls's error, directly or inside an `io::Error` (whose `source` skips the error
/// it wraps: tokio-rustls reports handshakes that way).
fn rustls_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    if let Some(r) = e.downcast_ref::<rustls::Error>() {
        return Some(r);
    }
    e.downcast_ref::<std::io::Error>()
        .and_then(|io| io.get_ref())
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
}

impl Tls {
    /// What a handshake's verdict asks of the job's files, to follow its reason.
    pub fn mismatch_hint(&self) -> String {
        format!(
            "every process of the job needs a certificate signed by the authority in {} that \
             names {:?}",
            self.files.ca.display(),
            self.files.server_name
        )
    }
}

/// A client endpoint for `url` with TLS when the job uses it.
pub fn secure(
    endpoint: tonic::transport::Endpoint,
    tls: Option<&Tls>,
) -> Result<tonic::transport::Endpoint, LinkError> {
    match tls {
        Some(tls) => endpoint
            .tls_config(tls.client())
            .map_err(|e| LinkError::Link(chain(&e))),
        None => Ok(endpoint),
    }
}
