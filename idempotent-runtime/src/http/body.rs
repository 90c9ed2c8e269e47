//! The layer's response body: a replayed or buffered body in one piece, or the handler's own
//! body (passed through, or continued after the part the layer read).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::BodyExt;

/// An error of a handler's response body, boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of every response the layer returns: a stored or buffered body in one piece, or
/// the handler's streamed body.
///
/// ```
/// use http_body::Body as _;
/// use idempotent_runtime::http::Body;
///
/// let body = Body::from("replayed");
/// assert_eq!(body.size_hint().exact(), Some(8));
/// ```
pub struct Body {
    inner: Inner,
}

enum Inner {
    Full(Option<Bytes>),
    Stream(UnsyncBoxBody<Bytes, BoxError>),
}

impl Body {
    pub(crate) fn full(bytes: Bytes) -> Body {
        Body {
            inner: Inner::Full((!bytes.is_empty()).then_some(bytes)),
        }
    }

    pub(crate) fn stream<B>(body: B) -> Body
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        Body {
            inner: Inner::Stream(body.map_err(Into::into).boxed_unsync()),
        }
    }
}

impl From<Bytes> for Body {
    fn from(bytes: Bytes) -> Body {
        Body::full(bytes)
    }
}

impl From<&'static str> for Body {
    fn from(text: &'static str) -> Body {
        Body::full(Bytes::from_static(text.as_bytes()))
    }
}

impl std::fmt::Debug for Body {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Inner::Full(bytes) => f
                .debug_struct("Body")
                .field("len", &bytes.as_ref().map_or(0, Bytes::len))
                .finish(),
            Inner::Stream(_) => f.debug_struct("Body").field("streamed", &true).finish(),
        }
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.inner {
            Inner::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Inner::Stream(body) => Pin::new(body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Full(bytes) => bytes.is_none(),
            Inner::Stream(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Full(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            Inner::Stream(body) => body.size_hint(),
        }
    }
}
