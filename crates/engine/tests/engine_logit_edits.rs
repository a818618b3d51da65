//! Rows with logit edits (logit bias, repetition / presence / frequency penalties, a
//! `min_tokens` ban, allowed ids, a regex or JSON-schema grammar) draw on the model's device
//! after `Device::edit_logits`, and give exactly the tokens (and logprobs) of the host path the
//! engine drew them through before: each request decoded alone on the real SmolLM2 with the
//! `Sampler`'s penalties, the ban and the grammar's mask applied to host logits, then the
//! host draw. Greedy and seeded, `n > 1` (whose samples share their first row), all submitted
//! together, with overlapped scheduling on and off; the statistics show no step brought logits
//! to the host for them, and one that scores a prompt does.

mod common;

use common::*;
use quiver_engine::structured::Grammars;
use quiver_engine::{BaseOnly, Constraint, Engine, EngineConfig, FinishReason, GenerateRequest, Generator, Sampler, SamplingParams, StopReason};
use quiver_kernels::DType;
use quiver_model::tokenizer::Tokenizer;

/// What one sample of a request got: its tokens, the logprobs of each (when asked), and whether
/// its grammar reached a dead end.
#[derive(Debug, PartialEq)]
struct Sample {
    tokens: Vec<u32>,
    logprobs: Vec<(f32, Vec<u32>)>,
    dead_end: bool,
}

/// Sample `index` of `req` decoded alone through the old host path: the logits on the host,
/// `Sampler::apply_penalties`, vLLM's min_tokens ban on stop ids and EOS, the grammar's mask,
/// the host draw, the grammar advanced; the engine's stop rules (stop ids, EOS, a complete
/// grammar, max_tokens).
fn host_path(g: &mut Generator, grammars: &Grammars, eos: &[u32], req: &GenerateRequest, index: usize) -> Sample {
    let params = SamplingParams { seed: req.sampling.seed.map(|s| s.wrapping_add(index as u64)), ..req.sampling.clone() };
    let mut sampler = Sampler::new(params, &req.prompt);
    let mut guide = req.constraint.as_ref().map(|c| grammars.compile(c).unwrap());
    let mut logits = g.logits_after(&req.prompt, 0, &mut BaseOnly).to_vec();
    let mut out = Sample { tokens: Vec::new(), logprobs: Vec::new(), dead_end: false };
    let ending: Vec<u32> = req.stop_token_ids.iter().chain(if req.ignore_eos { &[] } else { eos }).copied().collect();
    for i in 0..req.max_tokens {
        sampler.apply_penalties(&mut logits);
        if i < req.min_tokens {
            for &t in &ending {
                logits[t as usize] = f32::NEG_INFINITY;
            }
        }
        if let Some(guide) = guide.as_mut() {
            if guide.mask(&mut logits).is_err() {
                out.dead_end = true;
                break;
            }
        }
        let tok = sampler.sample(&logits);
        if let Some(k) = req.logprobs {
            let lp = quiver_engine::sampling::token_logprob(&logits, tok, k);
            out.logprobs.push((lp.logprob, lp.top.iter().map(|t| t.0).collect()));
        }
        sampler.observe(tok);
        out.tokens.push(tok);
        let grammar_done = guide.as_mut().is_some_and(|g| g.advance(tok).is_err() || g.is_finished());
        if ending.contains(&tok) || grammar_done {
            break;
        }
        logits = g.logits_after(&[tok], req.prompt.len() + i, &mut BaseOnly).to_vec();
    }
    out
}

