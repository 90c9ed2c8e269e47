#![allow(dead_code)]

use idempotency::idempotent;
use tonic::{Request, Response, Status};

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
    async fn create_order(&self, request: Request<CreateOrder>) -> Result<Response<Order>, Status>;
}

struct OrderService;

#[tonic::async_trait]
impl Orders for OrderService {
    // The message's field is `request_id`.
    #[idempotent(prefix = "orders:create", keys = [request.get_ref().order_id], ttl = 86400, replay)]
    async fn create_order(&self, request: Request<CreateOrder>) -> Result<Response<Order>, Status> {
        Ok(Response::new(Order { id: 1 }))
    }
}

fn main() {}
