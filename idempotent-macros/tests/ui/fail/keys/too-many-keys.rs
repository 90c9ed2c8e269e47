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

struct Wide {
    a: u8,
    b: u8,
    c: u8,
    d: u8,
    e: u8,
    f: u8,
    g: u8,
    h: u8,
    i: u8,
    j: u8,
    k: u8,
    l: u8,
    m: u8,
    n: u8,
    o: u8,
    p: u8,
    q: u8,
}

#[idempotent(
    prefix = "order:consume",
    keys = [msg.a, msg.b, msg.c, msg.d, msg.e, msg.f, msg.g, msg.h, msg.i, msg.j, msg.k, msg.l, msg.m, msg.n, msg.o, msg.p, msg.q],
    ttl = 3600,
)]
async fn on_wide(msg: &Wide) -> Result<u8, AppError> {
    Ok(msg.a)
}

fn main() {}
