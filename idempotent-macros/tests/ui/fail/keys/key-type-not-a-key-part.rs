#![allow(dead_code)]

use idempotency::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idempotency::Error> for AppError {
    fn from(_: idempotency::Error) -> Self {
        AppError
    }
}

struct OrderMessage {
    order_id: String,
    activity_id: u64,
}

struct Tenant {
    name: String,
}

struct Message {
    tenant: Tenant,
    id: u64,
}

#[idempotent(prefix = "order:consume", keys = [msg.tenant, msg.id], ttl = 3600)]
async fn on_message(msg: &Message) -> Result<String, AppError> {
    Ok(msg.tenant.name.clone())
}

fn main() {}
