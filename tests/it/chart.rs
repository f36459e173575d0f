//! The chart page at `/` in a real browser: headless Chromium (Debian's `chromium`; required in
//! CI, which installs it) loads the page from a running daemon with known data, and the tests
//! check what the page drew (its `#drawn` data and `#rows` table, read from the DOM after the
//! page's scripts ran) against the ground truth, and keep screenshots as test artifacts. The
//! second test uses the page as a person does, through the `DevTools` protocol's input events:
//! ticks a second series, picks p50, drags across the chart to zoom, picks a range, switches to
//! local time (the browser in UTC+5:30), and sets a range of its own.

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

/// The browser, or `None` (with a note) where there is none; in CI (`CI` set) it is required.
fn chromium_or_skip() -> Option<PathBuf> {
    let found = chromium();
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "Chromium is required in CI (apt-get install chromium)"
        );
        eprintln!("Chromium not found: chart page test not run; CI installs it");
    }
    found
}

/// How every test runs Chromium: headless, in a container-friendly way, nothing on screen.
const HEADLESS: [&str; 6] = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--hide-scrollbars",
];

/// Runs headless Chromium on `url` with `extra` arguments, with a profile of its own; its stdout.
/// The virtual time budget lets the page's fetches and drawing finish before the DOM is taken.
fn headless(browser: &Path, profile: &Path, url: &str, extra: &[&str]) -> String {
    let out = Command::new(browser)
        .args(HEADLESS)
        .args(["--virtual-time-budget=20000", "--window-size=1100,620"])
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
    let Some(browser) = chromium_or_skip() else {
        return;
    };
    let (dir, d, day, work) = daemon_with_data(false).await;
    let truth = truth(&work.readings, 3600);
    let url = format!(
        "http://{}/?series=day/t&range=7d&filter=DA&tz=utc",
        d.http_addr
    );
    let profile = dir.path().join("chromium");
    let browser_run = {
        let (browser, profile, url) = (browser.clone(), profile.clone(), url.clone());
        tokio::task::spawn_blocking(move || headless(&browser, &profile, &url, &["--dump-dom"]))
    };
    let dom = browser_run.await.unwrap();

    // The filter (case-insensitive) left day's two series; the chosen one is marked.
    let list = element_text(&dom, "ul", "series");
    assert_eq!(list.matches("<li ").count(), 2, "{list}");
    assert!(
        list.contains("data-name=\"day/h\"")
            && list.contains("data-name=\"day/t\" aria-current=\"true\""),
        "{list}"
    );
    // uPlot drew on a canvas.
    let chart = &dom[dom.find("id=\"chart\"").unwrap()..dom.find("id=\"legend-note\"").unwrap()];
    assert!(chart.contains("<canvas"), "no canvas: {chart}");

    // What was drawn: every hour of the day, equal to the truth.
    let drawn: Value = serde_json::from_str(element_text(&dom, "script", "drawn")).unwrap();
    assert_eq!(drawn["series"], serde_json::json!(["day/t"]));
    assert_eq!(drawn["range"], "7d");
    let column = |k: &str| drawn["per"][0][k].as_array().unwrap().clone();
    let (x, mean, min, max, p99) = (
        drawn["x"].as_array().unwrap().clone(),
        column("mean"),
        column("min"),
        column("max"),
        column("q"),
    );
    assert_eq!(drawn["q"], "p99");
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

/// A page in headless Chromium, driven through the `DevTools` protocol.
struct Page {
    browser: std::process::Child,
    socket: tungstenite::WebSocket<tungstenite::stream::MaybeTlsStream<std::net::TcpStream>>,
    next_id: u64,
}

impl Page {
    /// Starts Chromium with the time zone `tz` and opens its first page's `DevTools` socket.
    fn open(browser: &Path, profile: &Path, tz: &str) -> Page {
        use std::io::BufRead;
        let mut child = Command::new(browser)
            .args(HEADLESS)
            .args(["--remote-debugging-port=0", "--window-size=1100,700"])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .env("TZ", tz)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
        let mut port = None;
        for line in stderr.lines() {
            let line = line.unwrap();
            if let Some(rest) = line.split("DevTools listening on ws://127.0.0.1:").nth(1) {
                port = rest.split('/').next().map(str::to_owned);
                break;
            }
        }
        let port = port.expect("Chromium said where DevTools listens");
        let text = ureq::get(format!("http://127.0.0.1:{port}/json/list"))
            .call()
            .unwrap()
            .into_body()
            .read_to_string()
            .unwrap();
        let list: Value = serde_json::from_str(&text).unwrap();
        let ws = list
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["type"] == "page")
            .and_then(|t| t["webSocketDebuggerUrl"].as_str())
            .unwrap()
            .to_owned();
        let (socket, _) = tungstenite::connect(ws).unwrap();
        Page {
            browser: child,
            socket,
            next_id: 0,
        }
    }

    /// Calls `method` and returns its result (events in between are skipped).
    fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut request = serde_json::json!({"id": id, "method": method});
        request["params"] = params;
        self.socket
            .send(tungstenite::Message::text(request.to_string()))
            .unwrap();
        loop {
            let message = self.socket.read().unwrap();
            let Ok(text) = message.to_text() else {
                continue;
            };
            let answer: Value = serde_json::from_str(text).unwrap();
            if answer["id"] == id {
                assert!(answer.get("error").is_none(), "{method}: {answer}");
                return answer["result"].clone();
            }
        }
    }

    /// The value of the JavaScript expression `js`.
    fn eval(&mut self, js: &str) -> Value {
        let result = self.call(
            "Runtime.evaluate",
            serde_json::json!({"expression": js, "returnByValue": true, "awaitPromise": true}),
        );
        assert!(result.get("exceptionDetails").is_none(), "{js}: {result}");
        result["result"]["value"].clone()
    }

    /// What the page drew once `done` holds of it (polled as the page's fetches finish).
    fn drawn_when(&mut self, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            // Until the navigation has made the page, there is no #drawn yet.
            let text = self.eval("(document.getElementById('drawn') || {}).textContent || 'null'");
            let drawn: Value = serde_json::from_str(text.as_str().unwrap_or("null")).unwrap();
            if done(&drawn) {
                return drawn;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the page never drew {what}: {drawn}"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }

    /// The centre of the element `selector`, in CSS pixels.
    fn centre(&mut self, selector: &str) -> (f64, f64) {
        let r = self.eval(&format!(
            "(() => {{ const r = document.querySelector({selector:?}).getBoundingClientRect(); \
             return [r.left + r.width / 2, r.top + r.height / 2, r.left, r.width]; }})()"
        ));
        (r[0].as_f64().unwrap(), r[1].as_f64().unwrap())
    }

    fn mouse(&mut self, kind: &str, x: f64, y: f64) {
        self.call(
            "Input.dispatchMouseEvent",
            serde_json::json!({"type": kind, "x": x, "y": y, "button": "left",
                               "buttons": i32::from(kind != "mouseReleased"),
                               "clickCount": 1}),
        );
    }

    /// A click on the element `selector`, as a mouse gives it.
    fn click(&mut self, selector: &str) {
        let (x, y) = self.centre(selector);
        self.mouse("mousePressed", x, y);
        self.mouse("mouseReleased", x, y);
    }

    /// A drag across the chart's plot area from `a` to `b` (fractions of its width).
    fn drag_across_chart(&mut self, a: f64, b: f64) {
        let r = self.eval(
            "(() => { const r = document.querySelector('#chart .u-over').getBoundingClientRect(); \
             return [r.left, r.top + r.height / 2, r.width]; })()",
        );
        let (left, y, width) = (
            r[0].as_f64().unwrap(),
            r[1].as_f64().unwrap(),
            r[2].as_f64().unwrap(),
        );
        let (x0, x1) = (left + a * width, left + b * width);
        self.call(
            "Input.dispatchMouseEvent",
            serde_json::json!({"type": "mouseMoved", "x": x0, "y": y}),
        );
        self.mouse("mousePressed", x0, y);
        for k in 1..=10 {
            let x = x0 + (x1 - x0) * f64::from(k) / 10.0;
            self.call(
                "Input.dispatchMouseEvent",
                serde_json::json!({"type": "mouseMoved", "x": x, "y": y, "buttons": 1}),
            );
        }
        self.mouse("mouseReleased", x1, y);
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        let _ = self.browser.kill();
        let _ = self.browser.wait();
    }
}

/// The page used as a person uses it, each step's drawing checked against the readings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_page_answers_clicks_drags_and_ranges() {
    let Some(browser) = chromium_or_skip() else {
        return;
    };
    let (dir, d, day, work) = daemon_with_data(false).await;
    let truth = truth(&work.readings, 3600);
    let base = format!("http://{}/", d.http_addr);
    let profile = dir.path().join("chromium-cdp");
    let run = tokio::task::spawn_blocking(move || {
        let mut page = Page::open(&browser, &profile, "Asia/Kolkata");
        let url = format!(
            "{base}?series=day/t&range=custom&from={day}&to={}&tz=utc&q=p99",
            day + 86_400
        );
        page.call("Page.navigate", serde_json::json!({"url": url}));
        let first = page.drawn_when("day/t", |d| d["series"] == serde_json::json!(["day/t"]));
        assert_eq!(first["x"].as_array().unwrap().len(), 24);

        // Tick a second series: both drawn, on one time axis.
        page.click(r#"li[data-name="night/t"] input"#);
        let two = page.drawn_when("two series", |d| {
            d["per"].as_array().is_some_and(|p| p.len() == 2)
        });
        assert_eq!(two["series"], serde_json::json!(["day/t", "night/t"]));
        for (i, x) in two["x"].as_array().unwrap().iter().enumerate() {
            let hour = x.as_i64().unwrap();
            for (k, name) in ["day/t", "night/t"].into_iter().enumerate() {
                let t = &truth[&(name.to_owned(), Some(hour))];
                let mean = two["per"][k]["mean"][i].as_f64().unwrap();
                assert!(close(mean, t.mean), "{name} mean @{hour}");
            }
        }

        // p50 instead of p99.
        page.click(r#"#quantiles button[data-q="p50"]"#);
        let p50 = page.drawn_when("p50", |d| d["q"] == "p50");
        for (i, x) in p50["x"].as_array().unwrap().iter().enumerate() {
            let hour = x.as_i64().unwrap();
            let t = &truth[&("day/t".to_owned(), Some(hour))];
            assert_quantile(
                p50["per"][0]["q"][i].as_f64().unwrap(),
                t,
                0.5,
                &format!("p50 @{hour}"),
            );
        }

        // The two series at p50, kept as the test's artifact.
        let shot = page.call(
            "Page.captureScreenshot",
            serde_json::json!({"format": "png"}),
        );
        let artifacts = Path::new(env!("CARGO_TARGET_TMPDIR")).join("artifacts");
        std::fs::create_dir_all(&artifacts).unwrap();
        let png = artifacts.join("chart-page-two-series.png");
        use base64::Engine;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().unwrap())
            .unwrap();
        assert!(bytes.starts_with(b"\x89PNG"), "a PNG");
        std::fs::write(&png, bytes).unwrap();

        // Drag across the second quarter of the chart: the day's hours 6 to 12, give or take
        // the hour the zoom widens to.
        page.drag_across_chart(0.25, 0.5);
        let zoomed = page.drawn_when("the zoom", |d| {
            d["from"].as_i64() != Some(day) || d["to"].as_i64() != Some(day + 86_400)
        });
        let (from, to) = (
            zoomed["from"].as_i64().unwrap(),
            zoomed["to"].as_i64().unwrap(),
        );
        assert!(
            from >= day + 4 * 3600 && from <= day + 7 * 3600,
            "from {}",
            from - day
        );
        assert!(
            to >= day + 11 * 3600 && to <= day + 14 * 3600,
            "to {}",
            to - day
        );
        assert_eq!(zoomed["range"], "custom");
        let hours: Vec<i64> = zoomed["x"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect();
        assert_eq!(
            hours,
            (from..to).step_by(3600).collect::<Vec<_>>(),
            "the zoomed span's hours"
        );

        // Local time, in a browser at UTC+5:30: hours read :30.
        page.click(r#"#zones button[data-tz="local"]"#);
        let local = page.drawn_when("local time", |d| d["tz"] == "local");
        assert_eq!(local["from"], zoomed["from"], "the same span");
        let first_cell = page.eval("document.querySelector('#rows td').textContent");
        assert!(
            first_cell.as_str().unwrap().ends_with(":30"),
            "{first_cell}"
        );
        assert_eq!(
            page.eval("document.getElementById('hour-head').textContent"),
            "Hour (local)"
        );

        // A range of one's own: night's hours 9 to 11 (UTC), typed as local times.
        page.click(r#"#zones button[data-tz="utc"]"#);
        page.drawn_when("UTC", |d| d["tz"] == "utc");
        let stamp = |t: i64| {
            chrono::DateTime::from_timestamp(t, 0)
                .unwrap()
                .format("%Y-%m-%dT%H:%M")
                .to_string()
        };
        page.eval(&format!(
            "document.getElementById('from').value = {:?}; \
             document.getElementById('to').value = {:?}; true",
            stamp(day + 9 * 3600),
            stamp(day + 12 * 3600)
        ));
        page.click("#apply");
        let own = page.drawn_when("the typed range", |d| {
            d["from"].as_i64() == Some(day + 9 * 3600)
        });
        assert_eq!(own["to"].as_i64(), Some(day + 12 * 3600));

        // A preset range: 24 h back from now (no data there: the day is two days old).
        page.click(r#"#ranges button[data-range="24h"]"#);
        let preset = page.drawn_when("24 h", |d| d["range"] == "24h");
        assert_eq!(
            preset["to"].as_i64().unwrap() - preset["from"].as_i64().unwrap(),
            86_400
        );
    });
    run.await.unwrap();
    d.stop().await.unwrap();
}
