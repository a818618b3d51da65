//! vLLM's output options in the engine: `min_tokens`, `include_stop_str_in_output`,
//! `stop_reason`, `skip_special_tokens`, `logit_bias` and `allowed_token_ids`, on the tiny
//! random model (greedy, so every expectation follows from the unconstrained run).

mod common;

use common::*;
use quiver_engine::{Engine, EngineConfig, FinishReason, GenerateRequest, SamplingParams, StopReason};

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest { prompt, max_tokens, ignore_eos: true, ..Default::default() }
}

#[test]
fn stop_reason_min_tokens_include_stop_and_biases() {
    let lm = tiny(3);
    let vocab = lm.model.config.vocab_size;
    let h = Engine::start(lm, EngineConfig::default()).unwrap();
    let p = prompt(77, 12, vocab);
    let full = h.submit(greedy(p.clone(), 24)).unwrap().collect_blocking();
    let (toks, text) = (&full.tokens[0], &full.text[0]);
    assert_eq!(full.stop_reason[0], None, "a length finish has no stop reason");

    // A stop id: reported as the id; with min_tokens past it, it cannot be drawn that early.
    let sid = toks[2];
    let first = toks.iter().position(|&t| t == sid).unwrap();
    let c = h.submit(GenerateRequest { stop_token_ids: vec![sid], ..greedy(p.clone(), 24) }).unwrap().collect_blocking();
    assert_eq!((c.finish[0], c.stop_reason[0].clone()), (Some(FinishReason::Stop), Some(StopReason::Token(sid))));
    assert_eq!(c.tokens[0].len(), first + 1);
    let m = first + 4;
    let c = h.submit(GenerateRequest { stop_token_ids: vec![sid], min_tokens: m, ..greedy(p.clone(), 24) }).unwrap().collect_blocking();
    assert!(!c.tokens[0][..m].contains(&sid), "min_tokens: the stop id is not drawn among the first {m}");
    assert!(c.tokens[0].len() > m || c.finish[0] == Some(FinishReason::Length));

    // A stop string: reported as the string; kept in the text with include_stop_str_in_output.
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let cut = text.find(&stop).unwrap();
    let c = h.submit(GenerateRequest { stop: vec!["\u{1}never".into(), stop.clone()], ..greedy(p.clone(), 24) }).unwrap().collect_blocking();
    assert_eq!((c.text[0].as_str(), c.stop_reason[0].clone()), (&text[..cut], Some(StopReason::Text(stop.clone()))));
    let c = h.submit(GenerateRequest { stop: vec![stop.clone()], include_stop_str_in_output: true, ..greedy(p.clone(), 24) }).unwrap().collect_blocking();
    assert_eq!(c.text[0], text[..cut + stop.len()]);
    // min_tokens past the stop string's end: it is not matched in that text.
    let c = h.submit(GenerateRequest { stop: vec![stop.clone()], min_tokens: 24, ..greedy(p.clone(), 24) }).unwrap().collect_blocking();
    assert_eq!((c.text[0].as_str(), c.finish[0]), (text.as_str(), Some(FinishReason::Length)));

    // logit_bias forces a token; allowed_token_ids restricts the draw.
    let forced = toks[0] + 1;
    let c = h.submit(GenerateRequest { sampling: SamplingParams { logit_bias: vec![(forced, 100.0)], ..Default::default() }, ..greedy(p.clone(), 5) }).unwrap().collect_blocking();
    assert_eq!(c.tokens[0], vec![forced; 5]);
    let allowed = vec![toks[3], toks[5]];
    let c = h.submit(GenerateRequest { sampling: SamplingParams { allowed_token_ids: allowed.clone(), ..Default::default() }, ..greedy(p.clone(), 6) }).unwrap().collect_blocking();
    assert!(c.tokens[0].iter().all(|t| allowed.contains(t)), "{:?}", c.tokens[0]);
    let bad = h.submit(GenerateRequest { sampling: SamplingParams { logit_bias: vec![(vocab as u32, 1.0)], ..Default::default() }, ..greedy(p.clone(), 2) });
    assert!(bad.err().is_some_and(|e| e.to_string().contains("logit_bias")), "an out-of-vocabulary bias names the field");

    // skip_special_tokens: a special token's text appears only when asked for.
    let im_start = h.tokenizer().token_to_id("<|im_start|>").expect("SmolLM2 has <|im_start|>");
    let bias = SamplingParams { logit_bias: vec![(im_start, 100.0)], ..Default::default() };
    let c = h.submit(GenerateRequest { sampling: bias.clone(), ..greedy(p.clone(), 2) }).unwrap().collect_blocking();
    assert_eq!((c.tokens[0].clone(), c.text[0].as_str()), (vec![im_start; 2], ""));
    let c = h.submit(GenerateRequest { sampling: bias, skip_special_tokens: false, ..greedy(p.clone(), 2) }).unwrap().collect_blocking();
    assert_eq!(c.text[0], "<|im_start|><|im_start|>");
    h.shutdown_and_join();
}
