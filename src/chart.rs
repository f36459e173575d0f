//! The chart page at `/`: static files compiled into the binary (the page, its script and
//! style, and the vendored uPlot, `vendor/uplot/VENDORED.md`), so that it works offline. The
//! page reads the JSON API; it holds no data itself and needs no token to load.

use axum::Router;
use axum::extract::Path;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

const INDEX: &str = include_str!("chart/index.html");
const SCRIPT: &str = include_str!("chart/chart.js");
const STYLE: &str = include_str!("chart/chart.css");
const UPLOT_JS: &str = include_str!("../vendor/uplot/uPlot.iife.min.js");
const UPLOT_CSS: &str = include_str!("../vendor/uplot/uPlot.min.css");

/// Scripts and styles come from this server only; the page talks to this server only.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
                   connect-src 'self'; img-src 'self' data:; form-action 'none'; \
                   frame-ancestors 'none'; base-uri 'none'";

/// The page's routes, for any state (they use none).
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(
            "/",
            get(|| async { file("text/html; charset=utf-8", INDEX) }),
        )
        .route("/ui/{name}", get(asset))
}

async fn asset(Path(name): Path<String>) -> Response {
    let (content_type, body) = match name.as_str() {
        "chart.js" => ("text/javascript; charset=utf-8", SCRIPT),
        "chart.css" => ("text/css; charset=utf-8", STYLE),
        "uplot.iife.min.js" => ("text/javascript; charset=utf-8", UPLOT_JS),
        "uplot.min.css" => ("text/css; charset=utf-8", UPLOT_CSS),
        _ => return StatusCode::NOT_FOUND.into_response(),
    };
    file(content_type, body)
}

fn file(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            // Small, and a new binary may bring a new page: the browser asks each time.
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use sha2::Digest;

    /// The vendored files are the ones VENDORED.md names, byte for byte.
    #[test]
    fn the_vendored_chart_library_is_the_published_one() {
        let table = include_str!("../vendor/uplot/VENDORED.md");
        for (name, body) in [
            ("uPlot.iife.min.js", super::UPLOT_JS),
            ("uPlot.min.css", super::UPLOT_CSS),
        ] {
            let hash =
                sha2::Sha256::digest(body.as_bytes())
                    .iter()
                    .fold(String::new(), |mut hex, b| {
                        use std::fmt::Write;
                        let _ = write!(hex, "{b:02x}");
                        hex
                    });
            let row = table
                .lines()
                .find(|l| l.contains(&format!("`{name}`")))
                .unwrap_or_else(|| panic!("{name} is not in VENDORED.md"));
            assert!(
                row.contains(&hash),
                "{name}: sha256 {hash}, VENDORED.md says {row}"
            );
            assert!(
                row.contains(&format!("{} ", group_thousands(body.len()))),
                "{name}: {} bytes; {row}",
                body.len()
            );
        }
    }

    fn group_thousands(n: usize) -> String {
        let digits = n.to_string();
        let mut out = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i).is_multiple_of(3) {
                out.push(',');
            }
            out.push(c);
        }
        out
    }

    /// The page refers to the files this module serves, and nothing else.
    #[test]
    fn the_page_loads_only_what_the_server_serves() {
        for path in [
            "ui/uplot.min.css",
            "ui/chart.css",
            "ui/uplot.iife.min.js",
            "ui/chart.js",
        ] {
            assert!(super::INDEX.contains(&format!("\"{path}\"")), "{path}");
        }
        assert!(
            !super::INDEX.contains("://"),
            "no absolute URL (CDN) in the page"
        );
        assert!(
            !super::SCRIPT.contains("://"),
            "no absolute URL in the script"
        );
    }
}
