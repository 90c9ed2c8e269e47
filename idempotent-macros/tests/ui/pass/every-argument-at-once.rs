//! Every argument at once; `done` borrows the parameters and `replay` returns the first
//! run's result to the duplicate.
#![deny(warnings)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use idempotency::{idempotent, MemoryStore};
use serde::{Deserialize, Serialize};

#[derive(Debug)]
pub struct AppError;

impl From<idempotency::Error> for AppError {
    fn from(_: idempotency::Error) -> Self {
        AppError
    }
}

#[derive(Debug)]
struct LookupError;

impl From<LookupError> for AppError {
    fn from(_: LookupError) -> Self {
        AppError
    }
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub struct Receipt {
    order_id: String,
    run: usize,
}

pub struct Payment {
    order_id: String,
    activity_id: u32,
    amount: u64,
    currency: &'static str,
}

static STORE: std::sync::LazyLock<Arc<MemoryStore>> =
    std::sync::LazyLock::new(|| Arc::new(MemoryStore::new()));
static RUNS: AtomicUsize = AtomicUsize::new(0);

async fn is_captured(_order_id: &str) -> Result<bool, LookupError> {
    Ok(false)
}

#[idempotent(
    prefix = "payment:capture",
    keys = [msg.order_id, msg.activity_id],
    ttl = 3600,
    lease = 30,
    version = 2,
    store = &*STORE,
    on_in_progress = wait(5),
    on_store_error = fail_open,
    on_error = hold,
    fingerprint = [msg.amount, msg.currency],
    done = is_captured(&msg.order_id),
    replay,
)]
pub async fn capture(msg: &Payment) -> Result<Receipt, AppError> {
    let run = RUNS.fetch_add(1, Ordering::SeqCst) + 1;
    Ok(Receipt {
        order_id: msg.order_id.clone(),
        run,
    })
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let msg = Payment {
        order_id: "A-1".to_owned(),
        activity_id: 3,
        amount: 1250,
        currency: "EUR",
    };
    let first = capture(&msg).await.unwrap();
    let replayed = capture(&msg).await.unwrap();
    assert_eq!(
        first,
        Receipt {
            order_id: "A-1".to_owned(),
            run: 1
        }
    );
    assert_eq!(replayed, first);
    assert_eq!(RUNS.load(Ordering::SeqCst), 1);
    let changed = Payment { amount: 99, ..msg };
    assert!(capture(&changed).await.is_err());
}
