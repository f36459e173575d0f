//! HTTP requests to a daemon under test.

use bucketd::daemon::RunningDaemon;
use serde_json::Value;

/// One HTTP request; returns the status and the body.
pub async fn http(method: &'static str, url: String) -> (u16, String) {
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let response = match method {
            "POST" => agent.post(&url).send_empty(),
            _ => agent.get(&url).call(),
        }
        .unwrap_or_else(|e| panic!("{method} {url}: {e}"));
        let status = response.status().as_u16();
        (status, response.into_body().read_to_string().unwrap())
    })
    .await
    .unwrap()
}

pub async fn get_json(d: &RunningDaemon, path: &str) -> (u16, Value) {
    let (status, body) = http("GET", format!("http://{}{path}", d.http_addr)).await;
    let value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"));
    (status, value)
}
