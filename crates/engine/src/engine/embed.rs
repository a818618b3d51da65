//! Embedding requests (an engine started with `Task::Embed`): a request is one sequence that is
//! prefilled like a prompt (chunked, batched with every other input, mixed adapters, prefix
//! cache for last-token pooling) and then pooled instead of sampled. Mean pooling collects every
//! row of the sequence's chunks in order (the prefix cache is off then: every row is needed);
//! last-token pooling takes the final row. The vector goes back through a oneshot channel, then
//! the request finishes like a generation that stopped.

use super::*;
use quiver_model::{EmbeddingSpec, PoolState, Pooling};

/// What the engine thread needs to finish an embedding request.
pub(crate) struct EmbedJob {
    pub dimensions: Option<usize>,
    pub normalize: Option<bool>,
    pub reply: oneshot::Sender<Vec<f32>>,
}

pub(crate) struct EmbedState {
    pub job: Option<EmbedJob>,
    pub pool: PoolState,
}

impl EngineHandle {
    /// The pooling of an engine started with `Task::Embed`.
    pub fn embedding_spec(&self) -> Option<&EmbeddingSpec> {
        self.inner.shared.embedding.as_ref()
    }

    /// Queues one input to embed. Fails at once on invalid input, an unknown adapter, a full
    /// queue, shutdown, or an engine that generates text.
    pub fn submit_embed(&self, req: EmbedRequest) -> Result<EmbedStream, SubmitError> {
        let sh = &self.inner.shared;
        let Some(spec) = &sh.embedding else {
            return Err(SubmitError::Invalid("this server generates text: start it with --task embed to serve embeddings".into()));
        };
        if req.input.is_empty() {
            return Err(SubmitError::Invalid("input is empty".into()));
        }
        if let Some(&bad) = req.input.iter().find(|&&t| t as usize >= sh.vocab) {
            return Err(SubmitError::Invalid(format!("token id {bad} is outside the vocabulary ({} tokens)", sh.vocab)));
        }
        if req.input.len() > sh.max_model_len {
            return Err(SubmitError::PromptTooLong { prompt_tokens: req.input.len(), max_tokens: 0, max_model_len: sh.max_model_len });
        }
        if req.input.len() > sh.kv_capacity_tokens {
            return Err(SubmitError::Invalid(format!("the input ({} tokens) exceeds the whole KV cache ({} tokens); raise --kv-cache-memory", req.input.len(), sh.kv_capacity_tokens)));
        }
        if let Some(d) = req.dimensions {
            spec.check_dimensions(d).map_err(SubmitError::Invalid)?;
        }
        let (reply, rx) = oneshot::channel();
        let gen = GenerateRequest { prompt: req.input, adapter: req.adapter, max_tokens: 0, ..Default::default() };
        let stream = self.enqueue(gen, Some(EmbedJob { dimensions: req.dimensions, normalize: req.normalize, reply }), None)?;
        Ok(EmbedStream { stream, rx })
    }
}

impl Core {
    /// After a forward pass of an embedding engine: pool the rows sequence `si` got this step
    /// (`hidden` from `row` on), finish it when its input is complete. Returns the rows used.
    pub(super) fn take_embedding_rows(&mut self, si: usize, chunk: usize, row: usize) -> usize {
        let spec = self.embedding.as_ref().expect("an embedding engine");
        let dim = spec.dim;
        let (ri, complete) = {
            let s = self.seq(si);
            (s.req, s.num_computed == s.tokens.len())
        };
        let used = match spec.pooling {
            Pooling::Mean => chunk,
            Pooling::LastToken => complete as usize,
        };
        let hidden = &self.ws.host_hidden[row * dim..(row + used) * dim];
        let st = self.reqs[ri].as_mut().and_then(|r| r.embed.as_mut()).expect("an embedding request");
        match spec.pooling {
            Pooling::Mean => st.pool.add_rows(hidden, dim),
            Pooling::LastToken if complete => {
                st.pool.reset();
                st.pool.add_rows(hidden, dim);
            }
            Pooling::LastToken => {}
        }
        if complete {
            let pooled = st.pool.mean();
            if let Some(job) = st.job.take() {
                let v = spec.finish(pooled, job.dimensions, job.normalize);
                let _ = job.reply.send(v);
            }
            self.end_seq(si, FinishReason::Stop);
        }
        used
    }
}
