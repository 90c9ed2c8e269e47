//! How a record is shown: a readable table or JSON.

use std::time::Duration;

use idempotency::admin::Inspection;
use idempotency::store::RecordState;
use idempotency::Key;
use serde_json::json;

pub(crate) fn seconds(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".into(), |d| format!("{:.1} s", d.as_secs_f64()))
}

pub(crate) fn state_name(state: &RecordState) -> &'static str {
    match state {
        RecordState::InProgress { .. } => "in_progress",
        RecordState::Completed => "completed",
        RecordState::Released => "released",
        _ => "unknown",
    }
}

pub(crate) fn inspection_json(key: &Key, seen: &Inspection) -> serde_json::Value {
    let lease_left = match seen.state {
        RecordState::InProgress { lease_left } => Some(lease_left.as_secs_f64()),
        _ => None,
    };
    json!({
        "key": key.to_string(),
        "record": {
            "state": state_name(&seen.state),
            "lease_left_seconds": lease_left,
            "age_seconds": seen.age.map(|d| d.as_secs_f64()),
            "expires_in_seconds": seen.expires_in.map(|d| d.as_secs_f64()),
            "fence": seen.fence,
            "held": seen.held,
            "result_bytes": seen.result_size,
            "fingerprint": seen.fingerprint,
        }
    })
}

pub(crate) fn print_inspection(key: &Key, seen: &Inspection, as_json: bool) {
    if as_json {
        println!("{}", inspection_json(key, seen));
        return;
    }
    let lease = match seen.state {
        RecordState::InProgress { lease_left } => seconds(Some(lease_left)),
        _ => "-".into(),
    };
    let result = seen
        .result_size
        .map_or_else(|| "-".to_string(), |n| format!("{n} bytes"));
    println!("key          {key}");
    println!("state        {}", state_name(&seen.state));
    println!("lease left   {lease}");
    println!("age          {}", seconds(seen.age));
    println!("expires in   {}", seconds(seen.expires_in));
    println!("fence        {}", seen.fence);
    println!("held         {}", if seen.held { "yes" } else { "no" });
    println!("result       {result}");
    println!(
        "fingerprint  {}",
        if seen.fingerprint { "yes" } else { "no" }
    );
}
