//! TLS to a broker: builds the rustls client configuration from `[mqtt.tls]` or
//! `[upstream.mqtt_tls]` (CA file or the system's roots, optional client certificate and key). rustls with the `ring` provider, passed
//! explicitly rather than installed process-wide. Errors name the config key and the file.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::config::{TlsFiles, TlsKeys};

/// The client configuration for `files` (from the table `keys` names, for the errors);
/// `credentials` is `$CREDENTIALS_DIRECTORY` (for a relative `key_file`).
pub fn client_config(
    files: &TlsFiles,
    keys: TlsKeys,
    credentials: Option<&Path>,
) -> Result<Arc<rustls::ClientConfig>, String> {
    let t = keys.table;
    let roots = roots(&format!("{t}.ca_file"), files.ca_file.as_deref())?;
    let builder = builder().with_root_certificates(roots);
    let config = match &files.client {
        None => builder.with_no_client_auth(),
        Some((cert_file, key_file)) => {
            let chain = certificates(&format!("{t}.cert_file"), cert_file)?;
            let key = private_key(&format!("{t}.key_file"), key_file, credentials)?;
            builder.with_client_auth_cert(chain, key).map_err(|e| {
                format!(
                    "{t}.cert_file {} and {t}.key_file {}: {e}",
                    cert_file.display(),
                    key_file.display()
                )
            })?
        }
    };
    Ok(Arc::new(config))
}

/// The CAs to trust: those of `ca_file` (config key `key`), else the system's.
pub fn roots(key: &str, ca_file: Option<&Path>) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    if let Some(ca) = ca_file {
        for cert in certificates(key, ca)? {
            roots
                .add(cert)
                .map_err(|e| format!("{key} {}: not a usable CA certificate: {e}", ca.display()))?;
        }
    } else {
        let found = rustls_native_certs::load_native_certs();
        let (added, _) = roots.add_parsable_certificates(found.certs);
        if added == 0 {
            return Err(format!(
                "{key} is empty and no system CA certificates were found ({} errors); install \
                 ca-certificates or set {key}",
                found.errors.len()
            ));
        }
    }
    Ok(roots)
}

/// A client configuration builder with the `ring` provider and rustls's safe protocol versions.
pub fn builder() -> rustls::ConfigBuilder<rustls::ClientConfig, rustls::WantsVerifier> {
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
}

/// Every certificate in a PEM file; none at all is an error.
fn certificates(key: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let bytes =
        std::fs::read(path).map_err(|e| format!("cannot read {key} {}: {e}", path.display()))?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{key} {}: not a PEM certificate file: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{key} {}: no certificate in it (expected PEM \"-----BEGIN CERTIFICATE-----\")",
            path.display()
        ));
    }
    Ok(certs)
}

/// The client key: a secret like the others ([`crate::secret::read`]: relative paths in the
/// credentials directory, errors that never quote the file).
fn private_key(
    key: &str,
    file: &Path,
    credentials: Option<&Path>,
) -> Result<PrivateKeyDer<'static>, String> {
    let pem = crate::secret::read(key, file, credentials)?;
    PrivateKeyDer::from_pem_slice(pem.expose().as_bytes()).map_err(|_| {
        format!(
            "{key} {}: no PEM private key in it (PKCS#8, PKCS#1 or SEC1)",
            crate::secret::resolve(file, credentials).display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    struct Pki {
        dir: tempfile::TempDir,
    }

    impl Pki {
        fn new() -> Pki {
            let dir = tempfile::tempdir().unwrap();
            let ca_key = rcgen::KeyPair::generate().unwrap();
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            let ca = params.self_signed(&ca_key).unwrap();
            let issuer = rcgen::Issuer::new(params, ca_key);
            let client_key = rcgen::KeyPair::generate().unwrap();
            let client = rcgen::CertificateParams::new(vec!["client".to_owned()])
                .unwrap()
                .signed_by(&client_key, &issuer)
                .unwrap();
            std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
            std::fs::write(dir.path().join("client.pem"), client.pem()).unwrap();
            std::fs::write(dir.path().join("client.key"), client_key.serialize_pem()).unwrap();
            std::fs::write(dir.path().join("garbage"), "not pem at all").unwrap();
            Pki { dir }
        }

        fn path(&self, name: &str) -> PathBuf {
            self.dir.path().join(name)
        }
    }

    #[test]
    fn builds_with_a_ca_file_and_a_client_certificate() {
        let pki = Pki::new();
        let files = TlsFiles {
            ca_file: Some(pki.path("ca.pem")),
            client: Some((pki.path("client.pem"), "client.key".into())),
        };
        // The relative key file is found in the credentials directory.
        let config = client_config(&files, crate::config::MQTT_TLS, Some(pki.dir.path())).unwrap();
        assert!(config.client_auth_cert_resolver.has_certs());
    }

    #[test]
    fn bad_files_are_named_with_their_key() {
        let pki = Pki::new();
        let cases = [
            (
                TlsFiles {
                    ca_file: Some(pki.path("garbage")),
                    client: None,
                },
                "mqtt.tls.ca_file",
            ),
            (
                TlsFiles {
                    ca_file: Some(pki.path("nope.pem")),
                    client: None,
                },
                "mqtt.tls.ca_file",
            ),
            (
                TlsFiles {
                    ca_file: Some(pki.path("ca.pem")),
                    client: Some((pki.path("client.pem"), pki.path("garbage"))),
                },
                "mqtt.tls.key_file",
            ),
            (
                TlsFiles {
                    ca_file: Some(pki.path("ca.pem")),
                    client: Some((pki.path("garbage"), pki.path("client.key"))),
                },
                "mqtt.tls.cert_file",
            ),
        ];
        for (files, key) in cases {
            let e = client_config(&files, crate::config::MQTT_TLS, None).unwrap_err();
            assert!(e.contains(key), "{e}");
            let e = client_config(&files, crate::config::UPSTREAM_TLS, None).unwrap_err();
            let key = key.replace("mqtt.tls", "upstream.mqtt_tls");
            assert!(e.contains(&key), "{e}");
        }
    }
}
