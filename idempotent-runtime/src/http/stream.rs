//! A fresh response sent to its client as the handler produces it, and kept for replay when it
//! fits.
//!
//! The head goes to the client with the first body frame that can go at once, and each frame
//! after it as soon as it is produced, while the layer keeps a copy up to the stored-body
//! limit. The key completes (its record written) when the body ended (with the body), or as
//! soon as it is known that the body will not be kept: it outgrew the limit, failed, had
//! trailers, or the client left before its end (without a body: a retry gets `303` to its
//! `Location` or `response-not-stored`, never a second run). What the client gets from that point on (the
//! body's last frame and its end, or the rest of the body) is held back until the completion
//! is recorded, so a client that has the whole response and retries gets the replay. A
//! response whose first frame is held (a body of one frame, the common case) is held head
//! included, so that head and body reach the socket together: a head written alone, and its
//! body a round trip later, would meet Nagle's algorithm on a server without `TCP_NODELAY`
//! (axum's default) and the client's delayed acknowledgement, 40 ms on Linux.

use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::AtomicBool;
use std::sync::{Mutex, PoisonError};
use std::task::{ready, Context, Poll};

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt as _;
use http::response::Parts;
use http::{header, Response};
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::BodyExt;
use tokio::sync::mpsc;

use crate::http::body::{Body, BoxError};
use crate::http::failure::Failure;
use crate::http::stored::{storable, Stored};
use crate::http::{Config, Replayed, Storage};

/// What the handler's run left for the request that ran it.
#[derive(Default)]
pub(crate) struct Live {
    /// The handler started.
    pub(crate) ran: AtomicBool,
    /// The response for the request that ran the handler, when it is sent after the run.
    pub(crate) response: Mutex<Option<Response<Body>>>,
    /// The response's head was sent to the client while the run went on ([`capture`]).
    pub(crate) streamed: AtomicBool,
    /// What of a streamed response waits for the key's completion.
    pub(crate) tail: Mutex<Option<Tail>>,
}

/// What travels from the layer's task to the client's body.
enum Piece {
    Frame(Frame<Bytes>),
    /// The rest of the handler's body, for the client to read itself.
    Rest(UnsyncBoxBody<Bytes, BoxError>),
    Error(BoxError),
    End,
}

/// The pieces held back until the key's completion is recorded, and either the way to the
/// client (once the head went) or the response's head, not sent yet.
pub(crate) struct Tail {
    to_client: Option<mpsc::UnboundedSender<Piece>>,
    held: Vec<Piece>,
    head: Option<(Parts, SizeHint)>,
}

impl Tail {
    /// Queues what was held back, then the end of the body, and returns the head if it was
    /// held too: it then carries its whole body, and no channel is made for it.
    pub(crate) fn release(mut self) -> Option<Response<Body>> {
        self.held.push(Piece::End);
        if let Some((parts, hint)) = self.head {
            return Some(head(parts, hint, Feed::Held(self.held.into_iter())));
        }
        if let Some(to_client) = &self.to_client {
            for piece in self.held {
                if to_client.send(piece).is_err() {
                    break;
                }
            }
        }
        None
    }
}

/// The client's response: the handler's head, and a body fed by `feed`.
fn head(parts: Parts, hint: SizeHint, feed: Feed) -> Response<Body> {
    let body = Streamed {
        feed,
        rest: None,
        hint,
        ended: false,
    };
    let mut head = Response::from_parts(parts, Body::stream(body));
    head.extensions_mut().insert(Replayed(false));
    head
}

/// Resolves once the client's body is dropped; never while nothing was sent to it.
async fn closed(to_client: &Option<mpsc::UnboundedSender<Piece>>) {
    match to_client {
        Some(to_client) => to_client.closed().await,
        None => std::future::pending().await,
    }
}

