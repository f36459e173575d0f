//! The Prometheus HTTP API, the part Grafana's Prometheus data source and `promtool` use, over
//! the buckets (served under `/prom` by [`crate::http`]): `query_range`, `query`, `labels`,
//! `label/<name>/values`, `series`, `metadata`, `status/buildinfo`, `rules` and `alerts` (none),
//! with Prometheus's JSON shapes and errors. Queries are [`crate::promql`]'s subset. GET and form POST alike, as
//! Prometheus serves them (Grafana and promtool POST by default).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use serde_json::{Value, json};

use crate::promql::{self, Budget, Field, Grid, SeriesLabels};
use crate::source::{ReadError, Source, Unreadable, buckets_around, damaged_message};

/// Largest form body a request may send (a query is at most [`promql::QUERY_BYTES_MAX`]).
const BODY_BYTES_MAX: usize = 64 * 1024;
/// Most `match[]` selectors in one request: with [`promql::MATCHERS_MAX`] matchers each, what
/// one request compiles into regular expressions stays within a few MiB.
const MATCH_MAX: usize = 8;

#[derive(Clone)]
pub struct PromState {
    pub source: Source,
    pub bucket_width_secs: i64,
    /// `http.max_points_per_query`: stored buckets read and points answered per query, and
    /// label sets per `series` answer.
    pub max_points: u64,
    /// `http.lookback` (ms): how far back a plain `bucketd_reading` looks for a reading.
    pub lookback_ms: i64,
    /// The series this request left out because they could not be read (a fresh set for each
    /// request, made in `dispatch`), named in the answer's `warnings`.
    pub unreadable: Unreadable,
    /// What the evaluation answered otherwise than asked (a fresh set per request), in the
    /// answer's `warnings`.
    pub notes: promql::Notes,
    /// Set when this request's client has gone ([`crate::source::Hangup`], per request): its
    /// evaluation stops.
    pub hangup: Option<Arc<AtomicBool>>,
}

/// The routes, relative to where they are nested (`/prom`).
pub fn router(state: PromState) -> Router {
    // One route and a match on the path, rather than a route per endpoint: each axum route is
    // generic code of its own, and the binary has a size budget (docs/EDGE.md).
    Router::new()
        .route("/api/v1/{*endpoint}", any(dispatch))
        .with_state(state)
}

async fn dispatch(
    State(s): State<PromState>,
    hangup: Option<axum::Extension<crate::source::Hangup>>,
    Path(endpoint): Path<String>,
    method: Method,
    RawQuery(q): RawQuery,
    body: Body,
) -> Response {
    let s = PromState {
        unreadable: Unreadable::default(),
        notes: promql::Notes::default(),
        hangup: hangup.map(|h| h.0.0),
        ..s
    };
    match answer(&s, &endpoint, &method, q.as_deref(), body).await {
        Ok(data) => {
            let left_out = s
                .unreadable
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone();
            let notes = s
                .notes
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone();
            let mut answer = json!({"status": "success", "data": data});
            // Prometheus's own place for "this answer is partial" or estimated.
            let warnings: Vec<String> = left_out
                .iter()
                .map(|series| damaged_message(series, "see bucketd's log"))
                .chain(notes)
                .collect();
            if !warnings.is_empty() {
                answer["warnings"] = warnings.into();
            }
            axum::Json(answer).into_response()
        }
        Err(e) => e.into_response(),
    }
}

async fn answer(
    s: &PromState,
    endpoint: &str,
    method: &Method,
    query: Option<&str>,
    body: Body,
) -> Result<Value, PromError> {
    if method != Method::GET && method != Method::POST {
        return Err(PromError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            kind: "bad_data",
            message: format!("{method} is not allowed here: use GET or POST"),
        });
    }
    let body = axum::body::to_bytes(body, BODY_BYTES_MAX)
        .await
        .map_err(|_| PromError::bad(format!("the body is larger than {BODY_BYTES_MAX} bytes")))?;
    let p = Params::of(query, &body)?;
    match endpoint {
        "query_range" => query_range(s, &p).await,
        "query" => instant_query(s, &p).await,
        "labels" => labels(s, &p).await,
        "series" => series(s, &p).await,
        "metadata" => metadata(&p),
        "status/buildinfo" => Ok(buildinfo()),
        // Exemplars: bucketd keeps none (Grafana asks when a query has them turned on).
        "query_exemplars" => Ok(json!([])),
        // Recording and alerting rules: bucketd has none. Grafana asks for them when the data
        // source loads, and a 404 shows as "Errors loading rules" on its alerting page.
        "rules" => Ok(json!({"groups": []})),
        "alerts" => Ok(json!({"alerts": []})),
        other => match other
            .strip_prefix("label/")
            .and_then(|r| r.strip_suffix("/values"))
        {
            Some(name) => label_values(s, name, &p).await,
            None => Err(PromError {
                status: StatusCode::NOT_FOUND,
                kind: "not_found",
                message: format!(
                    "no endpoint api/v1/{other}: bucketd answers query_range, query, labels, \
                     label/<name>/values, series, metadata, status/buildinfo, rules, alerts"
                ),
            }),
        },
    }
}

