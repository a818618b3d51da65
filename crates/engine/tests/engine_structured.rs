//! Structured output in the batched engine on the tiny random model: constrained rows match
//! their regex or choice whatever the (random) model prefers, each sample of `n > 1` follows
//! the grammar on its own, an unconstrained row in the same batches is unchanged, a grammar
//! dead end finishes only its own row, and a grammar that does not compile is refused.

mod common;

use common::*;
use quiver_engine::{Constraint, Engine, EngineConfig, FinishReason, GenerateRequest, SamplingParams, StopReason, SubmitError};

fn req(p: &[u32], max_tokens: usize, c: Option<Constraint>) -> GenerateRequest {
    GenerateRequest { prompt: p.to_vec(), max_tokens, ignore_eos: true, constraint: c, ..Default::default() }
}

#[test]
fn constrained_rows_match_and_leave_other_rows_alone() {
    let lm = tiny(5);
    let vocab = lm.model.config.vocab_size;
    let p = prompt(9, 14, vocab);
    let plain_alone = alone(&lm.model, None, &p, 16, &[]);
    let h = Engine::start(lm, EngineConfig::default()).unwrap();
    let re = regex::Regex::new(r"^[0-9]{3}-[a-z]{2}$").unwrap();
    let choices = vec!["alpha".to_string(), "beta gamma".to_string(), "7".to_string()];
    let sampled = SamplingParams { temperature: 1.0, seed: Some(3), ..Default::default() };
    // Submitted together: they share every step.
    let s_re = h.submit(req(&p, 32, Some(Constraint::Regex("[0-9]{3}-[a-z]{2}".into())))).unwrap();
    let s_choice = h.submit(GenerateRequest { n: 3, sampling: sampled, ..req(&p, 32, Some(Constraint::Choice(choices.clone()))) }).unwrap();
    let s_plain = h.submit(req(&p, 16, None)).unwrap();
    let s_dead = h.submit(GenerateRequest {
        // Only letters may be drawn, but the grammar wants a digit first.
        sampling: SamplingParams { allowed_token_ids: vec![h.tokenizer().token_to_id("a").unwrap()], ..Default::default() },
        ..req(&p, 8, Some(Constraint::Regex("[0-9]+".into())))
    })
    .unwrap();
    let c = s_re.collect_blocking();
    assert!(re.is_match(&c.text[0]), "{:?}", c.text[0]);
    assert_eq!(c.finish[0], Some(FinishReason::Stop), "a complete grammar ends the output");
    let c = s_choice.collect_blocking();
    for i in 0..3 {
        assert!(choices.contains(&c.text[i]), "sample {i}: {:?}", c.text[i]);
        assert_eq!(c.finish[i], Some(FinishReason::Stop));
    }
    assert_eq!(s_plain.collect_blocking().tokens[0], plain_alone, "the unconstrained row is unchanged");
    let c = s_dead.collect_blocking();
    assert_eq!(c.finish[0], Some(FinishReason::Abort));
    assert!(matches!(&c.stop_reason[0], Some(StopReason::Grammar(m)) if m.contains("dead end")), "{:?}", c.stop_reason[0]);
    assert!(c.tokens[0].is_empty());
    // A grammar that does not compile is refused at submission, with the reason.
    match h.submit(req(&p, 4, Some(Constraint::Regex("([0-9]".into())))) {
        Err(SubmitError::InvalidConstraint(m)) => assert!(!m.is_empty()),
        other => panic!("expected InvalidConstraint, got {:?}", other.map(|_| ())),
    }
    assert!(matches!(h.submit(req(&p, 4, Some(Constraint::JsonSchema(serde_json::json!({"type": "no-such-type"}))))), Err(SubmitError::InvalidConstraint(_))));
    h.shutdown_and_join();
}
