//! libpq connection strings (key-value and URL forms), read by one parser: the password
//! hidden for logs and `bucketd config` ([`redact`]), the TLS options taken out for the
//! PostgreSQL client ([`pg_tls`]). Both see the same value boundaries, quoting included.

use std::path::PathBuf;

const SCHEMES: [&str; 2] = ["postgresql://", "postgres://"];
const HIDDEN: &str = "***";

/// A piece of a key-value connection string, in order.
#[derive(Debug, PartialEq, Eq)]
enum Part<'a> {
    /// Whitespace, or a word that is no `key = value` (libpq refuses it; kept as written).
    Text(&'a str),
    /// `key = value`: `raw` as written, `value` unquoted.
    Pair {
        key: &'a str,
        value: String,
        raw: &'a str,
    },
}

/// The key-value form's pieces: `key = value` pairs separated by whitespace; a value is a word,
/// or single-quoted with `\` escaping the next character.
fn parts(conninfo: &str) -> Vec<Part<'_>> {
    let mut out = Vec::new();
    let mut rest = conninfo;
    while !rest.is_empty() {
        let space = rest.len() - rest.trim_start().len();
        if space > 0 {
            out.push(Part::Text(&rest[..space]));
            rest = &rest[space..];
            continue;
        }
        let key_end = rest
            .find(|c: char| c == '=' || c.is_whitespace())
            .unwrap_or(rest.len());
        let key = &rest[..key_end];
        let Some(v) = rest[key_end..].trim_start().strip_prefix('=') else {
            // A word without `=`: kept, and the next word read as a pair again.
            out.push(Part::Text(key));
            rest = &rest[key_end..];
            continue;
        };
        let v = v.trim_start();
        let (value, end) = value_at(v);
        let len = rest.len() - v.len() + end;
        out.push(Part::Pair {
            key,
            value,
            raw: &rest[..len],
        });
        rest = &rest[len..];
    }
    out
}

/// The value at the start of `v` (unquoted) and where it ends in `v`.
fn value_at(v: &str) -> (String, usize) {
    let Some(quoted) = v.strip_prefix('\'') else {
        let end = v.find(char::is_whitespace).unwrap_or(v.len());
        return (v[..end].to_owned(), end);
    };
    let mut escaped = false;
    let mut text = String::new();
    for (i, c) in quoted.char_indices() {
        if c == '\'' && !escaped {
            return (text, i + 2);
        }
        escaped = c == '\\' && !escaped;
        if !escaped {
            text.push(c);
        }
    }
    // Unterminated: to the end.
    (text, v.len())
}

/// The URL form's scheme and the rest, if it is one.
fn url(conninfo: &str) -> Option<(&'static str, &str)> {
    SCHEMES
        .iter()
        .find_map(|scheme| conninfo.strip_prefix(scheme).map(|rest| (*scheme, rest)))
}

/// A URL's query parameters (`k=v`, split at `&`), each kept or replaced by `edit`.
fn edit_query(query: &str, mut edit: impl FnMut(&str, &str) -> Option<String>) -> Vec<String> {
    query
        .split('&')
        .filter_map(|kv| match kv.split_once('=') {
            Some((k, v)) => edit(k, v),
            None => Some(kv.to_owned()),
        })
        .collect()
}

/// A libpq connection string with its password replaced by `***`: in a URL
/// (`postgresql://user:secret@host/db`, `?password=secret`) or as `password=secret` /
/// `password='a secret'` in the key-value form.
pub fn redact(conninfo: &str) -> String {
    let Some((scheme, rest)) = url(conninfo) else {
        return parts(conninfo)
            .into_iter()
            .map(|p| match p {
                Part::Pair {
                    key: "password", ..
                } => format!("password={HIDDEN}"),
                Part::Pair { raw, .. } | Part::Text(raw) => raw.to_owned(),
            })
            .collect();
    };
    // The credentials run to an `@` even past a `/` or `?` (tokio-postgres reads them so: a
    // password may hold both), so they end at the last `@`; an `@` later in the query only
    // hides more than it must.
    let (userinfo, rest) = match rest.rsplit_once('@') {
        Some((userinfo, rest)) => (
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{user}:{HIDDEN}@"),
                None => format!("{userinfo}@"),
            },
            rest,
        ),
        None => (String::new(), rest),
    };
    let (host, tail) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query = edit_query(query, |k, v| {
                Some(if k.eq_ignore_ascii_case("password") {
                    format!("{k}={HIDDEN}")
                } else {
                    format!("{k}={v}")
                })
            });
            format!("{path}?{}", query.join("&"))
        }
        None => tail.to_owned(),
    };
    format!("{scheme}{userinfo}{host}{tail}")
}