/// An error in Prometheus's shape: `{"status":"error","errorType":..,"error":..}`.
#[derive(Debug)]
pub struct PromError {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl PromError {
    fn bad(message: impl Into<String>) -> PromError {
        PromError {
            status: StatusCode::BAD_REQUEST,
            kind: "bad_data",
            message: message.into(),
        }
    }

    /// A query refused, as Prometheus answers its kind: `bad_data` (400) for one bucketd does not
    /// answer as written, `execution` (422) for a limit passed or an expression with no answer.
    fn refused(r: &promql::Refusal) -> PromError {
        let status = match r.error_type() {
            "bad_data" => StatusCode::BAD_REQUEST,
            _ => StatusCode::UNPROCESSABLE_ENTITY,
        };
        PromError {
            status,
            kind: r.error_type(),
            message: r.to_string(),
        }
    }

    /// A failed read: a bound passed is the client's to narrow; the rest is internal.
    fn read(e: crate::source::ReadError) -> PromError {
        match e {
            crate::source::ReadError::TooLarge(why) => {
                PromError::refused(&promql::Refusal::TooLarge(why))
            }
            e => PromError::internal(e),
        }
    }

    /// The details go to the log only, as for the JSON API.
    fn internal(e: impl std::fmt::Display) -> PromError {
        tracing::error!(error = %e, "Prometheus API query failed.");
        PromError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "internal",
            message: "reading the store failed (see bucketd's log)".into(),
        }
    }
}

impl IntoResponse for PromError {
    fn into_response(self) -> Response {
        let body = json!({"status": "error", "errorType": self.kind, "error": self.message});
        (self.status, axum::Json(body)).into_response()
    }
}

/// The parameters of a request: the URL's query, then a form body's (Prometheus reads both).
struct Params(Vec<(String, String)>);

impl Params {
    fn of(query: Option<&str>, body: &[u8]) -> Result<Params, PromError> {
        let mut pairs: Vec<(String, String)> = serde_urlencoded::from_str(query.unwrap_or(""))
            .map_err(|e| PromError::bad(format!("the URL's query string: {e}")))?;
        if !body.is_empty() {
            let form: Vec<(String, String)> = serde_urlencoded::from_bytes(body).map_err(|e| {
                PromError::bad(format!(
                    "the body must be application/x-www-form-urlencoded: {e}"
                ))
            })?;
            pairs.extend(form);
        }
        Ok(Params(pairs))
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, v)| k == name && !v.is_empty())
            .map(|(_, v)| v.as_str())
    }

    fn required(&self, name: &str) -> Result<&str, PromError> {
        self.get(name)
            .ok_or_else(|| PromError::bad(format!("missing parameter `{name}`")))
    }

    fn time(&self, name: &str) -> Result<Option<i64>, PromError> {
        self.get(name)
            .map(|t| {
                promql::parse_time(t)
                    .map_err(|e| PromError::bad(format!("parameter `{name}`: {e}")))
            })
            .transpose()
    }

    /// The selectors of `match[]`, each a plain selector, at most [`MATCH_MAX`].
    fn matches(&self) -> Result<Vec<promql::Selector>, PromError> {
        let given = self.0.iter().filter(|(k, _)| k == "match[]").count();
        if given > MATCH_MAX {
            return Err(PromError::bad(format!(
                "at most {MATCH_MAX} match[] parameters, not {given}"
            )));
        }
        // `bucketd_reading` names series here (Grafana's metric browser narrows the labels
        // with `match[]=<the chosen metric>`), as it does in `/label/__name__/values`.
        self.0
            .iter()
            .filter(|(k, _)| k == "match[]")
            .map(|(_, v)| {
                promql::parse_series_selector(v)
                    .map_err(|e| PromError::bad(format!("parameter `match[]`: {e}")))
            })
            .collect()
    }
}

