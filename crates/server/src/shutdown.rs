//! Ending streams when the shutdown grace runs out. Streams used to be cut mid-way with no
//! final chunk, no error and no `[DONE]`; now each one, streaming or not, ends with an error
//! in OpenAI's shape (streaming: an error event, then `[DONE]`) and its engine request is
//! cancelled by dropping it.

use futures::{Stream, StreamExt};
use serde_json::Value;
use tokio::sync::watch;

use crate::error::ApiError;

/// Fired once, when the grace period is over and streams are still running.
pub struct StreamCut {
    tx: watch::Sender<bool>,
}

impl Default for StreamCut {
    fn default() -> Self {
        StreamCut { tx: watch::channel(false).0 }
    }
}

impl StreamCut {
    pub fn fire(&self) {
        self.tx.send_replace(true);
    }

    /// Resolves once the cut has fired (at once if it already has).
    pub fn fired(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.tx.subscribe();
        async move {
            let _ = rx.wait_for(|v| *v).await;
        }
    }
}

/// What a cut stream ends with.
pub fn cut_error() -> ApiError {
    ApiError::unavailable_msg("The server is shutting down and its grace period for running requests is over; this request was cancelled.")
}

/// `s` until the cut fires, then one error body and the end (the caller appends `[DONE]`).
pub fn until_cut(s: impl Stream<Item = Value> + Send + 'static, cut: &StreamCut) -> impl Stream<Item = Value> + Send + 'static {
    let fired = Box::pin(cut.fired());
    futures::stream::unfold((Box::pin(s), Some(fired)), |(mut s, fired)| async move {
        let mut fired = fired?;
        tokio::select! {
            biased;
            v = s.next() => v.map(|v| (v, (s, Some(fired)))),
            _ = &mut fired => Some((cut_error().body(), (s, None))),
        }
    })
}