/// Takes `key` out of a libpq connection string: its (last) value, and the string without it.
fn take(conninfo: &str, key: &str) -> (Option<String>, String) {
    let mut value = None;
    if url(conninfo).is_some() {
        let Some((head, query)) = conninfo.split_once('?') else {
            return (None, conninfo.to_owned());
        };
        let kept = edit_query(query, |k, v| {
            if k == key {
                value = Some(v.to_owned());
                None
            } else {
                Some(format!("{k}={v}"))
            }
        });
        let out = if kept.is_empty() {
            head.to_owned()
        } else {
            format!("{head}?{}", kept.join("&"))
        };
        return (value, out);
    }
    let mut out = String::with_capacity(conninfo.len());
    for p in parts(conninfo) {
        match p {
            Part::Pair {
                key: k, value: v, ..
            } if k == key => value = Some(v),
            Part::Pair { raw, .. } | Part::Text(raw) => out.push_str(raw),
        }
    }
    (value, out)
}

/// libpq's `sslmode`, as bucketd's PostgreSQL client honours it (`fleet::pg_tls`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// Plain TCP.
    Disable,
    /// TLS if the server offers it, else plain; the certificate is not checked (libpq's default).
    Prefer,
    /// TLS; the certificate is checked only when `sslrootcert` names the CA (as libpq does).
    Require,
    /// TLS with a certificate signed by `sslrootcert` (or a system CA); any host name.
    VerifyCa,
    /// TLS with a certificate signed by `sslrootcert` (or a system CA) for the host connected to.
    VerifyFull,
}

/// A connection string's TLS settings, taken out of it: tokio-postgres knows only `disable`,
/// `prefer` and `require`, and no `sslrootcert`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgTls {
    pub mode: SslMode,
    pub root_cert: Option<PathBuf>,
    /// The connection string for tokio-postgres: without `sslrootcert`, and with `sslmode`
    /// one it knows.
    pub conninfo: String,
}

/// The TLS settings of a libpq connection string (key-value or URL form); `Err` names a value
/// that is not one.
pub fn pg_tls(conninfo: &str) -> Result<PgTls, String> {
    let (mode, rest) = take(conninfo, "sslmode");
    let (root_cert, rest) = take(&rest, "sslrootcert");
    let mode = match mode.as_deref() {
        None | Some("prefer") => SslMode::Prefer,
        Some("disable") => SslMode::Disable,
        Some("require") => SslMode::Require,
        Some("verify-ca") => SslMode::VerifyCa,
        Some("verify-full") => SslMode::VerifyFull,
        Some(other) => {
            return Err(format!(
                "sslmode={other} is not one of disable, prefer, require, verify-ca, verify-full"
            ));
        }
    };
    let theirs = match mode {
        SslMode::Disable => "disable",
        SslMode::Prefer => "prefer",
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => "require",
    };
    let conninfo = match (url(&rest).is_some(), rest.contains('?')) {
        (true, true) => format!("{rest}&sslmode={theirs}"),
        (true, false) => format!("{rest}?sslmode={theirs}"),
        (false, _) => format!("{} sslmode={theirs}", rest.trim_end()),
    };
    Ok(PgTls {
        mode,
        root_cert: root_cert.filter(|p| !p.is_empty()).map(PathBuf::from),
        conninfo: conninfo.trim_start().to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_word_without_a_value_does_not_hide_the_password_after_it() {
        assert_eq!(
            redact("stray password='a b' host=db"),
            "stray password=*** host=db"
        );
        assert_eq!(
            take("stray sslmode=require", "sslmode").0.as_deref(),
            Some("require")
        );
    }

    #[test]
    fn quoted_values_end_where_both_readers_say() {
        let s = r"host=db password='x \' sslmode=disable' sslmode=verify-full";
        assert_eq!(redact(s), "host=db password=*** sslmode=verify-full");
        let tls = pg_tls(s).unwrap();
        assert_eq!(
            tls.mode,
            SslMode::VerifyFull,
            "the quoted text is the password's"
        );
        assert_eq!(
            tls.conninfo,
            r"host=db password='x \' sslmode=disable' sslmode=require"
        );
    }
}