fn now_ms() -> i64 {
    crate::reading::Timestamp::now()
        .as_nanos()
        .div_euclid(1_000_000)
}

/// Runs a blocking store read off the async workers.
async fn read<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, PromError> + Send + 'static,
) -> Result<T, PromError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(PromError::internal)?
}

/// Evaluates `query` at `grid`: the series and their points, or the number of a scalar query.
async fn evaluate(
    s: &PromState,
    query: &str,
    grid: Grid,
) -> Result<Result<Vec<promql::Series>, Vec<(i64, f64)>>, PromError> {
    let expr = promql::parse(query)
        .map_err(|e| PromError::bad(format!("invalid parameter \"query\": {e}")))?;
    if let Some(n) = expr.number() {
        return Ok(Err(grid.times().map(|t| (t, n)).collect()));
    }
    let (source, width, unreadable) = (s.source.clone(), s.bucket_width_secs, s.unreadable.clone());
    let budget = Budget {
        max_points: s.max_points,
        cancel: s.hangup.clone(),
        notes: Some(s.notes.clone()),
    };
    read(move || {
        let names = source.series().map_err(PromError::read)?;
        let names = SeriesLabels::all(&names, source.fleet());
        let fetch =
            |wanted: &[&str], from, to| buckets_around(&*source, wanted, from, to, &unreadable);
        let raw = |series: &str, from, to, at_most: u64| {
            let mut readings = Vec::new();
            let mut over = false;
            match source.raw(series, from, to, &mut |page| {
                readings.extend_from_slice(page);
                over = readings.len() as u64 > at_most;
                !over
            }) {
                Err(ReadError::NotHere(why)) => return Ok(promql::Raw::NotKept(why)),
                read => read?,
            }
            Ok(if over {
                promql::Raw::TooMany
            } else {
                promql::Raw::Readings(readings)
            })
        };
        let value = promql::evaluate(&expr, &names, grid, width, &budget, fetch, raw).map_err(
            |e| match e {
                promql::EvalError::Refused(r) => PromError::refused(&r),
                promql::EvalError::Read(e) => PromError::read(e),
                // No one reads this answer.
                promql::EvalError::Cancelled => PromError {
                    status: StatusCode::SERVICE_UNAVAILABLE,
                    kind: "canceled",
                    message: "the client went away; the query was stopped".into(),
                },
            },
        )?;
        Ok(match value {
            promql::Value::Vector(series) => Ok(series),
            promql::Value::Scalar(n) => Err(grid.times().map(|t| (t, n)).collect()),
            promql::Value::Timed(points) => Err(points),
        })
    })
    .await
}

fn point(t: i64, v: f64) -> Value {
    json!([promql::format_time(t), promql::format_value(v)])
}

async fn query_range(s: &PromState, p: &Params) -> Result<Value, PromError> {
    let query = p.required("query")?;
    let start = p
        .time("start")?
        .ok_or_else(|| PromError::bad("missing parameter `start`"))?;
    let end = p
        .time("end")?
        .ok_or_else(|| PromError::bad("missing parameter `end`"))?;
    let step = promql::parse_duration(p.required("step")?)
        .map_err(|e| PromError::bad(format!("invalid parameter \"step\": {e}")))?;
    let grid = Grid::range(start, end, step)
        .map_err(PromError::bad)?
        .looking_back(s.lookback_ms);
    let result: Vec<Value> = match evaluate(s, query, grid).await? {
        Ok(series) => series
            .into_iter()
            .map(|s| {
                let values: Vec<Value> = s.points.iter().map(|(t, v)| point(*t, *v)).collect();
                json!({"metric": s.labels, "values": values})
            })
            .collect(),
        Err(points) => {
            let values: Vec<Value> = points.iter().map(|&(t, v)| point(t, v)).collect();
            vec![json!({"metric": {}, "values": values})]
        }
    };
    Ok(json!({"resultType": "matrix", "result": result}))
}

