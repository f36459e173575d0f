//! The chart page at `/` in a real browser: headless Chromium (Debian's `chromium`; required in
//! CI, which installs it) loads the page from a running daemon with known data, and the test
//! checks what the page drew (its `#drawn` data and `#rows` table, read from the DOM after the
//! page's scripts ran) against the ground truth, and keeps a screenshot as a test artifact.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::prom_api::{close, daemon_with_data};
use crate::support::{assert_quantile, truth};

/// The browser: `BUCKETD_CHROMIUM`, else the first of Debian's and other distributions' names
/// that runs.
fn chromium() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("BUCKETD_CHROMIUM") {
        return Some(path.into());
    }
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|name| {
            Command::new(name)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .map(PathBuf::from)
}

/// Runs headless Chromium on `url` with `extra` arguments, with a profile of its own; its stdout.
/// The virtual time budget lets the page's fetches and drawing finish before the DOM is taken.
fn headless(browser: &Path, profile: &Path, url: &str, extra: &[&str]) -> String {
    let out = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            "--virtual-time-budget=20000",
            "--window-size=1100,620",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(extra)
        .arg(url)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", browser.display()));
    assert!(
        out.status.success(),
        "{} failed: {}",
        browser.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The text of the element `<tag ... id="id" ...>` in `dom`.
fn element_text<'a>(dom: &'a str, tag: &str, id: &str) -> &'a str {
    let open = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no #{id} in\n{dom}"));
    let start = open + dom[open..].find('>').unwrap() + 1;
    let end = start + dom[start..].find(&format!("</{tag}>")).unwrap();
    &dom[start..end]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_page_draws_a_series_in_a_real_browser() {
    let Some(browser) = chromium() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "Chromium is required in CI (apt-get install chromium)"
        );
        eprintln!("Chromium not found: chart page test not run; CI installs it");
        return;
    };
    let (dir, d, day, work) = daemon_with_data(false).await;
    let truth = truth(&work.readings, 3600);
    let url = format!("http://{}/?series=day/t&range=7d&filter=DA", d.http_addr);
    let profile = dir.path().join("chromium");
    let browser_run = {
        let (browser, profile, url) = (browser.clone(), profile.clone(), url.clone());
        tokio::task::spawn_blocking(move || headless(&browser, &profile, &url, &["--dump-dom"]))
    };
    let dom = browser_run.await.unwrap();

    // The filter (case-insensitive) left day's two series; the chosen one is marked.
    let list = element_text(&dom, "ul", "series");
    assert_eq!(list.matches("<li>").count(), 2, "{list}");
    assert!(list.contains(">day/h</a>") && list.contains("aria-current=\"true\">day/t</a>"));
    // uPlot drew on a canvas.
    let chart = &dom[dom.find("id=\"chart\"").unwrap()..dom.find("id=\"legend-note\"").unwrap()];
    assert!(chart.contains("<canvas"), "no canvas: {chart}");

    // What was drawn: every hour of the day, equal to the truth.
    let drawn: Value = serde_json::from_str(element_text(&dom, "script", "drawn")).unwrap();
    assert_eq!(drawn["series"], "day/t");
    assert_eq!(drawn["range"], "7d");
    let column = |k: &str| drawn[k].as_array().unwrap().clone();
    let (x, mean, min, max, p99) = (
        column("x"),
        column("mean"),
        column("min"),
        column("max"),
        column("p99"),
    );
    let drawn_hours: Vec<i64> = x.iter().map(|t| t.as_i64().unwrap()).collect();
    let want_hours: Vec<i64> = (0..24).map(|h| day + h * 3600).collect();
    assert_eq!(drawn_hours, want_hours);
    for (i, hour) in want_hours.iter().enumerate() {
        let t = &truth[&("day/t".to_owned(), Some(*hour))];
        assert!(close(mean[i].as_f64().unwrap(), t.mean), "mean @{hour}");
        assert_eq!(min[i].as_f64().unwrap(), t.min, "min @{hour}");
        assert_eq!(max[i].as_f64().unwrap(), t.max, "max @{hour}");
        let p = p99[i].as_f64().unwrap();
        assert_quantile(p, t, 0.99, &format!("p99 @{hour}"));
    }
    // The data table has a row per drawn hour.
    let rows = element_text(&dom, "tbody", "rows");
    assert_eq!(rows.matches("<tr>").count(), 24, "{rows}");

    // A screenshot, kept as the test's artifact.
    let artifacts = Path::new(env!("CARGO_TARGET_TMPDIR")).join("artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    let png = artifacts.join("chart-page.png");
    let _ = std::fs::remove_file(&png);
    let shot = format!("--screenshot={}", png.display());
    tokio::task::spawn_blocking(move || headless(&browser, &profile, &url, &[&shot]))
        .await
        .unwrap();
    let bytes = std::fs::read(&png).unwrap();
    assert!(
        bytes.starts_with(b"\x89PNG") && bytes.len() > 10_000,
        "{}",
        png.display()
    );
    eprintln!("chart page screenshot: {}", png.display());
    d.stop().await.unwrap();
}
