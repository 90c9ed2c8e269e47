//! Methods taking `&self`, `&mut self` and `self`, with keys and the store taken from `self`.
#![deny(warnings)]

use std::sync::Arc;

use idempotency::{idempotent, MemoryStore};

#[derive(Debug)]
struct AppError;

impl From<idempotency::Error> for AppError {
    fn from(_: idempotency::Error) -> Self {
        AppError
    }
}

struct Redeem {
    coupon: String,
}

struct Consumer {
    tenant: String,
    store: Arc<MemoryStore>,
    redeemed: usize,
}

impl Consumer {
    #[idempotent(prefix = "coupon:check", keys = [self.tenant, msg.coupon], ttl = 600, store = self.store)]
    async fn check(&self, msg: &Redeem) -> Result<usize, AppError> {
        Ok(self.tenant.len() + msg.coupon.len())
    }

    #[idempotent(prefix = "coupon:redeem", keys = [self.tenant, msg.coupon], ttl = 600, store = self.store)]
    async fn redeem(&mut self, msg: &Redeem) -> Result<usize, AppError> {
        self.redeemed += 1;
        Ok(self.redeemed)
    }

    #[idempotent(prefix = "consumer:close", keys = [self.tenant], ttl = 600, store = self.store.clone())]
    async fn close(self) -> Result<String, AppError> {
        Ok(self.tenant)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = Arc::new(MemoryStore::new());
    let mut consumer = Consumer {
        tenant: "acme".to_owned(),
        store,
        redeemed: 0,
    };
    let msg = Redeem {
        coupon: "SPRING".to_owned(),
    };

    assert_eq!(consumer.check(&msg).await.unwrap(), 10);
    assert_eq!(consumer.redeem(&msg).await.unwrap(), 1);
    assert!(consumer.redeem(&msg).await.is_err());
    assert_eq!(consumer.redeemed, 1);
    assert_eq!(consumer.close().await.unwrap(), "acme");
}
