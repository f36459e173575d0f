//! `bucketd query`: a small client of the running daemon's HTTP API, and the table/CSV/JSON
//! formatting of its answers. The formatting is pure; [`Client`] does the requests.

use std::time::Duration;

use serde_json::Value;

use crate::export::csv_text;

/// How the answer is printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum QueryFormat {
    Table,
    Json,
    Csv,
}

/// Why a query failed; the message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    #[error("cannot reach bucketd at {url}: {message}; is it running, and is --url its http.bind?")]
    Unreachable { url: String, message: String },
    #[error("{0}")]
    Api(String),
    #[error("unexpected answer from {url}: {message}")]
    Protocol { url: String, message: String },
}

/// How long a query may take, connection included.
const QUERY_TIMEOUT: Duration = Duration::from_mins(1);

pub struct Client {
    base: String,
    token: Option<crate::secret::Secret>,
}

impl Client {
    /// A client of the API at `base` (`http://host:port`), sending `token` as
    /// `Authorization: Bearer` when given (the daemon's `http.token_file`).
    pub fn new(base: &str, token: Option<crate::secret::Secret>) -> Client {
        Client {
            base: base.trim_end_matches('/').to_owned(),
            token,
        }
    }

    /// GETs `path` with `params` (skipping absent ones) and returns the JSON answer.
    pub fn get(&self, path: &str, params: &[(&str, Option<&str>)]) -> Result<Value, QueryError> {
        let mut query = form_urlencoded::Serializer::new(String::new());
        for (k, v) in params {
            if let Some(v) = v {
                query.append_pair(k, v);
            }
        }
        let query = query.finish();
        let url = if query.is_empty() {
            format!("{}{path}", self.base)
        } else {
            format!("{}{path}?{query}", self.base)
        };
        let unreachable = |message: String| QueryError::Unreachable {
            url: url.clone(),
            message,
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| unreachable(format!("no runtime for the request: {e}")))?;
        let (status, body) = runtime
            .block_on(async {
                tokio::time::timeout(QUERY_TIMEOUT, request(&url, self.token.as_ref())).await
            })
            .map_err(|_| unreachable(format!("no answer within {QUERY_TIMEOUT:?}")))?
            .map_err(unreachable)?;
        let value: Value = serde_json::from_slice(&body).map_err(|e| QueryError::Protocol {
            url: url.clone(),
            message: format!("status {status}, not JSON ({e})"),
        })?;
        if status.is_success() {
            Ok(value)
        } else {
            let message = value["error"].as_str().unwrap_or("unknown error");
            let hint = if status.as_u16() == 401 {
                "; pass the daemon's http.token_file with --token-file"
            } else {
                ""
            };
            Err(QueryError::Api(format!(
                "{message} (HTTP {}){hint}",
                status.as_u16()
            )))
        }
    }
}

