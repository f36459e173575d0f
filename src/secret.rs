//! Secrets read from files: the MQTT password, the HTTP bearer tokens, the TLS client key.
//! A relative path is looked up in systemd's `$CREDENTIALS_DIRECTORY` when it is set
//! (`LoadCredential=`), so the unit can hand bucketd a secret the service user cannot otherwise
//! read. Contents never reach a log line, an error message or `check-config`: errors name the
//! config key and the file, and [`Secret`]'s `Debug` prints a placeholder.

use std::path::{Path, PathBuf};

/// A secret value. `Debug` does not show it; [`Secret::expose`] is the only way to read it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Compares with `candidate` in time that depends only on the lengths, not on where the
    /// first difference is (for bearer tokens).
    pub fn matches(&self, candidate: &[u8]) -> bool {
        let secret = self.0.as_bytes();
        if secret.len() != candidate.len() {
            return false;
        }
        secret
            .iter()
            .zip(candidate)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// `$CREDENTIALS_DIRECTORY`, if systemd set it.
pub fn credentials_directory() -> Option<PathBuf> {
    std::env::var_os("CREDENTIALS_DIRECTORY").map(PathBuf::from)
}

/// Where a secret file configured as `file` is: relative paths inside `credentials` when given.
pub fn resolve(file: &Path, credentials: Option<&Path>) -> PathBuf {
    match credentials {
        Some(dir) if file.is_relative() => dir.join(file),
        _ => file.to_owned(),
    }
}

/// Reads the secret for config key `key` from `file` (resolved with [`resolve`]). One trailing
/// line break is not part of it (`echo secret > file`); an empty secret is an error.
pub fn read(key: &str, file: &Path, credentials: Option<&Path>) -> Result<Secret, String> {
    let path = resolve(file, credentials);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        let hint = if file.is_relative() && credentials.is_none() {
            " (a relative path is looked up in $CREDENTIALS_DIRECTORY, which is not set: \
             use an absolute path or LoadCredential= in the unit)"
        } else {
            ""
        };
        format!("cannot read {key} {}: {e}{hint}", path.display())
    })?;
    let value = text
        .strip_suffix("\r\n")
        .or_else(|| text.strip_suffix('\n'))
        .unwrap_or(&text);
    if value.is_empty() {
        return Err(format!("{key} {} is empty", path.display()));
    }
    if let Some(mode) = open_to_others(&path) {
        tracing::warn!(
            key,
            path = %path.display(),
            mode = format!("{mode:o}"),
            "Other users on this machine can read or change this secret: chmod 600 it (or \
             hand it over with systemd's LoadCredential=)."
        );
    }
    Ok(Secret(value.to_owned()))
}

/// The file's permission bits when users other than its owner and group may read or write it.
pub fn open_to_others(path: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o777;
    (mode & 0o006 != 0).then_some(mode)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_files_are_looked_up_in_the_credentials_directory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("mqtt-password"), "hunter2\n").unwrap();
        let s = read(
            "mqtt.password_file",
            Path::new("mqtt-password"),
            Some(dir.path()),
        )
        .unwrap();
        assert_eq!(s.expose(), "hunter2");
        // Absolute paths are taken as they are.
        let abs = dir.path().join("mqtt-password");
        assert_eq!(resolve(&abs, Some(Path::new("/elsewhere"))), abs);
    }

    #[test]
    fn errors_name_the_key_and_file_but_never_the_value() {
        let dir = tempfile::tempdir().unwrap();
        let e = read("http.token_file", Path::new("missing"), None).unwrap_err();
        assert!(
            e.contains("http.token_file") && e.contains("missing"),
            "{e}"
        );
        assert!(e.contains("CREDENTIALS_DIRECTORY"), "{e}");
        std::fs::write(dir.path().join("empty"), "\n").unwrap();
        let e = read("http.token_file", &dir.path().join("empty"), None).unwrap_err();
        assert!(e.contains("is empty"), "{e}");

        std::fs::write(dir.path().join("t"), "s3cr3t-value\r\n").unwrap();
        let s = read("http.token_file", &dir.path().join("t"), None).unwrap();
        assert_eq!(s.expose(), "s3cr3t-value");
        assert!(!format!("{s:?}").contains("s3cr3t"));
    }

    #[test]
    fn a_secret_file_others_can_read_is_noticed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("token");
        std::fs::write(&f, "t\n").unwrap();
        for (mode, open) in [(0o644, true), (0o606, true), (0o640, false), (0o600, false)] {
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode)).unwrap();
            assert_eq!(open_to_others(&f), open.then_some(mode), "{mode:o}");
            // Still read: a warning, not a refusal.
            assert_eq!(read("http.token_file", &f, None).unwrap().expose(), "t");
        }
    }

    #[test]
    fn matching_needs_the_whole_token() {
        let s = Secret("abcdef".into());
        assert!(s.matches(b"abcdef"));
        for wrong in [&b"abcdeF"[..], b"abcde", b"abcdefg", b"", b"Abcdef"] {
            assert!(!s.matches(wrong), "{wrong:?}");
        }
    }
}
