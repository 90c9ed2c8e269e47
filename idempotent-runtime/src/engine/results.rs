//! What a call keeps of its results: the replay codecs, the error policy, and the answer a
//! completed record gives a later call.

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::codec;
use crate::engine::handler::HandlerResult;
use crate::error::Error;
use crate::key::Key;
use crate::policy::OnError;

/// How a value is written to a record and read back.
pub(crate) struct Codec<T> {
    pub(crate) encode: fn(&T) -> Result<Vec<u8>, Error>,
    pub(crate) decode: fn(&[u8]) -> Result<T, Error>,
}

impl<T> Clone for Codec<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Codec<T> {}

/// How a run's outcome is stored and answered again: replay codecs and the error policy.
pub(crate) struct Results<R: HandlerResult> {
    replay: Option<Codec<R::Ok>>,
    errors: Option<Codec<R::Err>>,
    on_error: Option<fn(&R::Err) -> OnError>,
    on_replay: Option<fn(&Key)>,
}

impl<R: HandlerResult> Clone for Results<R> {
    fn clone(&self) -> Self {
        Results {
            replay: self.replay,
            errors: self.errors,
            on_error: self.on_error,
            on_replay: self.on_replay,
        }
    }
}

impl<R: HandlerResult> Default for Results<R> {
    fn default() -> Self {
        Results {
            replay: None,
            errors: None,
            on_error: None,
            on_replay: None,
        }
    }
}

/// What to record for a handler's error: nothing (the claim is given back), or these bytes.
pub(crate) enum Kept {
    /// Give the claim back: a redelivery runs again.
    Release,
    /// Complete the record with this stored result.
    Record(Vec<u8>),
}

impl<R: HandlerResult> Results<R> {
    /// Stores `Ok` values and replays them (`Operation::replay`).
    pub(crate) fn with_replay(mut self) -> Self
    where
        R::Ok: Serialize + DeserializeOwned,
    {
        self.replay = Some(Codec {
            encode: |value| codec::encode(codec::OK, value),
            decode: codec::decode,
        });
        self
    }

    /// Replays `Ok` values with the caller's own encoding (`encode` writes [`codec::OK`]
    /// first): the HTTP layer's binary form of a response.
    #[cfg_attr(not(any(feature = "http", feature = "grpc")), allow(dead_code))]
    pub(crate) fn with_replay_codec(
        mut self,
        encode: fn(&R::Ok) -> Result<Vec<u8>, Error>,
        decode: fn(&[u8]) -> Result<R::Ok, Error>,
    ) -> Self {
        self.replay = Some(Codec { encode, decode });
        self
    }

    /// Classifies errors (`Operation::on_error`).
    pub(crate) fn with_on_error(mut self, classify: fn(&R::Err) -> OnError) -> Self {
        self.on_error = Some(classify);
        self
    }

    /// Stores errors and replays them (`Operation::store_errors`).
    pub(crate) fn with_store_errors(mut self) -> Self
    where
        R::Err: Serialize + DeserializeOwned,
    {
        self.errors = Some(Codec {
            encode: |err| codec::encode(codec::ERR, err),
            decode: codec::decode,
        });
        if self.on_error.is_none() {
            self.on_error = Some(|_| OnError::Store);
        }
        self
    }

    /// Calls `hook` on every replay (`Operation::on_replay`).
    pub(crate) fn with_on_replay(mut self, hook: fn(&Key)) -> Self {
        self.on_replay = Some(hook);
        self
    }

    /// The stored form of a successful run's value: `None` without replay, or when the value
    /// could not be encoded (logged: the effect happened, so the record is completed all the
    /// same, and duplicates get [`Error::Duplicate`]).
    pub(crate) fn keep_ok(&self, value: &R::Ok) -> Option<Vec<u8>> {
        self.replay.as_ref().and_then(|codec| {
            (codec.encode)(value)
                .map_err(
                    |err| tracing::error!(error = %err, "result could not be stored for replay"),
                )
                .ok()
        })
    }

    /// The stored form of a successful run's value, or the encoding's error: for a caller
    /// whose transaction can still be rolled back.
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    pub(crate) fn encode_ok(&self, value: &R::Ok) -> Result<Option<Vec<u8>>, Error> {
        self.replay
            .as_ref()
            .map(|codec| (codec.encode)(value))
            .transpose()
    }

    /// What the error policy keeps of a handler's error.
    pub(crate) fn keep_err(&self, err: &R::Err) -> Kept {
        let policy = self.on_error.map_or(OnError::Release, |f| f(err));
        match (policy, &self.errors) {
            (OnError::Release, _) => Kept::Release,
            (OnError::Store, Some(codec)) => Kept::Record((codec.encode)(err).unwrap_or_else(|e| {
                tracing::error!(error = %e, "handler error could not be stored; holding the key");
                vec![codec::HELD]
            })),
            (OnError::Hold, _) | (OnError::Store, None) => Kept::Record(vec![codec::HELD]),
        }
    }

    /// Whether a stored result tagged `tag` ([`codec::OK`], [`codec::ERR`]) is answered
    /// to a later call (replayed), rather than with [`Error::Duplicate`].
    pub(crate) fn replays(&self, tag: u8) -> bool {
        match tag {
            codec::OK => self.replay.is_some(),
            codec::ERR => self.errors.is_some(),
            _ => false,
        }
    }

    /// The answer for `key`, whose record is completed with `result`: the replayed value or
    /// error, [`Error::Held`], or [`Error::Duplicate`].
    pub(crate) fn answer_completed(
        &self,
        key: Key,
        result: Option<Vec<u8>>,
    ) -> Result<R::Ok, R::Err> {
        let replayed = |key: &Key| {
            if let Some(hook) = self.on_replay {
                hook(key);
            }
        };
        match result.as_deref().and_then(<[u8]>::split_first) {
            Some((&codec::OK, body)) => match &self.replay {
                Some(codec) => {
                    let value = (codec.decode)(body)?;
                    replayed(&key);
                    Ok(value)
                }
                None => Err(Error::Duplicate { key }.into()),
            },
            Some((&codec::ERR, body)) => match &self.errors {
                Some(codec) => {
                    let err = (codec.decode)(body)?;
                    replayed(&key);
                    Err(err)
                }
                None => Err(Error::Duplicate { key }.into()),
            },
            Some((&codec::HELD, _)) => Err(Error::Held { key }.into()),
            _ => Err(Error::Duplicate { key }.into()),
        }
    }
}