async fn instant_query(s: &PromState, p: &Params) -> Result<Value, PromError> {
    let query = p.required("query")?;
    let at = p.time("time")?.unwrap_or_else(now_ms);
    let data = match evaluate(s, query, Grid::instant(at).looking_back(s.lookback_ms)).await? {
        Ok(series) => {
            let result: Vec<Value> = series
                .into_iter()
                .filter_map(|s| {
                    let (t, v) = *s.points.first()?;
                    Some(json!({"metric": s.labels, "value": point(t, v)}))
                })
                .collect();
            json!({"resultType": "vector", "result": result})
        }
        Err(points) => {
            let v = points.first().map_or(f64::NAN, |p| p.1);
            json!({"resultType": "scalar", "result": point(at, v)})
        }
    };
    Ok(data)
}

/// The stored series that one of `selectors` selects (all when there are none), with the
/// fields each selector selects; with `start` or `end`, only series with a bucket between them
/// (as Prometheus answers only series with samples in the range), unless checking that would
/// read more buckets than `http.max_points_per_query`: then all of them.
/// A stored series a request's selectors chose: its name, the bucket fields they name, and
/// whether they name its readings (`bucketd_reading`) too.
struct Chosen {
    name: String,
    fields: Vec<Field>,
    readings: bool,
    /// Whether they name its readings by their Prometheus name (`energy_kwh{site="north"}`).
    native: bool,
}

async fn selected(
    s: &PromState,
    p: &Params,
    selectors: Vec<promql::Selector>,
) -> Result<Vec<Chosen>, PromError> {
    let (start, end) = (p.time("start")?, p.time("end")?);
    let (source, fleet) = (s.source.clone(), s.source.fleet());
    let names = read(move || source.series().map_err(PromError::read)).await?;
    let labels = SeriesLabels::all(&names, fleet);
    if let Some(hint) = selectors
        .iter()
        .find_map(|sel| sel.old_fleet_sensor(&labels))
    {
        return Err(PromError::bad(hint));
    }
    let chosen: Vec<Chosen> = labels
        .iter()
        .filter_map(|labels| {
            let matching: Vec<&promql::Selector> = selectors
                .iter()
                .filter(|sel| sel.matches_series(labels))
                .collect();
            let (fields, readings, native): (BTreeSet<Field>, bool, bool) = if selectors.is_empty()
            {
                (Field::ALL.into_iter().collect(), true, true)
            } else {
                (
                    matching.iter().flat_map(|sel| sel.fields()).collect(),
                    matching
                        .iter()
                        .any(|sel| sel.selects_readings() && !sel.native()),
                    matching.iter().any(|sel| sel.native()),
                )
            };
            (!fields.is_empty() || readings || native).then(|| Chosen {
                name: labels.series.to_owned(),
                fields: fields.into_iter().collect(),
                readings,
                native,
            })
        })
        .collect();
    if start.is_none() && end.is_none() {
        return Ok(chosen);
    }
    let width = s.bucket_width_secs;
    let from = start.map_or(i64::MIN / 2, |t| {
        t.div_euclid(1000).div_euclid(width) * width
    });
    let to = end.map_or(i64::MAX / 2, |t| t.div_euclid(1000).saturating_add(1));
    let buckets = u64::try_from(to.saturating_sub(from) / width + 1).unwrap_or(u64::MAX);
    if buckets.saturating_mul(chosen.len() as u64) > s.max_points {
        return Ok(chosen);
    }
    let (source, unreadable) = (s.source.clone(), s.unreadable.clone());
    let names: Vec<String> = chosen.iter().map(|c| c.name.clone()).collect();
    let present = read(move || {
        let wanted: Vec<&str> = names.iter().map(String::as_str).collect();
        buckets_around(&*source, &wanted, from, to, &unreadable).map_err(PromError::read)
    })
    .await?;
    Ok(chosen
        .into_iter()
        .filter(|c| present.get(&c.name).is_some_and(|b| !b.is_empty()))
        .collect())
}

/// The `limit` parameter: at most this many results; none, or 0, for all.
fn limit(p: &Params) -> Result<usize, PromError> {
    match p.get("limit") {
        None => Ok(usize::MAX),
        Some(l) => match l.parse::<i64>() {
            Ok(n) if n > 0 => Ok(usize::try_from(n).unwrap_or(usize::MAX)),
            Ok(_) => Ok(usize::MAX),
            Err(_) => Err(PromError::bad(format!("limit must be a number, not `{l}`"))),
        },
    }
}

