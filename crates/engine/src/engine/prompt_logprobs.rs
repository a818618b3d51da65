//! Prompt scoring (vLLM's `prompt_logprobs`, what `echo` + `logprobs` and lm-eval's
//! loglikelihood requests need): the logprob of every prompt token after the first under the
//! model's raw logits.
//!
//! Row `j` of a sequence predicts token `j + 1`, so a prefill chunk over `[start, end)` asks
//! the model for logits on every row (`LogitsFor::All`) while prompt tokens in
//! `start + 1..=end` are still unscored; other sequences' rows are unaffected (the LM head is
//! row-independent). `Req::prompt_lp_next` is the next prompt index to score, so a sequence
//! preempted and recomputed never scores a token twice, and admission never takes prefix-cache
//! blocks covering rows still to be scored (their logits were never kept).

use super::*;

/// Most rows one scoring sequence runs in a step: its logits (`rows × vocab` floats, 50 MB at
/// 256 rows of a 49k vocabulary) are held on the device and the host until sampled.
pub(super) const SCORE_CHUNK_ROWS: usize = 256;

impl Core {
    /// Whether rows `[start, end)` of `si` include rows whose logits score prompt tokens.
    pub(super) fn scores_prompt_rows(&self, si: usize, start: usize, end: usize) -> bool {
        let r = self.req(self.seq(si).req);
        r.prompt_logprobs.is_some() && r.prompt_lp_next < r.prompt_len && start + 1 < r.prompt_len && end >= r.prompt_lp_next
    }

    /// Longest prefill chunk `si` may run in one step.
    pub(super) fn prefill_cap(&self, si: usize) -> usize {
        let r = self.req(self.seq(si).req);
        if r.prompt_logprobs.is_some() && r.prompt_lp_next < r.prompt_len {
            self.cfg.chunked_prefill_size.min(SCORE_CHUNK_ROWS)
        } else {
            self.cfg.chunked_prefill_size
        }
    }

    /// Prefix-cache blocks `si` may take at admission: none covering rows still to be scored.
    pub(super) fn max_prefix_blocks(&self, si: usize) -> usize {
        let bs = self.pool.block_size();
        let s = self.seq(si);
        let r = self.req(s.req);
        let all = (s.tokens.len() - 1) / bs;
        if r.prompt_logprobs.is_some() && r.prompt_lp_next < r.prompt_len {
            all.min((r.prompt_lp_next - 1) / bs)
        } else {
            all
        }
    }

    /// Scores the prompt tokens predicted by rows `[start, end)` of `si`, whose logits are the
    /// host logits rows `row0..row0 + (end - start)`.
    pub(super) fn score_prompt_rows(&mut self, si: usize, row0: usize, start: usize, end: usize) {
        let vocab = self.model.config.vocab_size;
        let s = self.seqs[si].as_ref().expect("live sequence");
        let r = self.reqs[s.req].as_mut().expect("live request");
        let k = r.prompt_logprobs.expect("scoring request");
        let from = start.max(r.prompt_lp_next - 1);
        let to = end.min(r.prompt_len - 1);
        for j in from..to {
            let row = row0 + j - start;
            let logits = &self.ws.host_logits[row * vocab..(row + 1) * vocab];
            r.prompt_lps.push(sampling::token_logprob(logits, s.tokens[j + 1], k));
        }
        r.prompt_lp_next = r.prompt_lp_next.max(to + 1);
    }

    /// The prompt of `si` has run: send its prompt logprobs (once). False when the request
    /// asked for no generated tokens (`max_tokens` 0, scoring only): it is finished here.
    pub(super) fn finish_prompt(&mut self, si: usize) -> bool {
        let ri = self.seq(si).req;
        let r = self.req_mut(ri);
        if r.prompt_logprobs.is_none() || r.prompt_lps_sent {
            return true;
        }
        r.prompt_lps_sent = true;
        let lps = std::mem::take(&mut r.prompt_lps);
        let _ = r.tx.send(StreamEvent::PromptLogprobs(lps));
        if r.max_tokens == 0 {
            self.end_seq(si, FinishReason::Length);
            return false;
        }
        true
    }
}
