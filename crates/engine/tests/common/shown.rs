//! What requests' streams showed, gathered for comparing two engines (overlap on and off):
//! every stream checked on its own as it is received (nothing after `Finished`,
//! `completion_tokens` equal to the tokens shown, prompt logprobs once and first).

use quiver_engine::{EngineHandle, EngineStats, FinishReason, GenerateRequest, RequestStream, StopReason, StreamEvent, TokenLogprob};

/// What one sample of a request showed, in order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sample {
    pub tokens: Vec<u32>,
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finish: Option<(FinishReason, Option<StopReason>)>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Shown {
    pub samples: Vec<Sample>,
    pub prompt_logprobs: Option<Vec<TokenLogprob>>,
    pub error: Option<String>,
}

/// Receives `s` to its end; with `cancel_after`, cancels once sample 0 has shown that many
/// tokens and keeps receiving what was already on its way.
pub fn receive(mut s: RequestStream, cancel_after: Option<usize>) -> Shown {
    let mut out = Shown { samples: vec![Sample::default(); s.n()], ..Default::default() };
    let mut done = 0;
    while done < s.n() {
        let Some(ev) = s.blocking_recv() else { panic!("the stream ended before every sample finished: {out:?}") };
        match ev {
            StreamEvent::Token { index, token_id, text, logprob } => {
                let x = &mut out.samples[index];
                assert!(x.finish.is_none(), "sample {index} showed token {token_id} after it finished");
                x.tokens.push(token_id);
                x.text.push_str(&text);
                x.logprobs.extend(logprob);
                if index == 0 && cancel_after == Some(x.tokens.len()) {
                    s.cancel();
                }
            }
            StreamEvent::Finished { index, reason, stop_reason, completion_tokens, .. } => {
                let x = &mut out.samples[index];
                assert!(x.finish.is_none(), "sample {index} finished twice");
                assert_eq!(completion_tokens, x.tokens.len(), "sample {index}: completion_tokens against the tokens it showed");
                x.finish = Some((reason, stop_reason));
                done += 1;
            }
            StreamEvent::PromptLogprobs(lp) => {
                assert!(out.prompt_logprobs.is_none() && out.samples.iter().all(|x| x.tokens.is_empty()), "prompt logprobs once, before any token");
                out.prompt_logprobs = Some(lp);
            }
            StreamEvent::Error(e) => out.error = Some(e),
        }
    }
    out
}

/// Submits every request at once and receives each on its own thread (`cancel[i]`: cancel
/// request i after that many tokens, while it runs).
pub fn run(h: &EngineHandle, reqs: &[GenerateRequest], cancel: &[Option<usize>]) -> Vec<Shown> {
    let streams: Vec<_> = reqs.iter().map(|r| h.submit(r.clone()).unwrap()).collect();
    std::thread::scope(|sc| {
        let threads: Vec<_> = streams.into_iter().zip(cancel).map(|(s, &c)| sc.spawn(move || receive(s, c))).collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

/// After everything finished: no block held, no request or sequence left.
pub fn assert_idle(h: &EngineHandle) {
    let d = h.debug_state().unwrap();
    d.kv_invariants.clone().unwrap();
    assert_eq!((d.kv_in_use, d.requests, d.running_seqs, d.waiting_seqs, d.queued), (0, 0, 0, 0, 0), "{d:?}");
    assert!(d.lora_versions.iter().all(|v| v.2 == 0), "adapter versions still in flight: {d:?}");
}

pub fn assert_same(label: &str, on: &[Shown], off: &[Shown]) {
    assert_eq!(on.len(), off.len());
    for (i, (a, b)) in on.iter().zip(off).enumerate() {
        assert!(a.error.is_none() && b.error.is_none(), "{label}: request {i}: {:?} / {:?}", a.error, b.error);
        for (j, (x, y)) in a.samples.iter().zip(&b.samples).enumerate() {
            let at = x.tokens.iter().zip(&y.tokens).position(|(p, q)| p != q).unwrap_or(x.tokens.len().min(y.tokens.len()));
            assert_eq!(x.tokens, y.tokens, "{label}: request {i} sample {j}: tokens differ from position {at} with overlap on (left) and off (right)");
            assert_eq!(x, y, "{label}: request {i} sample {j} differs with overlap on (left) and off (right)");
        }
        assert_eq!(a, b, "{label}: request {i} differs with overlap on (left) and off (right)");
    }
}

/// Overlap must have been used, not just allowed.
pub fn assert_overlapped(label: &str, st: &EngineStats) {
    eprintln!("{label}: {} of {} steps overlapped", st.overlapped_steps, st.steps);
    assert!(st.overlapped_steps * 2 > st.steps, "{label}: most steps should overlap the next: {st:?}");
}