/// Sends the head of the handler's `response` with `send_head` (with the first frame that goes
/// at once) and its body as it comes, keeping a copy up to the limit; returns its stored form
/// and leaves the [`Tail`] in `tail`, with the head when it was held. A response that releases
/// the key is the failure sent as it is, unread.
pub(crate) async fn capture<RB, E>(
    config: &Config,
    response: Response<RB>,
    send_head: impl FnOnce(Response<Body>),
    tail: &Mutex<Option<Tail>>,
) -> Result<Stored, Failure<E>>
where
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let (parts, body) = response.into_parts();
    if (config.storage)(parts.status) == Storage::Release {
        return Err(Failure::Released(Response::from_parts(
            parts,
            Body::stream(body),
        )));
    }
    let headers = storable(&parts.headers, config.sanitize);
    let status = parts.status;
    let hint = body.size_hint();
    // The body's length when it is known: its last frame is then known when it arrives.
    let declared = hint.exact().or_else(|| {
        parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
    });
    // The way to the client is made when the head goes before the body's end; a head held
    // with its whole body needs none.
    let mut to_client: Option<mpsc::UnboundedSender<Piece>> = None;
    let mut unsent = Some((parts, send_head));

    let mut body = body.map_err(Into::into).boxed_unsync();
    let max = config.max_stored_body;
    let mut kept: Vec<Bytes> = Vec::new();
    let mut size = 0usize;
    let mut held: Vec<Piece> = Vec::new();
    let mut holding = false;
    let mut client_left = false;
    let whole = loop {
        let next = AssertUnwindSafe(body.frame()).catch_unwind();
        let next = if client_left {
            // Nobody reads on: keep what the body has ready, wait for nothing.
            match next.now_or_never() {
                Some(next) => next,
                None => break None,
            }
        } else {
            tokio::select! {
                biased;
                next = next => next,
                () = closed(&to_client) => {
                    client_left = true;
                    continue;
                }
            }
        };
        let frame = match next {
            Ok(None) => break Some(concat(kept, size)),
            Ok(Some(Ok(frame))) => frame,
            Ok(Some(Err(err))) => {
                held.push(Piece::Error(err));
                break None;
            }
            Err(_panic) => {
                tracing::error!("the response body panicked; the key completes without it");
                held.push(Piece::Error("the response body failed".into()));
                break None;
            }
        };
        let Some(data) = frame.data_ref() else {
            // Trailers are not kept: the response is not replayable as it was.
            held.extend([Piece::Frame(frame), Piece::Rest(body)]);
            break None;
        };
        size += data.len();
        if size > max {
            held.extend([Piece::Frame(frame), Piece::Rest(body)]);
            break None;
        }
        kept.push(data.clone());
        holding |= body.is_end_stream() || declared == Some(size as u64);
        if holding {
            held.push(Piece::Frame(frame));
        } else if !client_left {
            let sent = match (&to_client, unsent.take()) {
                (Some(to_client), _) => to_client.send(Piece::Frame(frame)),
                (None, Some((parts, send_head))) => {
                    let (sender, from_layer) = mpsc::unbounded_channel();
                    let sent = sender.send(Piece::Frame(frame));
                    send_head(head(parts, hint, Feed::Live(from_layer)));
                    to_client = Some(sender);
                    sent
                }
                // The head goes with the way to the client: one is never without the other.
                (None, None) => Ok(()),
            };
            if sent.is_err() {
                client_left = true;
            }
        }
    };
    *tail.lock().unwrap_or_else(PoisonError::into_inner) = Some(Tail {
        to_client,
        held,
        head: unsent.map(|(parts, _)| (parts, hint)),
    });
    Ok(Stored {
        status,
        headers,
        body: whole,
    })
}

fn concat(mut kept: Vec<Bytes>, size: usize) -> Bytes {
    match kept.len() {
        0 => Bytes::new(),
        1 => kept.pop().unwrap_or_default(),
        _ => {
            let mut whole = BytesMut::with_capacity(size);
            for part in kept {
                whole.extend_from_slice(&part);
            }
            whole.freeze()
        }
    }
}

/// Where the client's body takes its pieces from.
enum Feed {
    /// The layer's channel: the head went before the body's end.
    Live(mpsc::UnboundedReceiver<Piece>),
    /// All of it, held until the completion was recorded (ending with [`Piece::End`]).
    Held(std::vec::IntoIter<Piece>),
}

/// The client's body of a fresh response: the frames the layer forwards, then possibly the
/// rest of the handler's body.
struct Streamed {
    feed: Feed,
    rest: Option<UnsyncBoxBody<Bytes, BoxError>>,
    hint: SizeHint,
    ended: bool,
}

impl http_body::Body for Streamed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        loop {
            if let Some(rest) = &mut self.rest {
                return Pin::new(rest).poll_frame(cx);
            }
            if self.ended {
                return Poll::Ready(None);
            }
            let next = match &mut self.feed {
                Feed::Live(pieces) => ready!(pieces.poll_recv(cx)),
                Feed::Held(pieces) => pieces.next(),
            };
            match next {
                Some(Piece::Frame(frame)) => return Poll::Ready(Some(Ok(frame))),
                Some(Piece::Rest(rest)) => self.rest = Some(rest),
                Some(Piece::Error(err)) => {
                    self.ended = true;
                    return Poll::Ready(Some(Err(err)));
                }
                Some(Piece::End) => {
                    self.ended = true;
                    return Poll::Ready(None);
                }
                None => {
                    self.ended = true;
                    let cut = "the response was cut off: the layer's task ended";
                    return Poll::Ready(Some(Err(cut.into())));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.rest {
            Some(rest) => rest.is_end_stream(),
            None => self.ended,
        }
    }

    fn size_hint(&self) -> SizeHint {
        self.hint
    }
}