/// One HTTP/1.1 GET of `url` (`http://` only: the daemon serves no TLS), its status and body.
async fn request(
    url: &str,
    token: Option<&crate::secret::Secret>,
) -> Result<(hyper::StatusCode, bytes::Bytes), String> {
    use http_body_util::BodyExt;
    let uri: hyper::Uri = url.parse().map_err(|e| format!("not a URL: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err("only http:// URLs are served (bucketd's API has no TLS)".into());
    }
    let authority = uri.authority().ok_or("the URL names no host")?.clone();
    let port = authority.port_u16().unwrap_or(80);
    let stream = tokio::net::TcpStream::connect((authority.host(), port))
        .await
        .map_err(|e| e.to_string())?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
    // Drives the connection until the answer is read (dropped with the runtime).
    tokio::spawn(connection);
    let mut request = hyper::Request::get(uri.path_and_query().map_or("/", |p| p.as_str()))
        .header(hyper::header::HOST, authority.as_str());
    if let Some(token) = token {
        request = request.header(
            hyper::header::AUTHORIZATION,
            format!("Bearer {}", token.expose()),
        );
    }
    let request = request
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .map_err(|e| e.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("the answer broke off: {e}"))?
        .to_bytes();
    Ok((status, body))
}

/// A table: headers and rows of cells, printed aligned, as CSV, or left as the JSON answer.
pub struct Table {
    pub headers: Vec<&'static str>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    /// Columns padded to their widest cell; numbers right-aligned.
    pub fn aligned(&self) -> String {
        let widths: Vec<usize> = (0..self.headers.len())
            .map(|i| {
                self.rows
                    .iter()
                    .map(|r| r[i].chars().count())
                    .chain([self.headers[i].len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let numeric: Vec<bool> = (0..self.headers.len())
            .map(|i| !self.rows.is_empty() && self.rows.iter().all(|r| r[i].parse::<f64>().is_ok()))
            .collect();
        let line = |cells: Vec<&str>| {
            let padded: Vec<String> = cells
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    if numeric[i] {
                        format!("{c:>w$}", w = widths[i])
                    } else {
                        format!("{c:<w$}", w = widths[i])
                    }
                })
                .collect();
            padded.join("  ").trim_end().to_owned() + "\n"
        };
        let mut out = line(self.headers.clone());
        for row in &self.rows {
            out.push_str(&line(row.iter().map(String::as_str).collect()));
        }
        out
    }

    pub fn csv(&self) -> String {
        let mut out = self.headers.join(",") + "\n";
        for row in &self.rows {
            let cells: Vec<String> = row.iter().map(|c| csv_text(c)).collect();
            out.push_str(&(cells.join(",") + "\n"));
        }
        out
    }
}

/// A JSON value as a cell: numbers in shortest round-trip form, strings bare, null empty.
fn cell(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The table of a `/api/v1/series` answer.
pub fn series_table(answer: &Value) -> Table {
    let rows = answer["series"]
        .as_array()
        .map(|list| {
            list.iter()
                .map(|s| vec![cell(&s["name"]), cell(&s["sensor"]), cell(&s["metric"])])
                .collect()
        })
        .unwrap_or_default();
    Table {
        headers: vec!["series", "sensor", "metric"],
        rows,
    }
}

/// The table of a `/api/v1/buckets` answer.
pub fn buckets_table(answer: &Value) -> Table {
    let rows = answer["buckets"]
        .as_array()
        .map(|list| {
            list.iter()
                .map(|b| {
                    vec![
                        cell(&b["start"]),
                        cell(&b["count"]),
                        cell(&b["mean"]),
                        cell(&b["min"]),
                        cell(&b["max"]),
                        cell(&b["stddev"]),
                        cell(&b["p50"]),
                        cell(&b["p90"]),
                        cell(&b["p99"]),
                        cell(&b["sum"]),
                        cell(&b["first"]["value"]),
                        cell(&b["last"]["value"]),
                    ]
                })
                .collect()
        })
        .unwrap_or_default();
    Table {
        headers: vec![
            "start", "count", "mean", "min", "max", "stddev", "p50", "p90", "p99", "sum", "first",
            "last",
        ],
        rows,
    }
}

/// The table of a `/api/v1/raw` answer.
pub fn raw_table(answer: &Value) -> Table {
    let rows = answer["readings"]
        .as_array()
        .map(|list| {
            list.iter()
                .map(|r| vec![cell(&r["ts"]), cell(&r["value"])])
                .collect()
        })
        .unwrap_or_default();
    Table {
        headers: vec!["ts", "value"],
        rows,
    }
}

/// Renders `answer` in `format` using `table` for the table and CSV forms.
pub fn render(answer: &Value, format: QueryFormat, table: fn(&Value) -> Table) -> String {
    match format {
        QueryFormat::Json => {
            serde_json::to_string_pretty(answer).expect("a JSON value serializes") + "\n"
        }
        QueryFormat::Table => table(answer).aligned(),
        QueryFormat::Csv => table(answer).csv(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn tables_align_text_left_and_numbers_right() {
        let answer = json!({"series": "a/b", "step": "1h", "buckets": [
            {"start": "2026-11-21T10:00:00.000Z", "count": 3, "mean": 21.5, "min": 1, "max": 100.25,
             "stddev": 0.5, "p50": 2, "p90": 99, "p99": 100, "sum": 64.5, "first": {"value": 1}, "last": {"value": 100.25}},
            {"start": "2026-11-21T11:00:00.000Z", "count": 12, "mean": -2, "min": -3, "max": 0,
             "stddev": 1, "p50": null, "p90": null, "p99": null, "sum": -24, "first": {"value": 0}, "last": {"value": -3}},
        ]});
        let text = render(&answer, QueryFormat::Table, buckets_table);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(
            lines[0].starts_with("start                     count"),
            "{text}"
        );
        assert!(
            lines[1].starts_with("2026-11-21T10:00:00.000Z      3  21.5    1"),
            "{text}"
        );
        assert!(
            lines[2].starts_with("2026-11-21T11:00:00.000Z     12    -2   -3"),
            "{text}"
        );
        let csv = render(&answer, QueryFormat::Csv, buckets_table);
        assert_eq!(
            csv.lines().nth(1).unwrap(),
            "2026-11-21T10:00:00.000Z,3,21.5,1,100.25,0.5,2,99,100,64.5,1,100.25"
        );
        assert_eq!(
            csv.lines().nth(2).unwrap(),
            "2026-11-21T11:00:00.000Z,12,-2,-3,0,1,,,,-24,0,-3",
            "unknown quantiles are empty cells"
        );
    }

    #[test]
    fn csv_quotes_cells_with_commas() {
        let answer = json!({"series": [{"name": "a,b/t", "sensor": "a,b", "metric": "t"}]});
        assert_eq!(
            render(&answer, QueryFormat::Csv, series_table),
            "series,sensor,metric\n\"a,b/t\",\"a,b\",t\n"
        );
    }
}
