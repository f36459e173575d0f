//! TLS to PostgreSQL: libpq's `sslmode` over rustls (tokio-postgres speaks the protocol and
//! leaves the TLS to its caller). `prefer` and `require` encrypt without checking the
//! certificate, as libpq does (unless `sslrootcert` names a CA: then `require` checks the chain);
//! `verify-ca` checks the chain, `verify-full` the chain and the host name.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};

use crate::config::{PgTls, SslMode};

/// The connector for `tls`'s mode; `key` names the setting in errors.
pub fn connector(tls: &PgTls, key: &str) -> Result<MakeRustls, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let checked = |any_name: bool| -> Result<Arc<dyn ServerCertVerifier>, String> {
        let roots = crate::tls::roots(&format!("{key} sslrootcert"), tls.root_cert.as_deref())?;
        let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .map_err(|e| format!("{key}: the CAs of sslrootcert cannot be used: {e}"))?;
        Ok(if any_name {
            Arc::new(AnyName(webpki))
        } else {
            webpki
        })
    };
    let verifier: Arc<dyn ServerCertVerifier> = match (tls.mode, &tls.root_cert) {
        (SslMode::Disable | SslMode::Prefer, _) | (SslMode::Require, None) => {
            Arc::new(Unchecked(provider.clone()))
        }
        (SslMode::Require | SslMode::VerifyCa, _) => checked(true)?,
        (SslMode::VerifyFull, _) => checked(false)?,
    };
    let config = crate::tls::builder()
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok(MakeRustls(Arc::new(config)))
}

/// Encryption without authentication (libpq's `prefer` and `require`): any certificate, and
/// nothing checked against it, as libpq.
#[derive(Debug)]
struct Unchecked(Arc<CryptoProvider>);

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    // The handshake's signature is not checked either. It proves only that the server holds
    // the key of the certificate it sent, and any certificate is taken here: whoever could
    // send their own certificate could sign with its key. Checking it refused servers libpq
    // talks to in these modes: Citus's own certificate (`citus.enable_ssl`, on by default) is
    // an X.509 version 1 certificate, which webpki will not parse (issue 57: no gateway could
    // reach a Citus coordinator with the default sslmode, prefer).
    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }

    fn verify_tls13_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain must lead to a trusted CA; the name is not checked (webpki checks the
/// name last, so a name error means the chain was good).
#[derive(Debug)]
struct AnyName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// tokio-postgres's TLS hook, over rustls.
#[derive(Clone)]
pub struct MakeRustls(Arc<rustls::ClientConfig>);

impl<S> MakeTlsConnect<S> for MakeRustls
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsConnect;
    type Error = io::Error;

    /// `domain` is a Unix socket's directory for a socket host: no name, and a server never
    /// offers TLS there (with `prefer` the connection goes on in plain).
    fn make_tls_connect(&mut self, domain: &str) -> io::Result<RustlsConnect> {
        Ok(RustlsConnect {
            name: ServerName::try_from(domain.to_owned()).ok(),
            connector: tokio_rustls::TlsConnector::from(self.0.clone()),
        })
    }
}

pub struct RustlsConnect {
    name: Option<ServerName<'static>>,
    connector: tokio_rustls::TlsConnector,
}

impl<S> TlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream<S>>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            let name = self.name.ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "TLS needs a host name or address, not a Unix socket",
                )
            })?;
            let tls = self.connector.connect(name, stream).await?;
            Ok(RustlsStream(tls))
        })
    }
}

pub struct RustlsStream<S>(tokio_rustls::client::TlsStream<S>);

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> TlsStream for RustlsStream<S> {
    /// No channel binding: SCRAM then authenticates without it (`channel_binding=prefer`).
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}