fn chat(tok: &Tokenizer, user: &str) -> Vec<u32> {
    tok.encode(&format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"), false).unwrap()
}

/// Every kind of edit, alone and together, greedy and seeded; and a plain row beside them.
fn requests(tok: &Tokenizer) -> Vec<GenerateRequest> {
    let id = |s: &str| tok.token_to_id(s).unwrap_or_else(|| panic!("no token {s:?}"));
    let base = |user: &str, max_tokens: usize| GenerateRequest { prompt: chat(tok, user), max_tokens, ..Default::default() };
    let seeded = |seed: u64| SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.95, seed: Some(seed), ..Default::default() };
    let schema = serde_json::json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}, "required": ["name", "age"]});
    // Ids of ordinary words: what allowed_token_ids keeps (sorted, as the server and the
    // engine's submission leave them).
    let mut words: Vec<u32> = ["The", "Ġcat", "Ġdog", "Ġsat", "Ġon", "Ġthe", "Ġmat", ".", "Ġand", "Ġran", "Ġa", "Ġbig", "Ġred", "Ġhouse", "!"].iter().map(|w| id(w)).collect();
    words.sort_unstable();
    vec![
        GenerateRequest { sampling: SamplingParams { logit_bias: vec![(id("Ġblue"), 4.0), (id("Ġthe"), -100.0), (id("Ġblue"), 0.5)], ..Default::default() }, logprobs: Some(3), ..base("Name a colour of the sky.", 12) },
        GenerateRequest { sampling: SamplingParams { repetition_penalty: 1.4, ..Default::default() }, ..base("Write a list of fruits.", 24) },
        GenerateRequest { sampling: SamplingParams { presence_penalty: 0.8, frequency_penalty: 0.6, ..seeded(11) }, logprobs: Some(2), ..base("Tell me about rivers.", 24) },
        GenerateRequest { min_tokens: 10, stop_token_ids: vec![id(".")], ..base("Say hi.", 20) },
        GenerateRequest { sampling: SamplingParams { allowed_token_ids: words.clone(), ..seeded(5) }, ..base("Describe a pet.", 16) },
        GenerateRequest { constraint: Some(Constraint::Regex("[0-9]{3}-[a-z]{4}".into())), ..base("Give me a code.", 16) },
        GenerateRequest { constraint: Some(Constraint::JsonSchema(schema.clone())), sampling: seeded(23), ..base("Describe a person as JSON.", 40) },
        GenerateRequest {
            constraint: Some(Constraint::JsonSchema(schema)),
            sampling: SamplingParams { repetition_penalty: 1.2, logit_bias: vec![(id("Ġ\""), 1.0)], frequency_penalty: 0.3, ..seeded(31) },
            min_tokens: 6,
            logprobs: Some(1),
            ..base("A person, in JSON.", 40)
        },
        // Its samples draw their first token from one row, edited once.
        GenerateRequest { n: 3, constraint: Some(Constraint::Regex("(yes|no|maybe), [a-z]+".into())), sampling: SamplingParams { presence_penalty: 0.5, ..seeded(41) }, ..base("Will it rain?", 12) },
        // Only letters allowed, a grammar that wants digits: a dead end at once.
        GenerateRequest { constraint: Some(Constraint::Regex("[0-9]+".into())), sampling: SamplingParams { allowed_token_ids: vec![id("a")], ..Default::default() }, ..base("Count.", 8) },
        base("What is the capital of France?", 16),
    ]
}

#[test]
fn edited_rows_draw_on_the_device_as_the_host_path_drew_them() {
    let lm = load(&smollm2_gguf(), DType::F32);
    let tok = &lm.tokenizer;
    let vocab = lm.model.config.vocab_size;
    let grammars = Grammars::new(tok, vocab).unwrap();
    let eos = tok.eos_token_ids().to_vec();
    let reqs = requests(tok);
    let want: Vec<Vec<Sample>> = reqs
        .iter()
        .map(|r| {
            (0..r.n)
                .map(|i| {
                    let mut g = Generator::new(&lm.model, r.prompt.len() + r.max_tokens + 1);
                    host_path(&mut g, &grammars, &eos, r, i)
                })
                .collect()
        })
        .collect();
    // The cases must reach what they are for.
    assert!(want[3][0].tokens.len() > 10 && want[3][0].tokens[..10].iter().all(|t| *t != tok.token_to_id(".").unwrap() && !eos.contains(t)), "min_tokens: {:?}", want[3][0].tokens);
    assert!(want[9][0].dead_end && want[9][0].tokens.is_empty());
    assert!(regex::Regex::new("^[0-9]{3}-[a-z]{4}$").unwrap().is_match(&tok.decode(&want[5][0].tokens, true).unwrap()));
    drop(lm);
    for overlap in [true, false] {
        let h = Engine::start(load(&smollm2_gguf(), DType::F32), EngineConfig { disable_overlap_schedule: !overlap, ..Default::default() }).unwrap();
        let streams: Vec<_> = reqs.iter().map(|r| h.submit(r.clone()).unwrap()).collect();
        for (i, (s, want)) in streams.into_iter().zip(&want).enumerate() {
            let c = s.collect_blocking();
            for (k, w) in want.iter().enumerate() {
                let logprobs: Vec<(f32, Vec<u32>)> = c.logprobs[k].iter().map(|l| (l.logprob, l.top.iter().map(|t| t.0).collect())).collect();
                let dead_end = c.finish[k] == Some(FinishReason::Abort) && matches!(&c.stop_reason[k], Some(StopReason::Grammar(m)) if m.contains("dead end"));
                let got = Sample { tokens: c.tokens[k].clone(), logprobs, dead_end };
                assert_eq!(&got, w, "request {i} sample {k} (overlap {overlap}): {:?}", c.text[k]);
            }
        }
        let st = h.stats();
        eprintln!("overlap {overlap}: {st:?}");
        assert_eq!(st.logits_to_host_steps, 0, "no edited row brings logits to the host");
        assert!(st.edited_rows >= 100, "the edited rows went through the op: {st:?}");
        assert_eq!(st.overlapped_steps > 0, overlap, "steps with edited rows overlap: {st:?}");
        // Prompt scoring is what still needs the host.
        let scored = GenerateRequest { prompt_logprobs: Some(1), ..reqs[0].clone() };
        h.submit(scored).unwrap().collect_blocking();
        assert!(h.stats().logits_to_host_steps > 0);
        h.shutdown_and_join();
    }
}
