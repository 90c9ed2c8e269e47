#![allow(dead_code)]

use idempotency::idempotent;
use tonic::{Request, Status};

#[derive(Clone, PartialEq, prost::Message)]
pub struct CreateOrder {
    #[prost(string, tag = "1")]
    pub request_id: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Order {
    #[prost(uint64, tag = "1")]
    pub id: u64,
}

#[tonic::async_trait]
pub trait Orders: Send + Sync + 'static {
    async fn create_order(&self, request: Request<CreateOrder>) -> Result<Order, Status>;
}

struct OrderService;

#[tonic::async_trait]
impl Orders for OrderService {
    // A prost message is replayed inside a `tonic::Response`; a bare one would need serde.
    #[idempotent(prefix = "orders:create", keys = [request.get_ref().request_id], ttl = 86400, replay)]
    async fn create_order(&self, request: Request<CreateOrder>) -> Result<Order, Status> {
        Ok(Order { id: 1 })
    }
}

fn main() {}