async fn labels(s: &PromState, p: &Params) -> Result<Value, PromError> {
    let selected = selected(s, p, p.matches()?).await?;
    let fleet = s.source.fleet();
    let mut names: BTreeSet<String> = BTreeSet::new();
    for c in &selected {
        let labels = SeriesLabels::of(&c.name, fleet);
        names.insert("__name__".to_owned());
        if c.readings || !c.fields.is_empty() {
            names.extend(promql::LABELS.iter().map(|l| (*l).to_owned()));
        }
        names.extend(labels.gateway.map(|_| promql::GATEWAY.to_owned()));
        names.extend(labels.tags().map(|(k, _)| k.to_owned()));
    }
    // Prometheus lists them sorted.
    let names: Vec<String> = names.into_iter().take(limit(p)?).collect();
    Ok(json!(names))
}

async fn label_values(s: &PromState, name: &str, p: &Params) -> Result<Value, PromError> {
    let selected = selected(s, p, p.matches()?).await?;
    let fleet = s.source.fleet();
    // The readings' metric is a name too (for range functions), where the selectors take it.
    let values: BTreeSet<String> = selected
        .iter()
        .flat_map(|c| {
            let labels = SeriesLabels::of(&c.name, fleet);
            let own = c.readings || !c.fields.is_empty();
            let one = match name {
                "series" if own => Some(labels.series),
                "sensor" if own => Some(labels.sensor),
                "metric" if own => Some(labels.metric),
                promql::GATEWAY => labels.gateway,
                _ => labels.tags().find(|(k, _)| *k == name).map(|(_, v)| v),
            };
            let names = c
                .fields
                .iter()
                .map(|f| f.metric_name())
                .chain(c.readings.then_some(promql::READINGS))
                .map(str::to_owned)
                .chain(c.native.then(|| labels.native_name()))
                .filter(|_| name == "__name__");
            one.map(str::to_owned).into_iter().chain(names)
        })
        .collect();
    let values: Vec<String> = values.into_iter().take(limit(p)?).collect();
    Ok(json!(values))
}

async fn series(s: &PromState, p: &Params) -> Result<Value, PromError> {
    let selectors = p.matches()?;
    if selectors.is_empty() {
        return Err(PromError::bad("no match[] parameter provided"));
    }
    let selected = selected(s, p, selectors).await?;
    let total: u64 = selected
        .iter()
        .map(|c| c.fields.len() as u64 + u64::from(c.readings) + u64::from(c.native))
        .sum();
    if total > s.max_points {
        return Err(PromError::bad(format!(
            "the selectors match {total} series, more than http.max_points_per_query ({}); \
             narrow them",
            s.max_points
        )));
    }
    let fleet = s.source.fleet();
    let list: Vec<Value> = selected
        .iter()
        .flat_map(|c| {
            let labels = SeriesLabels::of(&c.name, fleet);
            let readings = c.readings.then(|| json!(labels.named(promql::READINGS)));
            let native = c.native.then(|| json!(labels.native_labels()));
            c.fields
                .iter()
                .map(move |f| json!(labels.with_name(*f)))
                .chain(readings)
                .chain(native)
                .collect::<Vec<_>>()
        })
        .take(limit(p)?)
        .collect();
    Ok(json!(list))
}

fn metadata(p: &Params) -> Result<Value, PromError> {
    let only = p.get("metric");
    let mut data: BTreeMap<&str, Value> = Field::ALL
        .into_iter()
        .map(|f| (f.metric_name(), f.help()))
        .chain(std::iter::once((
            promql::READINGS,
            "The readings themselves, in range functions over whole buckets: \
             quantile_over_time(0.99, bucketd_reading{series=\"boiler/temp\"}[1d]).",
        )))
        .filter(|(name, _)| only.is_none_or(|m| m == *name))
        .map(|(name, help)| (name, json!([{"type": "gauge", "help": help, "unit": ""}])))
        .collect();
    let keep = limit(p)?;
    while data.len() > keep {
        data.pop_last();
    }
    Ok(json!(data))
}

fn buildinfo() -> Value {
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "revision": "",
        "branch": "",
        "buildUser": "",
        "buildDate": "",
        "goVersion": "",
    })
}
